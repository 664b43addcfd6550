"""`ctxq worker` and `ctxq run --simulate` end to end: the real console script, real llama.cpp RPC
workers on 127.0.0.1, real signals; nothing is mocked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import psutil
import pytest

from ctxq import rpc

from .conftest import ctxq_exe, run_ctxq, workers_of


# --- ctxq worker --------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctxq_worker_serves_and_stops_cleanly(sig):
    proc = subprocess.Popen([ctxq_exe(), "worker", "--port", "0", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("ctxq worker listening on 127.0.0.1:"), first + proc.stderr.read()
        endpoint = first.split()[4]
        free, total = rpc.probe(endpoint)
        assert total >= psutil.virtual_memory().total * 0.9  # the CPU device: the host's RAM
        t = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=10)
        # read through the same text wrappers as readline() above: communicate() reads the raw pipe and
        # would miss lines that readline() already buffered (the device list arrives with the first line)
        out, err = proc.stdout.read(), proc.stderr.read()
        assert time.monotonic() - t < 3
        assert proc.returncode == 0, err
        assert f"ctxq worker on {endpoint} stopped ({sig.name})" in out
        assert "CPU" in out and "Accepted client" not in out  # llama.cpp's chatter stays off stdout
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctxq_worker_refuses_remote_bind_without_flag():
    r = run_ctxq("worker", "--host", "0.0.0.0", timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("Error: --host 0.0.0.0: ") and r.stderr.count("\n") == 1, r.stderr
    assert "no authentication" in r.stderr and "Traceback" not in r.stderr
    assert "--allow-remote" in r.stderr, r.stderr  # the library's allow_remote=True, in the CLI's spelling


def test_ctxq_worker_default_port_is_llama_cpps():
    r = run_ctxq("worker", "--help", timeout=60)
    assert r.returncode == 0 and f"default: {rpc.DEFAULT_PORT}" in r.stdout, r.stdout
    assert rpc.DEFAULT_PORT == 50052  # tools/rpc/rpc-server.cpp


def test_ctxq_worker_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = run_ctxq("worker", "--port", str(s.getsockname()[1]), timeout=60)
    assert r.returncode == 1, r.stdout
    assert r.stderr.startswith("Error: the RPC worker could not listen on 127.0.0.1:")
    assert r.stderr.count("\n") == 1


# --- --simulate through the CLI -------------------------------------------------------------------

def test_ctxq_run_simulate_ctrl_c_leaves_no_workers(smollm2):
    proc = subprocess.Popen([ctxq_exe(), "run", "-c", "4096", "--simulate", "16,16", "-ts", "1:1", "-n", "3000",
                             "--temp", "0", "-p", "Tell a long story"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.read(8), proc.stderr.read()  # generating, so both workers serve layers
        assert len(workers_of(proc.pid)) == 2
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
        proc.communicate(timeout=20)
        assert proc.returncode == 130
        assert workers_of(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctxq_run_simulate_error_after_start_leaves_no_workers(smollm2):
    # The workers start, then the plan fails: a q4_0 V cache needs flash attention.
    proc = subprocess.Popen([ctxq_exe(), "run", "-c", "2048", "--simulate", "16,16", "-ctv", "q4_0", "-fa", "off",
                             "-p", "hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and err.startswith("Error: ") and err.count("\n") == 1, err
    assert workers_of(proc.pid) == []
