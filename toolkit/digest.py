"""A file's SHA-256, remembered per (path, inode, size, mtime) under ctxq's home so that a rerun does not read the
file again: what names a model in the quantization cache, a checkpoint's conversion and a saved session."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from . import tempfiles
from .paths import ctxq_home


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file, remembered per (path, inode, size, mtime) so a rerun does not reread it."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = [str(path), st.st_ino, st.st_size, st.st_mtime_ns]
    memo = ctxq_home() / "cache" / "digests" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
    try:
        rec = json.loads(memo.read_text())
        if rec["stamp"] == stamp:
            return rec["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    part = tempfiles.create(memo, "json")
    try:
        part.write_text(json.dumps({"stamp": stamp, "sha256": digest}, indent=1))
        os.replace(part, memo)
    finally:
        part.unlink(missing_ok=True)
    return digest


def sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
