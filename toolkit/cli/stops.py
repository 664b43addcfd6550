"""SIGTERM and SIGHUP stop a one-shot command as Ctrl-C does; `ctxq serve` and `ctxq worker` keep their own stop.

SIGTERM is what `timeout`, systemd, Docker, Kubernetes and CI send first; SIGHUP comes when the terminal goes. Left
at their default they end Python at once: no `finally` runs, a `.part` stays beside the destination and the children
run on. Here the signal raises `Stopped`, a KeyboardInterrupt, in the main thread, so the cleanup written for
Ctrl-C runs for it too (temporaries removed, children killed and waited for), and the command exits with
128 + the signal's number, as a shell reports a process that signal ended, after one line on stderr.

A second SIGTERM or SIGHUP while that cleanup runs is let pass: cleanup cut short would leave what it was removing
(SIGKILL still ends the process, and the next run sweeps its temporaries). Waits on a child's pipe end on a stop signal
whichever thread the kernel gave it to, and code marked `held()` finishes before `Stopped` is raised
(`ctxq.interrupts`, issue 56).
"""

from __future__ import annotations

import signal
import threading

from .. import interrupts

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
OWN_STOP = ("serve", "worker")  # graceful stops of their own (uvicorn's, the RPC worker's)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived (`signum`)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StoppedExit(SystemExit):
    """The command ended after `Stopped`, its cleanup done: exit status 128 + `signum`. Not a KeyboardInterrupt,
    so that click passes it on instead of turning it into "Aborted."."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def line(self) -> str:
        return f"Stopped ({signal.Signals(self.signum).name})."


_stopping = False


def _on_signal(signum, frame):
    global _stopping
    if _stopping:
        return
    _stopping = True
    if not interrupts.defer(Stopped(signum)):
        raise Stopped(signum)


def install() -> None:
    """Make SIGTERM and SIGHUP raise `Stopped` until `restore()`. A signal ignored when ctxq started (SIGHUP
    under `nohup`) stays ignored; only the main thread can set handlers (a CliRunner in a thread changes nothing)."""
    global _stopping, _previous
    if threading.current_thread() is not threading.main_thread():
        return
    _stopping = False
    _previous = {s: signal.signal(s, _on_signal) for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    interrupts.wake_reads()


_previous: dict = {}


def restore() -> None:
    global _previous
    for s, handler in _previous.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    _previous = {}
    interrupts.unwake()
