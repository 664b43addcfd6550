"""Downloading from the Hub into the Hugging Face cache: a GGUF model's files, or a checkpoint.

`huggingface_hub.hf_hub_download` does the transfer: resumable (an interrupted download's
`.incomplete` blob is continued with a range request), with its progress bar, honouring `HF_HOME`,
`HF_TOKEN` and `HF_HUB_OFFLINE`. ctxq adds the choice of files and a disk-space check first.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ..errors import ConversionError, HubError
from ..units import GiB
from .cache import hf_cached
from .headers import HUB_FILES, gguf_files
from .http import hub_errors
from .ref import HubRef

log = logging.getLogger(__name__)


def download_gguf(ref: HubRef) -> Path:
    """The local path of the model `ref` names, downloading what the cache lacks (every shard); a
    split model's first shard, which is what llama.cpp loads (it finds the others beside it)."""
    from huggingface_hub import constants, hf_hub_download

    got, paths = gguf_files(ref)
    cached = hf_cached(got, paths)
    if cached:
        return cached[0]
    cache = Path(constants.HF_HUB_CACHE)
    need = sum(got.files[p] for p in paths if not hf_cached(got, [p]))
    check_space(cache, need, str(ref))
    out = []
    for p in paths:
        log.info("downloading %s/%s (%d bytes)", got.repo, p, got.files[p])
        with hub_errors(got.repo, ref.revision):
            out.append(Path(hf_hub_download(got.repo, p, revision=got.commit)))
    return out[0]


def check_space(folder: Path, need: int, what: str) -> None:
    """Refuse a download that cannot fit on the disk holding `folder` (before any byte is written)."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise HubError(f"{what} needs {need / GiB:.1f} GiB in {folder} but the disk has {free / GiB:.1f} GiB free; "
                       "free some space or set HF_HOME to another disk", value=need, limit=free)


def download_checkpoint(repo: str, revision: str | None = None) -> Path:
    """The local snapshot folder of a safetensors checkpoint: config, weights and tokenizer files."""
    from huggingface_hub import snapshot_download

    log.info("downloading %s%s (config, safetensors, tokenizer files)", repo, f"@{revision}" if revision else "")
    with hub_errors(repo, revision):
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES))
    if not any(path.glob("*.safetensors")):
        raise ConversionError(f"{repo} has no safetensors weights; ctxq reads safetensors only "
                              "(PyTorch pickles can run code)")
    return path
