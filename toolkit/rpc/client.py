"""llama.cpp RPC workers: endpoints, probing, registering them with ggml, and serving devices.

ctxq does not move tensors itself: a worker is llama.cpp's own RPC server
(`ggml_backend_rpc_start_server`), and a client registers workers with ggml's device registry
(`ggml_backend_rpc_add_server` + `ggml_backend_register`) so that llama.cpp places layers on them.

API (used by `plan`, `run`, `serve`, `ctxq.load` and the planner's accuracy script):

- `parse_rpc("HOST:PORT[=GiB],...")` -> `[RpcEndpoint]` (declared memory in bytes, or None).
- `probe(endpoint, timeout=3.0)` -> `(free_bytes, total_bytes)` of the worker's first device;
  bounded in time, `WorkerUnreachable` (a `CtxqError`) naming the endpoint otherwise.
- `add_servers(endpoints)` -> ggml device names (`RPC0`, `RPC1`, ... in registration order, which is
  llama.cpp's order: RPC devices come before local GPUs). Idempotent per endpoint.
- `serve_forever(host, port, devices=None, threads=None, cache_dir=None)`: be a worker (blocks;
  `ctxq.rpc.server`, with `ServerThread` for a process that must still react to signals).
- `on_ggml_abort(fn)` / `describe_abort(message)`: a one-line error instead of a core dump when a
  worker goes away under a model loaded in this very process (`ctxq.load`, `ctxq run`).
- `start_workers(n_or_sizes, threads=None, host="127.0.0.1")`: local worker processes
  (context manager `Workers`, see `ctxq.rpc.workers`), `run_supervised(fn, ...)`: run `fn` in a
  child process that a dead worker cannot take down with it (`ctxq.rpc.supervise`),
  `generate_greedy(...)`: load, prefill, decode greedily and report what llama.cpp allocated
  (`ctxq.rpc.generate`; for tests, benchmarks, accuracy checks).

Two facts from `ggml/src/ggml-rpc/ggml-rpc.cpp` (llama-cpp-python 0.3.36) shape this module:

- The client aborts the whole process (`GGML_ABORT`, SIGABRT) when a worker cannot be reached or
  drops the connection, and its connect and reads have no timeout. So `probe()` speaks the
  messages it needs (HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY) itself over a socket with a timeout
  before ggml is asked anything; runs that must survive losing a worker go through
  `run_supervised()`, and in-process loads can turn the abort into one line (`on_ggml_abort`).
- A worker serves one client at a time (accept, serve until it disconnects, accept the next);
  a worker busy with another client therefore looks like one that does not answer.

A process cannot unregister an RPC server (ggml has no call for it): once `add_servers()` ran, every
model loaded later in that process uses those devices. Code that needs another device list, or that
must survive a worker dying, runs the model in a child (`run_supervised`), as the tests do.
"""

from __future__ import annotations

import ctypes
import logging
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass

from ..errors import CtxqError, InvalidOption, WorkerLost, WorkerUnreachable
from ..llama import backend
from ..units import GiB
from .server import DEFAULT_PORT, _libs

log = logging.getLogger(__name__)

# Wire protocol, ggml-rpc.cpp / ggml-rpc.h: request = cmd (u8) | size (u64) | payload;
# response = size (u64) | payload. HELLO carries RPC_CONN_CAPS_SIZE (24, transport.h) caps bytes.
RPC_PROTO_MAJOR = 7
_CMD_GET_DEVICE_MEMORY = 11
_CMD_HELLO = 14
_CMD_DEVICE_COUNT = 15
_CAPS_SIZE = 24


@dataclass(frozen=True)
class RpcEndpoint:
    """One worker: where it listens, and the memory declared for it after `=` (bytes) or None."""

    host: str
    port: int
    declared: int | None = None  # bytes

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


# IPv4 or a host name; llama.cpp's client splits host and port at the first ':' (no IPv6).
_EP_RE = re.compile(r"^([^\s:=\[\]]+):(\d{1,5})(?:=(\d+(?:\.\d+)?)\s*(?:gib|gb|g)?)?$", re.I)


