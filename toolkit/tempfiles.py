"""Temporary files ctxq writes on the way to a destination, named so that a later run can tell
which of them a killed process left behind.

Every temporary is `.<dest name>.ctxq-<pid>-<host>.<what>.part` beside its destination: hidden, with
the writing process's pid and host, and what it is (`gguf`, `f16`, `quantize`, `header`, `json`, ...).
A temporary is stale when it was written on this host and no process with its pid is running, or
the process now holding that pid started after the file was last written (the pid was reused). A
live process's temporary, or another host's (a folder shared over the network), is never stale.
`sweep(folder)` removes the stale ones; `ctxq convert`/`quantize_gguf` sweep their output folder,
`ctxq cache clean` the whole cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
from pathlib import Path

import psutil

log = logging.getLogger(__name__)
_NAME = re.compile(r"^\.(?P<dest>.+)\.ctxq-(?P<pid>\d+)-(?P<host>[A-Za-z0-9_-]*)\.(?P<what>[\w-]+)\.part$")
_LOCK_SUFFIX = ".ctxq.lock"
# a process's start time comes from the kernel in clock ticks (1/100 s); a file's mtime can be
# coarser on some file systems: this margin keeps the writer itself from ever looking younger
_START_MARGIN_S = 2.0


def host_tag() -> str:
    """This machine's short host name, as it appears in temporary names."""
    return re.sub(r"[^A-Za-z0-9_-]", "", socket.gethostname().split(".")[0])[:32]


def temp_path(dest: str | os.PathLike, what: str, pid: int | None = None) -> Path:
    """The temporary beside `dest` that this process (or `pid`) writes `what` into."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.ctxq-{pid or os.getpid()}-{host_tag()}.{what}.part")


def create(dest: str | os.PathLike, what: str) -> Path:
    """A new, empty temporary for `dest` (its folder created), unique within this process: a second
    one for the same destination and `what` gets `what-2`, `what-3`, ... The mode is a normal file's."""
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = temp_path(dest, what if n == 1 else f"{what}-{n}")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{temp_path(dest, what)}: 999 temporaries of this process already exist")


@contextlib.contextmanager
def folder(dest: str | os.PathLike, what: str):
    """A temporary folder beside `dest` for the `with` block, removed after it (and, if this process
    is killed, by the next sweep)."""
    path = temp_path(dest, what)
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def building(dest: str | os.PathLike):
    """Hold the lock on building `dest` for the `with` block: a second process building the same cached file waits,
    then finds it built (check for it again inside the block). The lock is `.<dest name>.ctxq.lock` beside `dest`, an
    empty file its holder removes on the way out; the kernel releases the lock however the holder ends, and a lock
    file a killed holder left is removed by the next `sweep` of its folder."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    path = dest.with_name(f".{dest.name}{_LOCK_SUFFIX}")
    f = _locked(path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before the release: a waiter then finds its file gone and opens a new one
        f.close()


def _locked(path: Path, wait: bool = True):
    """The open lock file at `path`, locked by this process; None when `wait` is False and another holds it. A file
    unlinked by its holder (or a sweep) between this open and the lock is not the lock any more: open it again."""
    import fcntl

    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def parse(path: str | os.PathLike) -> dict | None:
    """dest, pid, host, what of a ctxq temporary's name; None for any other name."""
    m = _NAME.match(Path(path).name)
    return None if m is None else {**m.groupdict(), "pid": int(m.group("pid"))}


def is_stale(path: str | os.PathLike) -> bool:
    """True for a ctxq temporary whose writer no longer exists (see the module's docstring)."""
    info = parse(path)
    if info is None or info["host"] != host_tag():
        return False
    try:
        mtime = os.lstat(path).st_mtime
        started = psutil.Process(info["pid"]).create_time()
    except FileNotFoundError:
        return False  # already gone
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True
    except psutil.AccessDenied:
        return False  # alive, another user's: keep
    return started > mtime + _START_MARGIN_S  # the pid now belongs to a later process


def temporaries(folder: str | os.PathLike, recursive: bool = False) -> list[Path]:
    """Every ctxq temporary in `folder` (and below it, when `recursive`), live or stale."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for root, dirs, files in os.walk(folder):
        found += [Path(root) / n for n in files + dirs if parse(n) is not None]
        if not recursive:
            break
        dirs[:] = [d for d in dirs if parse(d) is None]  # a temporary folder is one entry
    return sorted(found)


def size_of(path: Path) -> int:
    """Bytes a file, or a folder's files, take on disk (a sparse file counts its allocated blocks)."""
    if path.is_dir() and not path.is_symlink():
        return sum(size_of(p) for p in path.iterdir())
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return min(st.st_size, st.st_blocks * 512)


def sweep(folder: str | os.PathLike, recursive: bool = False, dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove the stale ctxq temporaries in `folder`, and the build locks no process holds (`building`'s, left by a
    killed holder); return each temporary removed with its size in bytes."""
    if not dry_run and Path(folder).is_dir():
        for lock in Path(folder).glob(f"**/.*{_LOCK_SUFFIX}" if recursive else f".*{_LOCK_SUFFIX}"):
            if (f := _locked(lock, wait=False)) is not None:
                lock.unlink(missing_ok=True)
                f.close()
    removed = []
    for path in temporaries(folder, recursive):
        if not is_stale(path):
            continue
        size = size_of(path)
        if not dry_run:
            try:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            except FileNotFoundError:  # another sweep got there first
                continue
        log.info("removed %s (%d bytes), left by a ctxq process that no longer runs", path, size)
        removed.append((path, size))
    return removed
