"""Local RPC worker processes: `start_workers` in the parent, `worker_main` in each child.

Part of the `ctxq.rpc` API (import these names from there):

- `start_workers(n_or_sizes, threads=None, host="127.0.0.1")` -> `Workers`, a context manager over
  worker child processes (`python -m ctxq.rpc`, CPU device, port chosen by the kernel). Each
  worker is stopped on exit from the block, on exceptions, on SIGINT and SIGTERM, at interpreter
  exit, and, through its lifeline (`ctxq.children`), when this process dies without cleaning up (SIGKILL).
  `PR_SET_PDEATHSIG` is set too; the kernel sends it when the *thread* that started the worker ends:
  start workers from a thread that outlives them (the main thread, normally).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .. import children
from ..errors import CtxqError, InvalidOption
from ..llama import backend
from ..units import GiB, default_threads
from .client import RpcEndpoint, probe
from .server import ServerThread, check_bind_host, listening_port, wait_for_signal, worker_devices

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STOP_GRACE_S = 3.0  # SIGTERM -> SIGKILL; a worker exits at once (its main thread only waits)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to signal this process when its parent ends (Linux); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - exotic libc
            log.debug("prctl(PR_SET_PDEATHSIG) unavailable")


def _sizes(n_or_sizes) -> list[int | None]:
    """int -> that many workers of undeclared size; str -> GiB list ("16,16,16,8,8", "3x16,2x8")
    or a profile name; a sequence -> bytes (ints) or `Device` objects."""
    from .. import profiles

    if isinstance(n_or_sizes, bool) or n_or_sizes is None:
        raise CtxqError("start_workers: give a number of workers or their sizes")
    if isinstance(n_or_sizes, int):
        if n_or_sizes < 1:
            raise InvalidOption("`simulate`: give at least one device", option="simulate", value=n_or_sizes)
        return [None] * n_or_sizes
    if isinstance(n_or_sizes, str):
        spec = n_or_sizes.strip()
        is_profile = spec in profiles.list_profiles() or spec.endswith(".toml")
        devs = profiles.load_profile(spec)[0] if is_profile else profiles.parse_gpus(spec)
        return [d.usable for d in devs]
    out = [d.usable if isinstance(d, profiles.Device) else int(d) for d in n_or_sizes]
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
                                                   start_new_session=True, **children.lifeline(env)))
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
        try:  # a worker found gone (its port refuses) may not be reaped yet: on a busy machine, give it a moment
            code = self.procs[i].wait(timeout=2.0)
        except subprocess.TimeoutExpired:
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
        die_with_parent()
        if os.getppid() != int(parent):  # the parent died before prctl took effect
            return 1
        children.watch_parent()
    try:
        server = ServerThread(check_bind_host(a.host), a.port, worker_devices(a.device),
                              a.threads or default_threads())
        server.start()
        wait_for_signal(server)
    except CtxqError as e:
        print(f"Error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
