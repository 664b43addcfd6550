"""llama.cpp RPC: the client side (`client`: endpoints, probing, registering workers with ggml),
the worker side (`server`: serve this machine's devices) and the processes around them (`workers`:
local worker processes, supervised runs, a greedy generation probe). This package is the API;
`python -m ctxq.rpc` is a worker child of `start_workers`.
"""

from .client import (RpcEndpoint, WorkerLost, WorkerUnreachable, add_servers, describe_abort, on_ggml_abort,
                     parse_rpc, probe, probe_devices)
from .server import ServerThread, check_bind_host, listening_port, serve_forever, worker_devices
from .workers import Generation, Workers, generate_greedy, report, run_supervised, start_workers

__all__ = ["RpcEndpoint", "WorkerLost", "WorkerUnreachable", "add_servers", "describe_abort", "on_ggml_abort",
           "parse_rpc", "probe", "probe_devices", "ServerThread", "check_bind_host", "listening_port",
           "serve_forever", "worker_devices", "Generation", "Workers", "generate_greedy", "report",
           "run_supervised", "start_workers"]
