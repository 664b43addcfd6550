"""Issue 28: the referee checks every plan's split-independent terms against llama.cpp's accounting."""

from __future__ import annotations

import pytest

from ctxq.gguf import info as info_mod
from ctxq.llama import accounting as accounting_mod
from ctxq.planning.planner import plan
from ctxq.planning.referee import RefereeError
from ctxq.testing.accuracy import check_cell
from ctxq.testing.hybrid import MAKERS


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return str(MAKERS["gpt-oss"](tmp_path_factory.mktemp("referee") / "gpt-oss.gguf"))


@pytest.fixture
def wrong_rule(monkeypatch, tmp_path):
    """gpt-oss with a wrong rule: every attention layer sliding, so the rules' KV is below llama.cpp's."""
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(info_mod.SWA_RULES, "gpt-oss", (None, 0))


def test_a_plan_below_llama_cpp_fails_in_strict_mode(gpt_oss, wrong_rule):
    assert all(la.sliding for la in info_mod.model_info(gpt_oss).layers if la.attention)
    with pytest.raises(RefereeError, match=r"gpt-oss: the plan and llama.cpp's accounting disagree: KV of layer 1 "):
        plan(gpt_oss, 16384, gpus="1,1")


def test_otherwise_the_plan_takes_the_larger_figure_and_says_so(gpt_oss, wrong_rule, monkeypatch):
    monkeypatch.setenv("CTXQ_REFEREE", "")
    p = plan(gpt_oss, 16384, gpus="1,1")
    assert any(n.startswith("llama.cpp's own accounting differs: KV ") and "the plan takes the larger figure"
               in n for n in p.notes), p.notes
    # the plan's KV is now llama.cpp's, and the plan is not below a real load
    r = check_cell(gpt_oss, 16384, "f16", None, label="gpt-oss, wrong rule")
    (cpu,) = r.devices
    assert abs(cpu.planned["kv"] - cpu.real["kv"]) <= cpu.resolution and not cpu.under, (cpu.planned, cpu.real)


def test_the_answer_is_cached_per_model_and_settings(gpt_oss, monkeypatch, tmp_path):
    """A second plan in a new process asks llama.cpp nothing: the accounting is read back from ctxq's cache."""
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))
    accounting_mod._cached.cache_clear()  # answers of other tests' homes
    first = plan(gpt_oss, 16384, gpus="1,1")
    files = sorted((tmp_path / "home" / "accounting").glob("*.json"))
    assert files
    accounting_mod._cached.cache_clear()  # as in a new process

    def no_dry_run(*a, **k):
        raise AssertionError("llama.cpp was asked again")

    monkeypatch.setattr("ctxq.llama.measure.measure", no_dry_run)
    acc = accounting_mod.accounting(gpt_oss, n_ctx=16384, type_k=first.type_k, type_v=first.type_v,
                                    n_ubatch=first.n_ubatch, n_batch=first.n_batch, flash_attn=first.flash_attn)
    assert acc.caches and sum(c.k_bytes + c.v_bytes for c in acc.caches) > 0
    # another context is another answer
    monkeypatch.undo()
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))
    plan(gpt_oss, 32768, gpus="1,1")
    assert len(list((tmp_path / "home" / "accounting").glob("*.json"))) > len(files)
