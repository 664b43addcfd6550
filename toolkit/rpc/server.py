"""The worker side of llama.cpp RPC: serve this machine's devices (part of the `ctxq.rpc` API).

`serve_forever()` calls llama.cpp's own server, `ggml_backend_rpc_start_server(endpoint, cache_dir,
n_threads, n_devices, devices)` (ggml/include/ggml-rpc.h), which blocks in C for good; `ServerThread`
runs it on a daemon thread so that the process still reacts to signals, and finds the port the
kernel chose when asked for port 0; `catch_stop_signals` and `wait_for_signal` let the main thread
wait for Ctrl-C or SIGTERM meanwhile (`ctxq worker`, `python -m ctxq.rpc`).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from ..errors import CtxqError, InvalidOption
from ..llama import backend
from ..units import default_threads

log = logging.getLogger(__name__)

DEFAULT_PORT = 50052  # llama.cpp's rpc-server default (tools/rpc/rpc-server.cpp)


def _libs():
    """libggml and libggml-rpc, the copies libllama uses (NOTES trap; `backend.rpc_library_path`)."""
    rpc = ctypes.CDLL(str(backend.rpc_library_path()))
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    g = backend._ggml()
    g.ggml_backend_register.argtypes = [ctypes.c_void_p]
    g.ggml_backend_register.restype = None
    g.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    g.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    g.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    g.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    g.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    g.ggml_backend_dev_by_name.restype = ctypes.c_void_p
    return g, rpc


def check_bind_host(host: str, allow_remote: bool = False) -> str:
    """An IPv4 address ggml can bind ("localhost" -> 127.0.0.1); non-loopback needs allow_remote."""
    host = "127.0.0.1" if host == "localhost" else host
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        raise InvalidOption(f"`host` {host!r}: give an IPv4 address such as 127.0.0.1 "
                            "(llama.cpp's RPC server binds IPv4 only)", option="host", value=host) from None
    if not addr.is_loopback and not allow_remote:
        raise InvalidOption(f"`host` {host}: llama.cpp's RPC protocol has no authentication, so a worker binds "
                            "only loopback; pass allow_remote=True to expose it on a trusted network",
                            option="host", value=host)
    return host


def worker_devices(devices: list[str] | None = None) -> list[str]:
    """Device names a worker serves: the given ones, else llama.cpp rpc-server's default
    (every GPU-like device, else the CPU)."""
    avail = [d for d in backend.ggml_devices() if not d.name.startswith("RPC")]
    if devices:
        known = {d.name.lower(): d.name for d in avail}
        out = []
        for name in devices:
            if name.lower() not in known:
                raise InvalidOption(f"`device` {name!r}: no such ggml device; choose from "
                                    f"{', '.join(d.name for d in avail)}", option="device", value=name)
            out.append(known[name.lower()])
        return out
    gpus = [d.name for d in avail if d.type not in ("cpu", "accel")]
    return gpus or [d.name for d in avail if d.type == "cpu"][:1]


def serve_forever(host: str, port: int, devices: list[str] | None = None, threads: int | None = None,
                  cache_dir: str | None = None) -> None:
    """Serve this machine's devices over llama.cpp's RPC protocol until the process ends.

    Blocks in C (`ggml_backend_rpc_start_server`); run it in a thread when the process must
    still react to signals. Returns only by raising: the server could not start.
    """
    backend.require_rpc()
    names = worker_devices(devices)
    g, rpc = _libs()
    devs = (ctypes.c_void_p * len(names))(*[g.ggml_backend_dev_by_name(n.encode()) for n in names])
    endpoint = f"{host}:{port}"
    log.info("serving %s on %s", names, endpoint)
    rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache_dir.encode() if cache_dir else None,
                                      threads or default_threads(), len(names), devs)
    # start_server returns only when it could not set up (e.g. the port is taken).
    raise InvalidOption(f"the RPC worker could not listen on {endpoint} (port in use?); choose another `port`",
                        option="port", value=port)


def _check_port_free(host: str, port: int) -> None:
    """Fail with one line before ggml does (it prints to stderr and returns)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml's create_server does
        try:
            s.bind((host, port))
        except OSError as e:
            raise InvalidOption(f"the RPC worker could not listen on {host}:{port} ({e.strerror}); "
                                "choose another `port`", option="port", value=port) from None


def listening_port(pid: int, host: str) -> int | None:
    """The TCP port process `pid` listens on at `host` (the worker binds port 0 -> the kernel picks)."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp4")
    except psutil.Error:
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.ip == host:
            return c.laddr.port
    return None


@dataclass
class ServerThread:
    """`serve_forever` in a daemon thread of this process; `.endpoint` once it listens."""

    host: str
    port: int
    devices: list[str]
    threads: int
    cache_dir: str | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = field(default=None, repr=False)

    def start(self, timeout: float = 30.0) -> str:
        if self.port:
            _check_port_free(self.host, self.port)

        def run():
            try:
                serve_forever(self.host, self.port, self.devices, self.threads, self.cache_dir)
            except BaseException as e:  # reported to the waiting thread
                self.error = e

        self.thread = threading.Thread(target=run, name="ctxq-rpc-worker", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error:
                raise self.error
            port = listening_port(os.getpid(), self.host)
            if port and (self.port == 0 or port == self.port):
                self.port = port
                return self.endpoint
            time.sleep(0.05)
        raise CtxqError(f"the RPC worker did not start listening on {self.host}:{self.port} within {timeout:g} s")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


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
