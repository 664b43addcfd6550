"""Waits and cleanups that a stop signal neither hangs nor cuts in half (issue 56).

`ctxq.cli.stops` turns SIGTERM and SIGHUP into `Stopped`, raised by the main thread between two bytecodes. Two things
can go wrong with that, and this module is where the library guards against them:

- a wait the signal does not end. A read of a child's pipe returns with EINTR only when the kernel gave the signal to
  the main thread; given to another thread (numpy's, tqdm's monitor), the handler runs only once the read returns,
  and a held or stuck child never writes. `read()` waits on the pipe and on the signal's wakeup fd together, so the
  handler runs within the wait whichever thread took the signal.
- code left half done. `with held():` a signal that arrives inside raises when the block ends (a tqdm bar stopped
  inside its __init__ printed a traceback from its __del__ at exit; a child killed but not yet waited for).

Outside the CLI (the library in someone's program, a CliRunner in a thread) nothing is installed: `read()` is a plain
read and `held()` a plain block, and a KeyboardInterrupt is raised where it lands, as Python does.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

_wakeup: tuple[int, int] | None = None  # the signal wakeup pipe (read end, write end) while `wake_reads()` is on
_previous_wakeup = -1


def wake_reads() -> None:
    """From the main thread: a Python-handled signal wakes `read()` wherever the kernel delivered it."""
    global _wakeup, _previous_wakeup
    if _wakeup is not None or threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()  # neither end is inherited by children (PEP 446)
    os.set_blocking(r, False)
    os.set_blocking(w, False)  # the C-level handler must never block on a full pipe
    _previous_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    _wakeup = (r, w)


def unwake() -> None:
    """Undo `wake_reads()`."""
    global _wakeup
    if _wakeup is None or threading.current_thread() is not threading.main_thread():
        return
    signal.set_wakeup_fd(_previous_wakeup)
    for fd in _wakeup:
        os.close(fd)
    _wakeup = None


def readable(fd: int, timeout: float | None = None) -> bool:
    """Wait until `fd` has data or its end (True) or `timeout` seconds pass (False), in a wait that a signal's handler
    interrupts: the exception it raises (KeyboardInterrupt, `Stopped`) comes out of here at once."""
    wake = _wakeup[0] if _wakeup is not None and threading.current_thread() is threading.main_thread() else None
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if wake is not None:
        poll.register(wake, select.POLLIN)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        ready = {f for f, _ in poll.poll(left)}  # a signal to this thread: EINTR runs the handler here (PEP 475)
        if wake in ready:  # one taken by another thread: its handler runs at this thread's next bytecode
            _drain(wake)
        if fd in ready:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def read(fd: int, n: int = 1 << 16) -> bytes:
    """`os.read(fd, n)` of a child's pipe (b"" at its end) after `readable(fd)`."""
    readable(fd)
    return os.read(fd, n)


def lines(fd: int):
    """The lines (bytes, with their newline) of a child's pipe until its end, each wait through `read()`."""
    rest = b""
    while chunk := read(fd):
        *done, rest = (rest + chunk).split(b"\n")
        yield from (ln + b"\n" for ln in done)
    if rest:
        yield rest


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


class held:
    """`with held():` a signal handler's exception deferred to the block's end. The handler (cli/stops.py) calls
    `defer(exc)` instead of raising while the main thread is in such a block; other threads' blocks change nothing
    (handlers run in the main thread only)."""

    depth = 0  # of the main thread's blocks
    pending: BaseException | None = None

    def __enter__(self) -> None:
        self.counted = threading.current_thread() is threading.main_thread()
        held.depth += self.counted

    def __exit__(self, *exc) -> None:
        held.depth -= self.counted
        if self.counted and not held.depth and held.pending is not None:
            pending, held.pending = held.pending, None
            raise pending  # over an exception leaving the block too: the stop decides how the command ends


def defer(exc: BaseException) -> bool:
    """From a signal handler: keep `exc` for the end of the `held()` block running now; False outside one."""
    if not held.depth:
        return False
    held.pending = exc
    return True
