"""Processes around llama.cpp RPC: local workers, supervised runs, and a greedy generation probe.

Part of the `ctxq.rpc` API (import these names from there):

- `start_workers(n_or_sizes, threads=None, host="127.0.0.1")` -> `Workers`, a context manager over
  worker child processes (`python -m ctxq.rpc`, CPU device, port chosen by the kernel). Each
  worker is stopped on exit from the block, on exceptions, on SIGINT and SIGTERM, at interpreter
  exit, and, through `PR_SET_PDEATHSIG`, when this process dies without cleaning up (SIGKILL).
  The kernel signals a worker when the *thread* that started it ends: start workers from a
  thread that outlives them (the main thread, normally).
- `run_supervised(fn, *args, rpc=(), workers=None, timeout=None, stall_timeout=None,
  on_message=None, **kwargs)`: calls `fn(*args, **kwargs)` in a fresh child process that first
  registers the `rpc` endpoints, and returns its result. llama.cpp aborts a process whose worker
  drops the connection; here the child dies instead, and the caller gets `WorkerLost` naming the
  worker within a few seconds (`timeout` and `stall_timeout` catch workers that vanish without
  closing the connection, which llama.cpp would wait for forever).
  Inside `fn`, `report(obj)` sends `obj` to `on_message(obj)` in the parent (streaming, progress).
- `generate_greedy(model, prompt, n_predict, **llama_kwargs)` -> `Generation`: tokens, timings and
  what llama.cpp allocated where (from its log).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..llama import backend
from ..errors import CtxqError, InvalidOption
from .client import RpcEndpoint, WorkerLost, WorkerUnreachable, parse_rpc, probe, probe_devices
from ..units import default_threads
from .server import ServerThread, check_bind_host, listening_port, worker_devices
from ..units import GiB

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STOP_GRACE_S = 3.0  # SIGTERM -> SIGKILL; a worker exits at once (its main thread only waits)


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to signal this process when its parent ends (Linux); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - exotic libc
            log.debug("prctl(PR_SET_PDEATHSIG) unavailable")


# --- local workers ----------------------------------------------------------------------------

def _sizes(n_or_sizes) -> list[int | None]:
    """int -> that many workers of undeclared size; str -> GiB list ("16,16,16,8,8", "3x16,2x8")
    or a profile name; a sequence -> bytes (ints) or `devices.Device` objects."""
    from ..planning import devices

    if isinstance(n_or_sizes, bool) or n_or_sizes is None:
        raise CtxqError("start_workers: give a number of workers or their sizes")
    if isinstance(n_or_sizes, int):
        if n_or_sizes < 1:
            raise InvalidOption("`simulate`: give at least one device", option="simulate")
        return [None] * n_or_sizes
    if isinstance(n_or_sizes, str):
        spec = n_or_sizes.strip()
        is_profile = spec in devices.list_profiles() or spec.endswith(".toml")
        devs = devices.load_profile(spec)[0] if is_profile else devices.parse_gpus(spec)
        return [d.usable for d in devs]
    out = [d.usable if isinstance(d, devices.Device) else int(d) for d in n_or_sizes]
    if not out or any(s <= 0 for s in out):
        raise CtxqError("start_workers: sizes are positive byte counts")
    return out


class Workers:
    """Local RPC worker processes; `.endpoints` ("host:port"), `.sizes` (declared bytes or None)."""

    def __init__(self, sizes: list[int | None], threads: int | None, host: str, startup_timeout: float):
        self.sizes = sizes
        # Default: share the cores out, one share kept for the client. ggml's CPU threads spin at
        # barriers, and oversubscribing cores is ruinous: measured here (2 cores, SmolLM2 decode over
        # one worker) 30 tok/s with 1 worker thread, 2.2 tok/s with 2 (docs/rpc.md).
        self.threads = threads or max(1, default_threads() // (len(sizes) + 1))
        self.host = check_bind_host(host)
        self.startup_timeout = startup_timeout
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self._logdir = tempfile.TemporaryDirectory(prefix="ctxq-workers-")
        self._old_term = None
        self._stopped = False

    @property
    def rpc(self) -> list[RpcEndpoint]:
        """The workers as `--rpc` endpoints, with their declared sizes."""
        return [RpcEndpoint(self.host, int(e.rsplit(":", 1)[1]), s) for e, s in zip(self.endpoints, self.sizes)]

    @property
    def rpc_spec(self) -> str:
        return ",".join(e.endpoint + (f"={e.declared / GiB:g}" if e.declared else "") for e in self.rpc)

    def start(self) -> "Workers":
        atexit.register(self.stop)
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            # SIGTERM would end Python without unwinding; make it unwind so the workers stop.
            self._old_term = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            env = {**os.environ, "CTXQ_WORKER_PARENT": str(os.getpid())}
            for i in range(len(self.sizes)):
                logf = open(Path(self._logdir.name) / f"worker{i}.log", "wb")
                cmd = [sys.executable, "-m", "ctxq.rpc", "--host", self.host, "--port", "0",
                       "--device", "CPU", "--threads", str(self.threads)]
                # Own session: the terminal's Ctrl-C reaches only us, and we stop them in order.
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                                   env=env, start_new_session=True))
                logf.close()
            self.endpoints = [self._wait_ready(i, p) for i, p in enumerate(self.procs)]
        except BaseException:
            self.stop()
            raise
        log.info("started %d RPC workers: %s", len(self.procs), self.endpoints)
        return self

    def _wait_ready(self, i: int, proc: subprocess.Popen) -> str:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CtxqError(f"RPC worker {i} exited at start ({self.log_tail(i) or proc.returncode})")
            port = listening_port(proc.pid, self.host)
            if port:
                endpoint = f"{self.host}:{port}"
                probe(endpoint, timeout=max(1.0, deadline - time.monotonic()))
                return endpoint
            time.sleep(0.05)
        raise CtxqError(f"RPC worker {i} did not listen within {self.startup_timeout:g} s; "
                        "the machine may be overloaded")

    def log_tail(self, i: int, n: int = 3) -> str:
        try:
            lines = (Path(self._logdir.name) / f"worker{i}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(l.strip() for l in lines[-n:] if l.strip())

    def dead(self) -> list[str]:
        """Endpoints whose worker process has exited."""
        return [e for e, p in zip(self.endpoints, self.procs) if p.poll() is not None]

    def how_ended(self, endpoint: str) -> str:
        """How a worker's process ended ("killed by SIGKILL", "exit code 1: <its last line>")."""
        i = self.endpoints.index(endpoint)
        code = self.procs[i].poll()
        if code is None:
            return "running"
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        tail = self.log_tail(i, 1)
        return f"{how}: {tail}" if tail and code > 0 else how

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for p in self.procs:
            _signal_group(p, signal.SIGTERM)
            _signal_group(p, signal.SIGCONT)  # a stopped worker acts on SIGTERM only once continued
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        atexit.unregister(self.stop)
        self._logdir.cleanup()
        log.info("stopped %d RPC workers", len(self.procs))

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the worker leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def start_workers(n_or_sizes, *, threads: int | None = None, host: str = "127.0.0.1",
                  startup_timeout: float = 60.0) -> Workers:
    """Start local workers (CPU device) and wait until each answers; use as a context manager."""
    backend.require_rpc()
    return Workers(_sizes(n_or_sizes), threads, host, startup_timeout).start()