def parse_rpc(spec: str | RpcEndpoint | list | tuple) -> list[RpcEndpoint]:
    """`"127.0.0.1:50052=16,10.0.0.2:50052"` (or a list of such strings) -> endpoints, in order."""
    if isinstance(spec, RpcEndpoint):
        return [spec]
    parts: list = []
    for item in [spec] if isinstance(spec, str) else list(spec):
        if isinstance(item, RpcEndpoint):
            parts.append(item)
        else:
            parts += [p.strip() for p in str(item).split(",") if p.strip()]
    out: list[RpcEndpoint] = []
    for p in parts:
        if isinstance(p, RpcEndpoint):
            out.append(p)
            continue
        m = _EP_RE.match(p)
        port = int(m.group(2)) if m else 0
        if not m or not 0 < port < 65536 or (m.group(3) and float(m.group(3)) <= 0):
            raise InvalidOption(f"`rpc` {p!r}: write HOST:PORT or HOST:PORT=GiB, e.g. 127.0.0.1:{DEFAULT_PORT}=16",
                                option="rpc", value=p)
        declared = int(float(m.group(3)) * GiB) if m.group(3) else None
        out.append(RpcEndpoint(m.group(1), port, declared))
    if not out:
        raise InvalidOption(f"`rpc`: give one or more HOST:PORT[=GiB] endpoints, e.g. 127.0.0.1:{DEFAULT_PORT}=16",
                            option="rpc")
    seen = [e.endpoint for e in out]
    dup = {e for e in seen if seen.count(e) > 1}
    if dup:
        raise InvalidOption(f"`rpc`: {', '.join(sorted(dup))} given twice; list each worker once",
                            option="rpc", value=sorted(dup))
    return out


def _endpoint(ep: str | RpcEndpoint) -> RpcEndpoint:
    return ep if isinstance(ep, RpcEndpoint) else parse_rpc(ep)[0]


# --- probing: the wire protocol's first two messages, with timeouts --------------------------

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("connection closed")
        buf += chunk
    return buf


def _call(sock: socket.socket, cmd: int, payload: bytes, want: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != want:
        raise ValueError(f"unexpected reply size {size} to command {cmd}")
    return _recv_exact(sock, size)


def probe_devices(endpoint: str | RpcEndpoint, timeout: float = 3.0) -> list[tuple[int, int]]:
    """`(free, total)` bytes for each device a worker serves; `WorkerUnreachable` within ~timeout s."""
    ep = _endpoint(endpoint)
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout) as s:
            def remaining() -> float:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                return left

            s.settimeout(remaining())
            hello = _call(s, _CMD_HELLO, bytes(_CAPS_SIZE), 4 + _CAPS_SIZE)
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != RPC_PROTO_MAJOR:
                raise WorkerUnreachable(ep.endpoint, f"speaks RPC protocol {major}.{minor}.{patch}; this llama.cpp "
                                        f"speaks {RPC_PROTO_MAJOR}.x: run the same llama-cpp-python version on both")
            s.settimeout(remaining())
            (count,) = struct.unpack("<I", _call(s, _CMD_DEVICE_COUNT, b"", 4))
            out = []
            for dev in range(count):
                s.settimeout(remaining())
                out.append(struct.unpack("<QQ", _call(s, _CMD_GET_DEVICE_MEMORY, struct.pack("<I", dev), 16)))
            return out
    except WorkerUnreachable:
        raise
    except ConnectionRefusedError:
        raise WorkerUnreachable(ep.endpoint, f"refused the connection: start one there with "
                                f"`ctxq worker --port {ep.port}` or fix `rpc`") from None
    except socket.gaierror as e:
        raise WorkerUnreachable(ep.endpoint, f"has a host name that does not resolve ({e.strerror}); fix `rpc`") from None
    except (TimeoutError, socket.timeout):
        raise WorkerUnreachable(ep.endpoint, f"did not answer within {timeout:g} s (host down or "
                                "firewalled, or the worker is busy serving another client)") from None
    except (OSError, ValueError, struct.error) as e:
        raise WorkerUnreachable(ep.endpoint, f"is not answering as a ggml RPC worker ({e})") from None


def probe(endpoint: str | RpcEndpoint, timeout: float = 3.0) -> tuple[int, int]:
    """`(free_bytes, total_bytes)` of a worker's first device, or `WorkerUnreachable` within ~timeout s."""
    devs = probe_devices(endpoint, timeout)
    if not devs:
        raise WorkerUnreachable(_endpoint(endpoint).endpoint, "serves no devices")
    return devs[0]


