"""A model is read once per command: inside `opened()`, what was parsed of a file is kept by the file's identity
(path, device, inode, size, modification time) and a later reading of the same, unchanged file is served from it
(`ctxq.gguf.reader.read_gguf` asks here first). Outside a scope nothing is kept: a library call reads afresh."""

from __future__ import annotations

import contextlib
import functools
import os


def file_stamp(path: str | os.PathLike) -> tuple | None:
    """What tells one version of a file from another: (device, inode, size, modification time); None for a path that
    cannot be read. A cache of what a file's header says keys on it beside the path."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


# Inside `opened()`: what was read of each file, by the file's identity (path, device, inode, size, mtime).
_parsed: dict | None = None


@contextlib.contextmanager
def opened():
    """One command's scope, in which a model's header is parsed once: `read_gguf` of a file parsed before in the
    scope, unchanged since (same path, device, inode, size and modification time), hands out a copy of that parse
    (its own lists and dicts: a caller may extend them) instead of reading the file again. Re-entrant: an inner
    scope is the outer one. Every `ctxq` command runs in one (ctxq.cli), and so does each call of the Python API
    that reads a model more than once (`one_parse`). Child processes parse what they need themselves."""
    global _parsed
    if _parsed is not None:
        yield
        return
    _parsed = {}
    try:
        yield
    finally:
        _parsed = None


def one_parse(fn):
    """`fn` run inside `opened()`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with opened():
            return fn(*args, **kwargs)
    return wrapper


def active() -> bool:
    """Whether a scope is open."""
    return _parsed is not None


def recall(key: tuple):
    """What was kept under `key` in the open scope; None outside one or when nothing was."""
    memo = _parsed
    return None if memo is None else memo.get(key)


def keep(key: tuple, value):
    """Keep `value` under `key` while a scope is open (else nothing); `value`."""
    memo = _parsed
    if memo is not None:
        memo[key] = value
    return value
