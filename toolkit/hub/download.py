"""Downloading from the Hub into the Hugging Face cache: a GGUF model's files, or a checkpoint.

huggingface_hub does the transfers (`http_get`, with its progress bar and its retries, which resume
a dropped connection with a range request) and the cache's layout (`hf_hub_download`), honouring
`HF_HOME`, `HF_TOKEN` and `HF_HUB_OFFLINE`. Since huggingface_hub 1.x a download that is stopped
(Ctrl-C, a killed process) loses its partial file (a per-process temporary, huggingface_hub PR
#4228), and a 40 GB GGUF would start again: so ctxq keeps a GGUF's partial blob under a stable name
beside the cache's blobs, continues it with a range request, and hands the finished blob to
`hf_hub_download`, which then only links it into the snapshot. ctxq also checks the disk first.
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
        with hub_errors(got.repo, ref.revision):
            _fetch_blob(got.repo, p, got.commit)
            out.append(Path(hf_hub_download(got.repo, p, revision=got.commit)))
    return out[0]


def _fetch_blob(repo: str, path: str, commit: str) -> None:
    """Put the file's blob into the Hugging Face cache, continuing a partial one left by a stopped run."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    meta = get_hf_file_metadata(hf_hub_url(repo, path, revision=commit))
    if not meta.etag:
        return  # no blob name to keep a partial under: hf_hub_download fetches it whole
    blob = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "blobs" / meta.etag
    part = blob.with_name(meta.etag + ".ctxq-partial")
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(part.with_name(part.name + ".lock")):
        if blob.exists():
            return
        with open(part, "ab") as f:
            done = f.tell()
            log.info("downloading %s/%s (%d bytes%s)", repo, path, meta.size or 0,
                     f", continuing from {done}" if done else "")
            if meta.size is None or done < meta.size:
                http_get(meta.location, f, resume_size=done, headers=build_hf_headers(), expected_size=meta.size,
                         displayed_filename=path.rsplit("/", 1)[-1])
        part.replace(blob)


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


def cached_checkpoint(repo: str, revision: str | None = None) -> Path | None:
    """The Hugging Face cache's snapshot of a checkpoint at `revision` (a branch or tag through the cache's
    refs), without asking the Hub; None when the cache holds none, or one huggingface_hub knows is incomplete."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    return path if any(path.glob("*.safetensors")) else None