# --- registering workers with libllama's ggml registry ----------------------------------------

_registered: dict[str, list[str]] = {}
_reg_lock = threading.Lock()


def add_servers(endpoints, timeout: float = 3.0) -> list[str]:
    """Register workers with ggml (probing each first); their ggml device names, in the order given.

    Call before loading a model. llama.cpp orders RPC devices by registration, so an endpoint
    registered before returns the same names again, and asking for an order that contradicts
    earlier registrations in this process is an error (use a fresh process: `run_supervised`).
    """
    eps = parse_rpc(endpoints) if endpoints else []
    if not eps:
        return []
    backend.require_rpc()
    lc = backend.llama_cpp()
    lc.llama_backend_init()
    g, rpc = _libs()
    names: list[str] = []
    with _reg_lock:
        for ep in eps:
            if ep.endpoint not in _registered:
                probe(ep, timeout)  # ggml's own connect would hang or abort the process
                reg = rpc.ggml_backend_rpc_add_server(ep.endpoint.encode())
                if not reg:
                    raise WorkerUnreachable(ep.endpoint, "serves no devices")
                g.ggml_backend_register(reg)
                _registered[ep.endpoint] = [
                    (g.ggml_backend_dev_name(g.ggml_backend_reg_dev_get(reg, i)) or b"").decode()
                    for i in range(g.ggml_backend_reg_dev_count(reg))]
                log.info("registered RPC worker %s as %s", ep.endpoint, _registered[ep.endpoint])
            names += _registered[ep.endpoint]
    index = [int(n[3:]) for n in names if n[3:].isdigit()]  # "RPC<n>": n counts registrations
    if index != sorted(index):
        raise CtxqError(f"this process registered these RPC workers in another order before ({', '.join(names)}); "
                        "llama.cpp keeps the first order, so load in a fresh process (ctxq.rpc.run_supervised)")
    return names


# --- when llama.cpp aborts in this process -------------------------------------------------------

_abort_callback = None  # keeps the ctypes callback alive


def on_ggml_abort(fn) -> None:
    """Call `fn(message)` when ggml is about to abort this process (`ggml_set_abort_callback`),
    e.g. because a worker dropped the connection. `fn` runs on whatever thread aborts (for RPC,
    ggml's dispatcher thread); if it returns, ggml aborts as before. For a CLI that loads models in
    its own process: print `describe_abort(message)` and `os._exit()`. `fn=None` restores ggml's."""
    global _abort_callback
    base = ctypes.CDLL(str(backend._lib_dir() / "libggml-base.so.0"))
    proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    base.ggml_set_abort_callback.argtypes = [ctypes.c_void_p]
    base.ggml_set_abort_callback.restype = ctypes.c_void_p
    if fn is None:
        base.ggml_set_abort_callback(None)
        _abort_callback = None
        return

    def call(message: bytes) -> None:
        fn((message or b"").decode(errors="replace"))

    _abort_callback = proto(call)
    base.ggml_set_abort_callback(ctypes.cast(_abort_callback, ctypes.c_void_p))


def ggml_words(line: str) -> str:
    """ggml's message without the "file:line: " that GGML_ABORT puts before it."""
    return line.split(": ", 1)[-1].strip()


def describe_abort(message: str, timeout: float = 1.0) -> str:
    """One line for a ggml abort: which registered worker went away (probed), in ggml's words."""
    what = ggml_words(message)
    from concurrent.futures import ThreadPoolExecutor

    def check(ep: str) -> str | None:
        try:
            probe_devices(ep, timeout)
            return None
        except WorkerUnreachable as e:
            # A live worker still serving this process's connection does not answer either.
            return "silent" if e.why.startswith("did not answer") else "dead"

    eps = list(_registered)
    with ThreadPoolExecutor(max_workers=max(1, len(eps))) as pool:  # all in ~timeout, not n x timeout
        states = list(pool.map(check, eps))
    dead = [ep for ep, st in zip(eps, states) if st == "dead"]
    silent = [ep for ep, st in zip(eps, states) if st == "silent"]
    if dead or silent:
        how = "went away" if dead else "stopped answering"
        return (f"RPC worker {', '.join(dead or silent)} {how} during the run (llama.cpp: {what}); "
                "restart it and run again, or leave it out of `rpc`")
    return f"llama.cpp stopped the process: {what}"
