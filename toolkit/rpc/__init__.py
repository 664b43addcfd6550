"""llama.cpp RPC: the client side (`client`: endpoints, probing, registering workers with ggml),
the worker side (`server`: serve this machine's devices, wait for a stop signal), local worker
processes (`workers`), runs that survive a lost worker (`supervise`) and a greedy generation probe
(`generate`). This package is the API; `python -m ctxq.rpc` is a worker child of `start_workers`.
"""

from .client import (RPC_PROTO_MAJOR, RpcEndpoint, WorkerLost, WorkerUnreachable, add_servers, describe_abort,
                     on_ggml_abort, parse_rpc, probe, probe_devices)
from .generate import Generation, generate_greedy
from .server import (DEFAULT_PORT, ServerThread, catch_stop_signals, check_bind_host, listening_port,
                     serve_forever, wait_for_signal, worker_devices)
from .supervise import report, run_supervised
from .workers import Workers, start_workers

__all__ = ["RPC_PROTO_MAJOR", "RpcEndpoint", "WorkerLost", "WorkerUnreachable", "add_servers", "describe_abort",
           "on_ggml_abort", "parse_rpc", "probe", "probe_devices", "Generation", "generate_greedy",
           "DEFAULT_PORT", "ServerThread", "catch_stop_signals", "check_bind_host", "listening_port",
           "serve_forever", "wait_for_signal", "worker_devices", "report", "run_supervised", "Workers",
           "start_workers"]
