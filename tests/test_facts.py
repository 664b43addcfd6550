"""Issue 28: per-layer facts from llama.cpp's own accounting (a metadata-only load of the real header)."""

from __future__ import annotations

import importlib.util

import pytest

from ctxq.gguf import info as info_mod
from ctxq.gguf.info import model_info
from ctxq.llama.accounting import accounting
from ctxq.planning import facts
from ctxq.planning.memory.costs import kv_by_layer
from ctxq.testing.accuracy import check_cell
from ctxq.testing.hybrid import MAKERS
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

from .conftest import run_ctxq


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    d = tmp_path_factory.mktemp("facts")
    return {arch: str(MAKERS[arch](d / f"{arch}.gguf")) for arch in ("gpt-oss", "lfm2", "qwen35", "nemotron_h")}


@pytest.mark.parametrize("arch", ["gpt-oss", "lfm2", "qwen35", "nemotron_h"])
def test_llama_cpp_accounts_the_layers_as_the_verified_rules_do(hybrids, arch):
    """Sliding windows (gpt-oss), recurrent layers (LFM2, Qwen3.5, Nemotron-H's MLP-only layers): the facts
    read from llama.cpp's log give the kinds, the KV per layer and the state the measured rules give."""
    rules = model_info(hybrids[arch])
    acc = accounting(hybrids[arch], n_ctx=16384)
    assert acc.consistent()  # the widths it printed add up to each cache's printed K and V sizes
    got = facts.with_facts(rules, acc)
    assert [la.kind for la in got.layers] == [la.kind for la in rules.layers]
    for tk, tv in (("f16", "f16"), ("q8_0", "q8_0")):
        assert kv_by_layer(got, 16384, 512, tk, tv) == kv_by_layer(rules, 16384, 512, tk, tv)
    assert got.n_swa == rules.n_swa
    printed = acc.state_printed * (1 << 20) // 200 + len(acc.recurrent)
    assert abs(got.state_bytes_per_seq - rules.state_bytes_per_seq) <= printed


def test_a_missing_sliding_window_rule_is_filled_from_llama_cpp(hybrids, monkeypatch, tmp_path):
    """gpt-oss as if ctxq had no rule for it: its sliding layers come from llama.cpp's accounting, and the
    plan matches a real load (KV exact, every device within 2 MiB, none under)."""
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(facts, "VERIFIED_ARCHS", facts.VERIFIED_ARCHS - {"gpt-oss"})
    monkeypatch.setitem(info_mod.SWA_RULES, "gpt-oss", (None, 1))  # pattern 1: no layer sliding by the rules
    assert not any(model_info(hybrids["gpt-oss"]).swa_layers)
    r = check_cell(hybrids["gpt-oss"], 16384, "f16", None, label="gpt-oss without its rule")
    assert r.layers_match, r.layer_mismatch
    (cpu,) = r.devices
    assert abs(cpu.planned["kv"] - cpu.real["kv"]) <= cpu.resolution and cpu.real["kv"] > 0
    assert not cpu.under and cpu.ok_tiny, (cpu.planned, cpu.real)


def test_a_model_llama_cpp_cannot_load_is_one_line(tmp_path):
    """A header without a tensor llama.cpp requires: ctxq's own derived model fails, then the real header
    does, and the user gets llama.cpp's reason with the architecture, not a traceback."""
    from ctxq.planning.derived import write_sparse

    good = info_mod.read_gguf(write_synthetic_gguf(tmp_path / "good.gguf", GEOMETRIES["tiny"]))
    bad = write_sparse(good, tmp_path / "bad.gguf",
                       [(t.name, t.shape, t.type) for t in good.tensors if t.name != "blk.1.attn_q.weight"])
    rc, out, err = (lambda r: (r.returncode, r.stdout, r.stderr))(
        run_ctxq("plan", str(bad), "-c", "4096", env={"CTXQ_HOME": str(tmp_path / "home")}))
    assert rc == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "llama.cpp cannot load this llama model (bad.gguf)" in lines[0] and "blk.1.attn_q.weight" in lines[0]


# --- architectures without rules, converted by llama.cpp's own converter (helper "matrix"'s models) ------

_upstream = importlib.util.find_spec("ctxq.testing.upstream_models")


@pytest.mark.slow
@pytest.mark.skipif(_upstream is None, reason="ctxq.testing.upstream_models (the converted test models) is not here")
@pytest.mark.parametrize("name,kind", [("olmo3", "sliding"), ("llama4", "sliding"), ("deepseek-v3", "mla")])
def test_weights_and_kv_of_architectures_without_rules_match_real_loads(name, kind):
    """OLMo 3's sliding window, Llama 4's chunked attention and DeepSeek-V3's MLA (no V cache) planned from
    llama.cpp's accounting: weights and KV exact on every device of a real split over RPC workers."""
    from ctxq.rpc import start_workers
    from ctxq.testing.upstream_models import build

    model = str(build(name))
    info = facts.model_facts(info_mod.read_gguf(model), model_info(model), n_ctx=16384, n_ubatch=512,
                             n_batch=2048, flash_attn=True)
    if kind == "sliding":
        assert any(la.sliding for la in info.layers) and not all(la.sliding for la in info.layers if la.attention)
    else:
        assert all(info.n_embd_v_gqa(il) == 0 for il, la in enumerate(info.layers) if la.attention)
    with start_workers(3) as w:
        r = check_cell(model, 16384, "f16", [2, 1, 1], workers=w, flash_attn=True, label=name)
    assert r.layers_match, r.layer_mismatch
    for d in r.devices:
        for term in ("weights", "kv"):  # to llama.cpp's printed precision
            assert abs(d.planned[term] - d.real[term]) <= d.resolution, (d.name, term, d.planned, d.real)