def worker_main(argv: list[str] | None = None) -> int:
    """`python -m ctxq.rpc`: a worker child of `start_workers` (no output of its own)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ctxq.rpc")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--device", action="append")
    ap.add_argument("--threads", type=int)
    a = ap.parse_args(argv)
    parent = os.environ.get("CTXQ_WORKER_PARENT")
    if parent:
        _die_with_parent()
        if os.getppid() != int(parent):  # the parent died before prctl took effect
            return 1
    try:
        server = ServerThread(check_bind_host(a.host), a.port, worker_devices(a.device),
                              a.threads or default_threads())
        server.start()
        wait_for_signal(server)
    except CtxqError as e:
        print(f"Error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def catch_stop_signals() -> list[int]:
    """Record SIGINT/SIGTERM from now on (into the returned list) instead of dying of them."""
    got: list[int] = []

    def on_signal(signum, frame):
        got.append(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    return got


def wait_for_signal(server: ServerThread, got: list[int] | None = None) -> int:
    """Block until SIGINT/SIGTERM (returns the signal) or the server thread ends (raises).

    Pass the list from `catch_stop_signals()` called before the endpoint was announced, so that a
    signal sent as soon as the announcement is read is not lost to the default action."""
    got = catch_stop_signals() if got is None else got
    while not got:
        server.thread.join(0.2)
        if not server.thread.is_alive():
            raise server.error or CtxqError("the RPC worker stopped")
    return got[0]


# --- supervised runs --------------------------------------------------------------------------

_report_conn = None


def report(obj) -> None:
    """Inside `run_supervised`'s child: send `obj` to the parent's `on_message`; elsewhere a no-op."""
    if _report_conn is not None:
        _report_conn.send(("msg", obj))


def _child(conn, stderr_path, rpc, fn, args, kwargs):
    global _report_conn
    _die_with_parent(signal.SIGKILL)
    os.environ["GGML_NO_BACKTRACE"] = "1"  # ggml_abort would otherwise try gdb on itself
    fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)  # ggml's abort message, for the parent's one-line error
    _report_conn = conn
    try:
        if rpc:
            from .client import add_servers

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
    proc = ctx.Process(target=_child, args=(send, errfile.name, eps, fn, args, kwargs), daemon=True)
    start = time.monotonic()
    proc.start()
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
    ggml = next((l.split(": ", 1)[-1] for l in reversed(lines) if "GGML" in l or "RPC" in l), None)
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
    return WorkerLost(None, f"the model process ended with {how}{why}; set CTXQ_DEBUG=1 and -v for llama.cpp's log")


# --- a greedy generation that reports what llama.cpp did ----------------------------------------

@dataclass
class Generation:
    tokens: list[int]  # generated token ids (greedy: argmax of the logits)
    n_prompt: int  # prompt tokens evaluated
    prefill_s: float
    decode_s: float
    devices: list[str]  # ggml devices of the model, in llama.cpp's order
    allocations: backend.Allocations = field(default_factory=backend.Allocations)

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0


def generate_greedy(model: str, prompt: str | list[int], n_predict: int = 16, **llama_kwargs) -> Generation:
    """Load `model` with `Llama(**llama_kwargs)`, evaluate `prompt`, then take the argmax `n_predict`
    times; timings separate prefill from decode. Register RPC workers first (`run_supervised(rpc=)`)."""
    import numpy as np

    lc = backend.llama_cpp()
    from llama_cpp import Llama

    llama_kwargs.setdefault("verbose", False)
    with backend.capture_log() as lines:
        llm = Llama(str(model), **llama_kwargs)
    try:
        toks = llm.tokenize(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        n_vocab = llm.n_vocab()
        t0 = time.perf_counter()
        llm.eval(toks)
        lc.llama_synchronize(llm.ctx)  # decoding is asynchronous on RPC devices: wait for the result
        t1 = time.perf_counter()
        out: list[int] = []
        for _ in range(n_predict):
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            out.append(int(np.argmax(logits)))
            llm.eval([out[-1]])  # every decode step costs one evaluation, the last one too
        t2 = time.perf_counter()
    finally:
        llm.close()
    devices = [l.split("using device ", 1)[1].split(" ")[0] for l in lines if "using device " in l]
    return Generation(out, len(toks), t1 - t0, t2 - t1, devices, backend.parse_allocations(lines))
