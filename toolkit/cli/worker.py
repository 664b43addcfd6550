"""`ctxq worker`: serve this machine's devices to other ctxq/llama.cpp processes over RPC."""

from __future__ import annotations

import ipaddress
import os
import signal
import sys

import click

from ..rpc import DEFAULT_PORT
from ..units import default_threads
from .group import cli
from .common import gib


def _quiet_c_stdout(verbose: bool) -> None:
    """Send llama.cpp's own printf chatter (one line per client connection) to stderr with -v,
    else nowhere; ctxq's lines keep the real stdout."""
    sys.stdout.flush()
    real = os.dup(1)
    target = os.dup(2) if verbose else os.open(os.devnull, os.O_WRONLY)
    os.dup2(target, 1)
    os.close(target)
    sys.stdout = open(real, "w", buffering=1, closefd=True)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (IPv4). Anything but loopback needs --allow-remote.")
@click.option("-p", "--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="Port to listen on (llama.cpp's rpc-server default); 0 picks a free one.")
@click.option("-d", "--device", "devices", multiple=True,
              help="ggml device to serve (repeatable), e.g. CUDA0 or CPU. Default: every GPU, else the CPU.")
@click.option("-t", "--threads", type=click.IntRange(1), default=None, help="CPU threads (default: all usable cores).")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Directory where llama.cpp caches large tensors sent to this worker.")
@click.option("--allow-remote", is_flag=True,
              help="Allow binding a non-loopback address. The RPC protocol has no authentication.")
@click.pass_context
def worker(ctx, host, port, devices, threads, cache_dir, allow_remote):
    """Start a llama.cpp RPC worker for this machine's devices; Ctrl-C stops it.

    Other machines (or processes) use it with `--rpc HOST:PORT` on plan, run and serve.
    """
    from ..llama import backend
    from .. import rpc

    backend.require_rpc()
    host = rpc.check_bind_host(host, allow_remote)
    if allow_remote and not ipaddress.IPv4Address(host).is_loopback:
        click.echo(f"warning: llama.cpp's RPC protocol has no authentication: anyone who can reach "
                   f"{host}:{port} can run code on this worker's devices and read its memory", err=True)
    names = rpc.worker_devices(list(devices))
    info = {d.name: d for d in backend.ggml_devices()}
    verbose = bool(ctx.find_root().params.get("verbose"))
    _quiet_c_stdout(verbose)
    stop = rpc.catch_stop_signals()  # before the endpoint is announced: a caller may signal at once
    server = rpc.ServerThread(host, port, names, threads or default_threads(), cache_dir)
    endpoint = server.start()
    click.echo(f"ctxq worker listening on {endpoint} (llama.cpp RPC protocol {rpc.RPC_PROTO_MAJOR}.x, "
               f"{server.threads} threads)")
    for n in names:
        d = info[n]
        click.echo(f"  {n:<8} {d.description}  {gib(d.free)} free of {gib(d.total)}")
    click.echo(f"use it with --rpc {endpoint}; Ctrl-C stops it")
    sig = rpc.wait_for_signal(server, stop)
    click.echo(f"ctxq worker on {endpoint} stopped ({signal.Signals(sig).name})")
    sys.stdout.flush()
    sys.stderr.flush()
    # The server thread is blocked in C (accept) and cannot be joined; end the process here so
    # that interpreter shutdown does not race it.
    os._exit(0)
