"""Where a conversion writes, and whether it needs to write at all.

A rerun of the same conversion (same source contents, type, settings, ctxq and llama.cpp) into the
same path is "up to date": nothing is read beyond the headers and nothing is written, as `make` or a
huggingface_hub download would do. What a file at a path came from is kept in a small record in
ctxq's cache, keyed by the resolved output path (`records_dir()`), together with the file's size,
mtime and inode as they were right after it was written:

- no file at the path: convert;
- a file with a record that names the same source and type: up to date when the key is equal,
  converted again (replaced) when the source changed or a setting did;
- a file with a record of another source or type, or one ctxq did not write (no record, or it was
  changed since): refused unless `force`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from enum import Enum
from pathlib import Path

from .. import tempfiles
from ..errors import ConversionError
from ..paths import ctxq_home

log = logging.getLogger(__name__)


class State(Enum):
    NEW = "new"  # convert (no file there, or force)
    UP_TO_DATE = "up to date"  # the file is this conversion: do nothing
    STALE = "stale"  # the file is this source and type from other contents or settings: replace it


def records_dir() -> Path:
    """Beside the quantization records (`ctxq cache clean quantize` clears both: the next
    conversion into an existing file then asks for force=True instead of guessing)."""
    return ctxq_home() / "cache" / "quantize" / "outputs"


def _record_path(dest: Path) -> Path:
    return records_dir() / (hashlib.sha256(str(dest.resolve()).encode()).hexdigest()[:32] + ".json")


def _stamp(dest: Path) -> list[int]:
    st = dest.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _ours(dest: Path) -> dict | None:
    """The record of `dest` when ctxq wrote the file there and it is unchanged since."""
    try:
        rec = json.loads(_record_path(dest).read_text())
        return rec if rec["stamp"] == _stamp(dest) else None
    except (OSError, ValueError, KeyError):
        return None


def _as_stored(key: dict) -> dict:
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def holds(dest: Path, source: str, type: str, key: dict) -> bool:
    """Whether `dest` is, unchanged since ctxq wrote it, this conversion of `source` to `type`."""
    rec = _ours(dest)
    return rec is not None and (rec["source"], rec["type"]) == (source, type) and rec["key"] == _as_stored(key)


def state(dest: Path, source: str, type: str, key: dict, force: bool) -> State:
    """What to do for a conversion of `source` to `type` (its bytes determined by `key`) at `dest`;
    raises ConversionError where an existing file must not be replaced without `force`."""
    if force or not dest.exists():
        return State.NEW
    rec = _ours(dest)
    if rec is None:
        raise ConversionError(f"{dest} exists; pass force=True to replace it or another `output` path")
    if (rec["source"], rec["type"]) != (source, type):
        raise ConversionError(f"{dest} holds a conversion of {rec['source']} to {rec['type']}; pass force=True "
                              f"to replace it with {source} as {type}, or another `output` path")
    if rec["key"] == _as_stored(key):
        return State.UP_TO_DATE
    changed = sorted(k for k in set(key) | set(rec["key"]) if rec["key"].get(k) != key.get(k))
    log.info("%s: %s changed since it was converted; converting again", dest, ", ".join(changed))
    return State.STALE


def remember(dest: Path, source: str, type: str, key: dict) -> None:
    """Record what `dest` was just made from (after it was renamed into place)."""
    path = _record_path(dest)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = tempfiles.create(path, "json")
    try:
        part.write_text(json.dumps({"path": str(dest.resolve()), "source": source, "type": type,
                                    "key": key, "stamp": _stamp(dest)}, sort_keys=True, default=str))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def place(done: Path, dest: Path) -> None:
    """Put the finished file `done` (a cached result) at `dest` too: a hard link, which costs neither time nor
    disk, or a copy where the file system has none (another device); atomic, as every output here."""
    part = tempfiles.create(dest, "copy")
    try:
        part.unlink()
        try:
            os.link(done, part)
        except OSError:  # EXDEV across file systems, EPERM where links are not allowed
            shutil.copyfile(done, part)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def writable(dest: Path) -> None:
    """Create `dest`'s folder and check a file can be created beside it, before any work: an
    unwritable destination is one line naming it (never the temporary's name), and nothing is left."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfiles.create(dest, "probe")
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ConversionError(f"cannot write {dest} ({why}); choose an `output` path in a folder you can "
                              "write to") from None
    probe.unlink(missing_ok=True)
