"""Child processes that end with ctxq, however ctxq ends.

Every process ctxq starts for itself (the quantizer's and the quality measurement's workers, the dry runs, local RPC
workers, supervised runs) holds the read end of a pipe, the lifeline, whose write end only its parent holds. When the
parent ends, by an exit, an exception, SIGKILL or the OOM killer, the kernel closes the write end; the child's read
sees the end of the file at once and a thread of the child kills its own process. PR_SET_PDEATHSIG instead fires when
the *thread* that started the child ends (prctl(2)): a child started from a load thread would die with that thread,
while the lifeline belongs to the whole process. A parent that forks without exec closes its copy in the fork, so a
fork cannot keep its parent's children alive.

Parent: `subprocess.Popen(cmd, **children.lifeline(env))`; a multiprocessing spawn child gets `spawn_lifeline()` as an
argument. Child: `watch_parent()` first thing (or `watch(connection)`). A foreign program run to its end
(`subprocess.run`: the calling thread waits for it) gets `preexec_fn=die_with_parent`.

Standard library only: the quantizer's lean worker (`python -I -S`) loads this file by its path.
"""

from __future__ import annotations

import ctypes
import os
import signal
import stat
import sys
import threading

_ENV = "CTXQ_LIFELINE"  # "<read fd>:<parent pid>" in a child's environment
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_lock = threading.Lock()
_pipe: tuple[int, int, int] | None = None  # (owner pid, read fd, write fd)
_held: list = []  # a spawn child's lifeline connection, kept open for the process's life


def _read_end() -> int:
    global _pipe
    with _lock:
        if _pipe is None or _pipe[0] != os.getpid():
            r, w = os.pipe()  # neither is inherited (PEP 446): a child gets the read end through pass_fds only
            _pipe = (os.getpid(), r, w)
        return _pipe[1]


def _forget_in_fork() -> None:
    global _pipe
    if _pipe is not None:
        for fd in _pipe[1:]:
            try:
                os.close(fd)
            except OSError:
                pass
        _pipe = None


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_in_fork)


def lifeline(env: dict | None = None) -> dict:
    """`pass_fds` and `env` (`env`, default this process's environment, plus the lifeline) for `subprocess.Popen` or
    `subprocess.run` of a ctxq child that calls `watch_parent()`."""
    r = _read_end()
    return {"pass_fds": (r,), "env": {**(os.environ if env is None else env), _ENV: f"{r}:{os.getpid()}"}}


def spawn_lifeline():
    """The lifeline as a `multiprocessing` connection, an argument of a spawn child that calls `watch(it)`.
    The caller closes its copy once the child has started."""
    from multiprocessing.connection import Connection

    return Connection(os.dup(_read_end()), writable=False)


def watch_parent() -> None:
    """In a child started with `lifeline()`: kill this process when the parent ends. A child whose parent is already
    gone exits at once. Without the lifeline in the environment (started by hand), nothing."""
    spec = os.environ.pop(_ENV, None)  # not passed on to this process's own children
    if not spec:
        return
    fd, _, parent = spec.partition(":")
    if os.getppid() != int(parent):  # the parent died before this child started (or this is not its child)
        os._exit(1)
    _watch(int(fd))


def watch(connection) -> None:
    """`watch_parent()` for a spawn child given `spawn_lifeline()`."""
    _held.append(connection)
    _watch(connection.fileno())


def _watch(fd: int) -> None:
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return  # not a pipe: a stale variable, nothing to watch
    except OSError:
        return

    def wait() -> None:
        try:
            while os.read(fd, 4096):  # the parent never writes: only the end of the file comes
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="ctxq-lifeline", daemon=True).start()


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # an exotic libc
        return None


# looked up here, not in the forked child, where the dynamic loader's lock may be held by another thread
_prctl = _libc_prctl()


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """`preexec_fn` of a foreign program that the calling thread waits for: the kernel sends `sig` when that thread
    (and so the parent) ends. Linux only; a no-op elsewhere."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
