"""Headers of Hub files, read with HTTP range requests; never the weights.

A GGUF file's key/value metadata and tensor index (every shard of a split model) are read by the
same strict, bounded reader as local files (`ctxq.gguf.reader.parse_gguf` on a `RangedFile`); a
safetensors checkpoint's config and tokenizer files are fetched whole and each weight file's
8-byte length and JSON header only. Both are kept as header-only copies (`hub.cache`), so a second
plan reads nothing, and the planner works on them as on local files.
"""

from __future__ import annotations

import logging
import struct
from fnmatch import fnmatch
from pathlib import Path

from ..errors import ConversionError, HubError
from ..gguf.reader import GGUFFile, parse_gguf
from ..gguf.shards import read_model
from ..units import MiB
from .cache import hf_cached, header_path, listing, write_header_copy
from .http import Listing, RangedFile
from .ref import HubRef, pick_gguf, quants

log = logging.getLogger(__name__)

# Bounds a hostile header's claimed lengths (the reader bounds them by the file size, which for a
# 40 GB file is no bound). Llama 3's header, a 128k-token vocabulary, is 8.6 MB; gemma-3's 262k, 11 MB.
MAX_GGUF_HEADER = 256 * MiB
MAX_SAFETENSORS_HEADER = 100 * MiB  # the safetensors format's own cap (safetensors/src/tensor.rs)

# what `ctxq convert` reads besides the weights (config, tokenizer); never pickles (*.bin, *.pt)
SMALL_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "chat_template.jinja"]
HUB_FILES = SMALL_FILES + ["*.safetensors"]

_memo: dict[tuple, GGUFFile] = {}


def gguf_files(ref: HubRef) -> tuple[Listing, list[str]]:
    """The repo at the revision, and the files (shards, first first) `ref` names."""
    got = listing(ref.repo, ref.revision)
    return got, pick_gguf(ref, got.files)


def gguf_header(ref: HubRef) -> GGUFFile:
    """The header of the model `ref` names, all shards merged (`gguf.reader.read_model`). Downloaded
    weights are read locally; otherwise the headers are read remotely once and kept as copies."""
    got, paths = gguf_files(ref)
    local = hf_cached(got, paths)
    if local:
        return read_model(local[0])
    key = (got.repo, got.commit, tuple(paths))
    if key in _memo:
        return _memo[key]
    fetched = 0
    # the first shard last: its copy, the file llama.cpp opens (it finds the others by name beside it), is there only
    # when every shard's is; each copy appears whole or not at all (write_header_copy)
    for p in reversed(paths):
        out = header_path(got, p)
        if not out.is_file():
            fetched += _copy_gguf_header(got, p, out)
    g = read_model(header_path(got, paths[0]))
    g.source, g.bytes_read = str(ref), fetched
    _memo[key] = g
    return g


def _copy_gguf_header(got: Listing, path: str, out: Path) -> int:
    src = RangedFile(got.repo, path, got.commit, got.files[path])
    name = Path(f"{got.repo}/{path}")
    g = parse_gguf(src, src.size, name, skip_arrays=True, limit=MAX_GGUF_HEADER)
    write_header_copy(out, bytes(src.data[:g.data_offset]), src.size)
    log.info("read the header of %s: %d bytes in %d requests", name, len(src.data), src.requests)
    return len(src.data)


def checkpoint_headers(repo: str, revision: str | None = None) -> tuple[Path, int]:
    """A local folder that stands for a safetensors checkpoint on the Hub: its config and tokenizer
    files, and header-only copies of its weight files; and the bytes fetched for it."""
    got = listing(repo, revision)
    weights = [f for f in got.files if f.endswith(".safetensors") and "/" not in f]
    if not weights:
        return _no_safetensors(got)
    folder = header_path(got, "")
    fetched = 0
    for p in [f for f in got.files if f in SMALL_FILES] + weights:
        out = folder / p
        if out.is_file():
            continue
        src = RangedFile(got.repo, p, got.commit, got.files[p])
        if p.endswith(".safetensors"):
            write_header_copy(out, _safetensors_header(src, p), src.size)
        else:
            write_header_copy(out, src.read(src.size), src.size)
        fetched += len(src.data)
    return folder, fetched


def _safetensors_header(src: RangedFile, path: str) -> bytes:
    """The 8-byte little-endian length and the JSON header it counts (the safetensors format)."""
    head = src.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < n <= min(src.size - 8, MAX_SAFETENSORS_HEADER):
        raise ConversionError(f"{src.repo}/{path}: not a safetensors file (bad header length)")
    return head + src.read(n)


def _no_safetensors(got: Listing):
    if any(f.endswith(".gguf") for f in got.files):
        raise HubError(f"{got.repo} is a GGUF repo: name a quantization as {got.repo}:TAG "
                       f"(it has {', '.join(quants(got.files))})")
    pickles = [f for f in got.files if fnmatch(f, "*.bin") or fnmatch(f, "*.pt")]
    raise ConversionError(f"{got.repo} has no safetensors weights" + (
        "; ctxq reads safetensors only (PyTorch pickles can run code)" if pickles else ""))

