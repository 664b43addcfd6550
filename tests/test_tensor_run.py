"""`ctxq run -sm tensor` on a hybrid (issue 54): the text plain llama-cpp-python gives at the same proportions, over
two RPC workers on 127.0.0.1. The model is LFM2-MoE as transformers builds it with random weights and llama.cpp's
converter converts it (ctxq.testing.upstream_models: short convolutions, their state mirrored on every card, attention
layers and routed experts cut), so its greedy tokens depend on every weight."""

from __future__ import annotations

import json

import pytest

from ctxq import rpc
from ctxq.rpc import generate_greedy
from ctxq.testing import upstream_models

from .conftest import run_ctxq
from .test_serve import start

PROMPT, N_PREDICT = "The capital of France is", 16


@pytest.mark.parametrize("name", ["lfm2moe"])
def test_run_in_tensor_mode_gives_plain_llama_cpp_pythons_text(name):
    if upstream_models.NOT_BUILDABLE.get(name):
        pytest.skip(upstream_models.NOT_BUILDABLE[name])
    model = upstream_models.build(name)
    with rpc.start_workers("0.5,0.25", threads=1) as w:
        out = run_ctxq("run", str(model), "-c", "2048", "-p", PROMPT, "-n", str(N_PREDICT), "--temp", "0", "-t", "1",
                       "-sm", "tensor", "--rpc", w.rpc_spec, "--json", timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout)
        p = got["plan"]
        assert p["split_mode"] == "tensor" and len(p["tensor_split"]) == 2, p
        assert "-sm tensor -ts " in p["llama_flags"]
        kw = dict(n_ctx=2048, n_gpu_layers=999, split_mode=3, tensor_split=[float(x) for x in p["tensor_split"]],
                  flash_attn=True, n_batch=p["n_batch"], n_ubatch=p["n_ubatch"], n_threads=1)
        plain = rpc.run_supervised(generate_greedy, str(model), PROMPT, N_PREDICT, rpc=w.endpoints, workers=w,
                                   timeout=300, **kw)
    assert plain.devices == ["Meta()"], plain.devices  # tensor mode: one meta device of the two workers
    assert len(plain.tokens) == N_PREDICT and len(set(plain.tokens)) > 1  # random weights: not one token repeated
    assert got["tokens"] == plain.tokens


def test_a_tensor_mode_llama_cpp_cannot_run_is_refused_before_the_load():
    """Gemma 4 with KV-shared layers over three cards: llama.cpp would load it in tensor mode, then abort at the first
    batch (ggml-backend-meta.cpp:1098; tests/test_tensor_batch.py). `ctxq run` refuses in one line, before loading."""
    model = upstream_models.build("gemma4-kvshare")
    with rpc.start_workers("0.5,0.5,0.5", threads=1) as w:
        out = run_ctxq("run", str(model), "-c", "2048", "-p", PROMPT, "-n", "4", "--temp", "0", "-t", "1",
                       "-sm", "tensor", "-ts", "1,1,1", "--rpc", w.rpc_spec, timeout=300)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and "aborts at the first batch with proportions 1:1:1" in errors[0], out.stderr[-2000:]
    assert "-sm layer" in errors[0] and "Traceback" not in out.stderr


ABORTING = """
import sys
from ctxq.cli.common import one_line_on_abort
from ctxq.rpc.client import add_servers
import llama_cpp
add_servers(sys.argv[2].split(","))
one_line_on_abort(tensor=True)
llm = llama_cpp.Llama(sys.argv[1], n_ctx=2048, n_gpu_layers=999, split_mode=3, tensor_split=[1, 1, 1],
                      flash_attn=True, verbose=False, n_threads=1, swa_full=False)
llm.eval(list(range(100, 112)))
print("computed")
"""


def test_where_llama_cpp_aborts_anyway_run_and_serve_end_in_one_line():
    """The hook `ctxq run` and `ctxq serve` install (cli.common.one_line_on_abort), in a process that loads the same
    model at 1:1:1 without ctxq's plan: the meta device's assertion becomes one line and exit 1; no core, no trace."""
    import subprocess
    import sys

    model = upstream_models.build("gemma4-kvshare")
    with rpc.start_workers("0.5,0.5,0.5", threads=1) as w:
        out = subprocess.run([sys.executable, "-c", ABORTING, str(model), ",".join(w.endpoints)],
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "computed" not in out.stdout, (out.returncode, out.stderr[-2000:])
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and "tensor mode (ggml-backend-meta.cpp:" in errors[0], out.stderr[-2000:]
    assert "try -sm layer" in errors[0] and "RPC worker" not in errors[0]
    assert [ln for ln in out.stderr.splitlines() if ln.strip()] == errors  # nothing but the line: no core, no trace


def test_serve_refuses_before_the_load_too(tmp_path):
    """The same model behind `ctxq serve`: one line and exit 1 before it listens."""
    import subprocess

    model = upstream_models.build("gemma4-kvshare")
    log = tmp_path / "serve.log"
    with rpc.start_workers("0.5,0.5,0.5", threads=1) as w:
        proc, base = start(model, log, "-c", "2048", "-t", "1", "-sm", "tensor", "-ts", "1,1,1", "--rpc", w.rpc_spec)
        try:
            assert proc.wait(120) == 1, log.read_text()[-2000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    errors = [ln for ln in log.read_text().splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and "aborts at the first batch" in errors[0], log.read_text()[-2000:]
    assert "Traceback" not in log.read_text()
