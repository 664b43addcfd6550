"""Fetching a Hugging Face checkpoint: only the files the converter reads.

`huggingface_hub.snapshot_download` puts them in the Hugging Face cache and itself honours
`HF_HOME`, `HF_TOKEN` and `HF_HUB_OFFLINE`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ..errors import ConversionError

log = logging.getLogger(__name__)

# config, weights and their index, tokenizer files; never pickles (*.bin, *.pt).
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json", "chat_template.jinja"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.endswith((".gguf", ".safetensors"))


def download(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (a branch, tag or commit)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    log.info("downloading %s%s (config, safetensors, tokenizer files)", repo_id, f"@{revision}" if revision else "")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except GatedRepoError:
        raise ConversionError(f"{repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ConversionError(f"{repo_id}: no such model on the Hugging Face hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConversionError(f"{repo_id}: no revision {revision!r}; pass an existing branch, tag or commit") from None
    except LocalEntryNotFoundError:
        raise ConversionError(f"{repo_id} is not in the Hugging Face cache and the hub cannot be reached "
                              "(HF_HUB_OFFLINE is set or no network); download it first or pass a local folder") from None
    except HfHubHTTPError as e:
        raise ConversionError(f"{repo_id}: download failed ({str(e).splitlines()[0]})") from None
    if not any(path.glob("*.safetensors")):
        raise ConversionError(f"{repo_id} has no safetensors weights; ctxq reads safetensors only "
                              "(PyTorch pickles can run code)")
    return path
