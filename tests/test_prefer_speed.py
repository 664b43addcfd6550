"""`--prefer speed` may trade the KV pair (planning/kvpairs.fastest): among the pairs that fit, the plan the
estimate times fastest for the workload, where it is 5 % faster or more; the default (quality) keeps the least
loss that fits. Described cards (a profile with speed facts), a header-only Llama-3-8B-shaped model."""

from __future__ import annotations

import pytest

import ctxq
from ctxq.planning import ubatch
from ctxq.planning.options import PlanOptions

from .conftest import card_profile



@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    return write_synthetic_gguf(tmp_path_factory.mktemp("speed") / "llama3-8b-Q4_K_M.gguf", GEOMETRIES["llama3-8b"],
                                mix="Q4_K_M")


def _secs(p, model, **opts):
    from ctxq.gguf.info import model_info
    from ctxq.gguf.shards import read_model

    g = read_model(model)
    return ubatch.estimated_s(p, model_info(g), g, PlanOptions(**opts).resolved())


def test_speed_takes_the_faster_pair_and_quality_keeps_the_least_loss(llama8b, tmp_path):
    prof = card_profile(tmp_path / "one.toml", ("RTX 4090", 1))
    kw = dict(profile=str(prof), cpu_memory=64 << 30)
    quality = ctxq.plan(llama8b, 65536, **kw)
    assert (quality.type_k, quality.type_v) == ("f16", "f16") and quality.cpu_layers == 0
    fast = ctxq.plan(llama8b, 65536, prefer="speed", **kw)
    assert (fast.type_k, fast.type_v) != ("f16", "f16") and fast.cpu_layers == 0
    t_fast, t_quality = _secs(fast, llama8b, n_ctx=65536), _secs(quality, llama8b, n_ctx=65536)
    assert t_fast <= 0.95 * t_quality
    assert f"KV {fast.type_k}/{fast.type_v} for speed: {t_fast:.1f} s estimated for the workload against " \
           f"{t_quality:.1f} s with f16/f16" in fast.reason
    assert f"-ctk {fast.type_k} -ctv {fast.type_v}" in fast.llama_flags()


def test_speed_without_speed_facts_keeps_the_least_loss(llama8b):
    """--gpus alone: the cards' compute throughput is unknown, so the workload cannot be timed: no trade."""
    p = ctxq.plan(llama8b, 65536, gpus="24", cpu_memory=64 << 30, prefer="speed")
    q = ctxq.plan(llama8b, 65536, gpus="24", cpu_memory=64 << 30)
    assert (p.type_k, p.type_v) == (q.type_k, q.type_v) and "for speed" not in p.reason
