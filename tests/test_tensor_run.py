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
from .test_serve import start, wait_ready

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


def test_a_tensor_mode_llama_cpp_cannot_run_ends_in_one_line():
    """Gemma 4 with KV-shared layers over three cards: llama.cpp loads it in tensor mode, then its meta device asserts
    at the first batch (ggml-backend-meta.cpp:1098). `ctxq run` says so in one line and exits 1; no core, no trace."""
    model = upstream_models.build("gemma4-kvshare")
    with rpc.start_workers("0.5,0.5,0.5", threads=1) as w:
        out = run_ctxq("run", str(model), "-c", "2048", "-p", PROMPT, "-n", "4", "--temp", "0", "-t", "1",
                       "-sm", "tensor", "-ts", "1,1,1", "--rpc", w.rpc_spec, timeout=300)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and "tensor mode (ggml-backend-meta.cpp:" in errors[0], out.stderr[-2000:]
    assert "try -sm layer" in errors[0] and "RPC worker" not in errors[0]
    assert "Traceback" not in out.stderr


def test_serve_ends_in_one_line_too(tmp_path):
    """The same model behind `ctxq serve`: the first request's batch stops the server with one line and exit 1."""
    import httpx

    model = upstream_models.build("gemma4-kvshare")
    log = tmp_path / "serve.log"
    with rpc.start_workers("0.5,0.5,0.5", threads=1) as w:
        proc, base = start(model, log, "-c", "2048", "-t", "1", "-sm", "tensor", "-ts", "1,1,1", "--rpc", w.rpc_spec)
        try:
            wait_ready(proc, base, log)
            with pytest.raises(httpx.TransportError):  # the process ends under the request
                httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=120)
            assert proc.wait(60) == 1, log.read_text()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    errors = [ln for ln in log.read_text().splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and "tensor mode (ggml-backend-meta.cpp:" in errors[0], log.read_text()[-2000:]
    assert "Traceback" not in log.read_text()
