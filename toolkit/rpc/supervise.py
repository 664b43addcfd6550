"""Supervised runs: a model run in a child process that a lost RPC worker cannot take down with it.

Part of the `ctxq.rpc` API (import these names from there):

- `run_supervised(fn, *args, rpc=(), workers=None, timeout=None, stall_timeout=None,
  on_message=None, **kwargs)`: calls `fn(*args, **kwargs)` in a fresh child process that first
  registers the `rpc` endpoints, and returns its result. llama.cpp aborts a process whose worker
  drops the connection; here the child dies instead, and the caller gets `WorkerLost` naming the
  worker within a few seconds (`timeout` and `stall_timeout` catch workers that vanish without
  closing the connection, which llama.cpp would wait for forever).
- `report(obj)`: inside `fn`, sends `obj` to `on_message(obj)` in the parent (streaming, progress).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

from ..errors import CtxqError, WorkerLost, WorkerUnreachable
from .client import add_servers, ggml_words, parse_rpc, probe_devices
from .. import children
from .workers import Workers

log = logging.getLogger(__name__)

_report_conn = None


def report(obj) -> None:
    """Inside `run_supervised`'s child: send `obj` to the parent's `on_message`; elsewhere a no-op."""
    if _report_conn is not None:
        _report_conn.send(("msg", obj))


def _child(conn, lifeline, stderr_path, rpc, fn, args, kwargs):
    global _report_conn
    children.watch(lifeline)  # not PR_SET_PDEATHSIG: the caller may be a thread that ends first
    os.environ["GGML_NO_BACKTRACE"] = "1"  # ggml_abort would otherwise try gdb on itself
    fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)  # ggml's abort message, for the parent's one-line error
    os.close(fd)
    _report_conn = conn
    try:
        if rpc:
            add_servers(rpc)
        result = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # handed to the parent, which re-raises it
        result = ("err", e if isinstance(e, CtxqError) else CtxqError(f"{type(e).__name__}: {e}"))
    try:
        conn.send(result)
    except Exception as e:  # an unpicklable result
        conn.send(("err", CtxqError(f"run_supervised: cannot return {type(result[1]).__name__} ({e})")))


def run_supervised(fn, *args, rpc=(), workers: Workers | None = None, timeout: float | None = None,
                   stall_timeout: float | None = None, on_message=None, **kwargs):
    """`fn(*args, **kwargs)` in a child process that registers `rpc` first; its result or error.

    `fn` must be importable (a module-level function) and its arguments and result picklable.
    `timeout` bounds the whole call, `stall_timeout` the time between two `report()`s from the
    first one on (for a streaming `fn`): both catch a worker that vanished without closing its connection, which
    llama.cpp would wait for forever. A dead local worker (`workers`) is noticed within ~5 s.
    """
    eps = [e.endpoint for e in parse_rpc(rpc)] if rpc else []
    ctx = multiprocessing.get_context("spawn")  # fork would copy llama.cpp's threads and state
    recv, send = ctx.Pipe(duplex=False)
    errfile = tempfile.NamedTemporaryFile(prefix="ctxq-run-", suffix=".log", delete=False)
    errfile.close()
    lifeline = children.spawn_lifeline()
    proc = ctx.Process(target=_child, args=(send, lifeline, errfile.name, eps, fn, args, kwargs), daemon=True)
    start = time.monotonic()
    try:
        proc.start()
    finally:
        lifeline.close()
    send.close()
    lost_at = None
    last_msg = None  # the stall watchdog starts with the first report (loading can take long)
    try:
        while True:
            if recv.poll(0.1):
                try:
                    kind, obj = recv.recv()
                except EOFError:  # the child died; it can send no more
                    proc.join(5)
                    raise _diagnose(proc, eps, workers, errfile.name) from None
                except Exception as e:  # e.g. an exception type that does not unpickle
                    raise CtxqError(f"run_supervised: the child's answer did not arrive intact ({e})") from None
                if kind == "msg":
                    last_msg = time.monotonic()
                    if on_message:
                        on_message(obj)
                    continue
                if kind == "err":
                    raise obj
                return obj
            if proc.exitcode is not None and not recv.poll(0):
                raise _diagnose(proc, eps, workers, errfile.name)
            if workers and workers.dead() and lost_at is None:
                lost_at = time.monotonic()  # the child aborts by itself once it notices; give it a moment
            if lost_at is not None and time.monotonic() - lost_at > 5.0:
                raise _diagnose(proc, eps, workers, errfile.name)
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise _diagnose(proc, eps, workers, errfile.name, hung=f"took longer than {timeout:g} s")
            if stall_timeout is not None and last_msg is not None and now - last_msg > stall_timeout:
                raise _diagnose(proc, eps, workers, errfile.name, hung=f"made no progress for {stall_timeout:g} s")
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
        os.unlink(errfile.name)


def _diagnose(proc, eps: list[str], workers: Workers | None, errpath: str, hung: str | None = None) -> CtxqError:
    """One line for a child that died (or hung) without a result: which worker went away, in ggml's words."""
    try:
        lines = [l.strip() for l in Path(errpath).read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        lines = []
    ggml = next((ggml_words(l) for l in reversed(lines) if "GGML" in l or "RPC" in l), None)
    if proc.is_alive():  # it holds the workers' only connection slot; free them for the probes
        proc.kill()
        proc.join()
    log.debug("supervised child ended with %s; its stderr: %s", proc.exitcode, lines[-20:])
    dead = workers.dead() if workers else []
    silent = []
    for ep in eps:
        if ep in dead:
            continue
        try:
            probe_devices(ep, timeout=1.0)
        except WorkerUnreachable as e:
            (silent if e.why.startswith("did not answer") else dead).append(ep)
    why = f" (the run {hung})" if hung else f" (llama.cpp: {ggml})" if ggml else ""
    if dead:
        ended = [f"{ep} {workers.how_ended(ep)}" for ep in dead if workers and ep in workers.endpoints]
        if ended:  # a local worker: say how its process ended (a crash, a kill, the OOM killer's SIGKILL)
            why = f" ({'; '.join(ended)}{'; llama.cpp: ' + ggml if ggml and not hung else ''})"
        return WorkerLost(dead[0], f"RPC worker {', '.join(dead)} went away during the run{why}; "
                          "restart it and run again, or leave it out of `rpc`")
    if silent:
        return WorkerLost(silent[0], f"RPC worker {', '.join(silent)} stopped answering during the run{why}; "
                          "check that host and its worker, or leave it out of `rpc`")
    if hung:
        return WorkerLost(None, f"the run {hung}; stopped it (every worker answers now; "
                          "raise the time limit if the work is simply slow)")
    code = proc.exitcode
    how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
    return WorkerLost(None, f"the model process ended with {how}{why}; set CTXQ_DEBUG=1 for llama.cpp's log")
