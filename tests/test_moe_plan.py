"""The MoE planner (issue 21, items 1, 2 and 4): expert placement in the search, its memory terms, the
table and JSON, and the decode estimate, on a Qwen3-30B-A3B-shaped Q4_K_M GGUF (header only: 48 layers,
128 experts of width 768, 8 used; the data region is a sparse hole)."""

from __future__ import annotations

import json

import pytest

from ctxq.gguf.info import model_info
from ctxq.planning.memory.costs import estimate_tps
from ctxq.planning.planner import plan
from ctxq.testing.moe import tiny_moe_gguf
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf
from ctxq.units import GiB

from .conftest import run_ctxq

CTX = 65536
HOST = 64 * GiB  # the host RAM planned with: the figures do not depend on this machine's


@pytest.fixture(scope="module")
def a3b(tmp_path_factory):
    return str(write_synthetic_gguf(tmp_path_factory.mktemp("a3b") / "qwen3-30b-a3b.gguf",
                                    GEOMETRIES["qwen3-30b-a3b"]))


def _today(p, path) -> float:
    """The decode estimate as main computes it (every weight read per token): the whole-layer figure of
    the issue (2.5 tokens/s on one 12 GiB card)."""
    return estimate_tps(p.gpus, p.host, model_info(path).token_embd_bytes, 1.0)


@pytest.mark.parametrize("gpus", ["12", "8,8"])
def test_experts_move_before_whole_layers(a3b, gpus):
    p = plan(a3b, CTX, gpus=gpus, cpu_memory=HOST)
    whole = plan(a3b, CTX, gpus=gpus, cpu_memory=HOST, expert_offload=False)
    assert p.cpu_layers == 0 and p.n_gpu_layers == 49  # no whole layer on the CPU
    assert 0 < len(p.cpu_expert_layers) < 48  # experts are, of some layers only
    assert whole.cpu_layers > 0 and not whole.cpu_expert_layers  # what main does: whole layers
    for g in p.gpus:  # no card over its capacity
        assert g.total <= g.device.usable, g.device.name
    # the experts moved are in the host's weights and out of the cards'
    info = model_info(a3b)
    moved = sum(info.layers[il].expert_bytes for il in p.cpu_expert_layers)
    assert p.host.experts == moved and p.host.weights >= moved + info.token_embd_bytes
    assert sum(g.weights for g in p.gpus) + moved == sum(info.layer_bytes) + info.output_bytes
    # decode: at least 4x the whole-layer figure as main computes it, and above the whole-layer plan's own
    # MoE-aware figure (which also reads only 8 of 128 experts, but the CPU layers' KV at 64k)
    assert p.est_decode_tps >= 4 * _today(whole, a3b)
    assert p.est_decode_tps > 1.5 * whole.est_decode_tps


def test_one_12_gib_card_keeps_a_prefix_as_n_cpu_moe(a3b):
    p = plan(a3b, CTX, gpus="12", cpu_memory=HOST)
    n = len(p.cpu_expert_layers)
    assert p.cpu_expert_layers == list(range(n))
    assert p.llama_flags().endswith(f" --n-cpu-moe {n}")


def test_mixed_cards_choose_layers_per_card(a3b):
    """16 + 8 GiB at f16 KV: each card gives up experts of its own layers and none overflows, where
    llama.cpp's --n-cpu-moe N (the first N layers) with a proportional -ts overflows the small card."""
    p = plan(a3b, CTX, gpus="16,8", cpu_memory=HOST, kv="f16")
    assert p.cpu_layers == 0 and p.cpu_expert_layers
    assert all(g.total <= g.device.usable for g in p.gpus)
    naive = plan(a3b, CTX, gpus="16,8", cpu_memory=HOST, kv="f16", split="16:8", n_cpu_moe=len(p.cpu_expert_layers))
    assert any(g.total > g.device.usable for g in naive.gpus)
    assert any(n.startswith("does not fit") for n in naive.notes)


def test_whole_layers_only_when_dense_parts_do_not_fit(a3b):
    """4 GiB with an f16 cache: the KV alone (6 GiB at 64k) does not fit, so whole layers go to the CPU, but
    fewer than without expert placement, and the layers on the card keep (most of) their experts on the CPU."""
    p = plan(a3b, CTX, gpus="4", cpu_memory=HOST, kv="f16")
    whole = plan(a3b, CTX, gpus="4", cpu_memory=HOST, kv="f16", expert_offload=False)
    assert 0 < p.cpu_layers < whole.cpu_layers
    on_card = [il for il in p.gpus[0].layers if il < 48]
    assert len(set(p.cpu_expert_layers) & set(on_card)) >= len(on_card) // 2
    assert all(g.total <= g.device.usable for g in p.gpus)


def test_user_placement_is_costed_as_given(a3b):
    free = plan(a3b, 4096, gpus="24", cpu_memory=HOST, kv="f16")
    every = plan(a3b, 4096, gpus="24", cpu_memory=HOST, kv="f16", cpu_moe=True)
    info = model_info(a3b)
    experts = sum(la.expert_bytes for la in info.layers)
    assert not free.cpu_expert_layers and every.cpu_expert_layers == list(range(48))
    assert free.gpus[0].weights - every.gpus[0].weights == experts
    assert every.host.weights - free.host.weights == experts
    # the first CUDA device gains the op-offload copy of the largest expert tensor (batch >= 32)
    assert every.gpus[0].cuda_copies > free.gpus[0].cuda_copies
    assert every.llama_flags().endswith(" --cpu-moe")


def test_table_and_json_show_the_placement(a3b):
    r = run_ctxq("plan", a3b, "-c", str(CTX), "--gpus", "8,8", "--cpu-memory", "64")
    assert r.returncode == 0, r.stderr
    assert "experts in CPU memory:" in r.stdout and "GiB of host RAM" in r.stdout
    assert "  GPU0: layers 0-" in r.stdout and "  GPU1: layers " in r.stdout
    j = run_ctxq("plan", a3b, "-c", str(CTX), "--gpus", "8,8", "--cpu-memory", "64", "--json")
    d = json.loads(j.stdout)
    rows = d["placement"]
    assert len(rows) == 49 and [r["layer"] for r in rows] == list(range(49))
    cpu = [r["layer"] for r in rows if r.get("experts") == "CPU"]
    assert cpu == d["cpu_expert_layers"] and cpu
    assert all(r["device"] in ("GPU0", "GPU1") for r in rows)
    assert d["gpus"][0]["cpu_expert_bytes"] > 0 and d["host"]["experts"] > 0


def test_a_missing_expert_tensor_is_one_line_on_plan(tmp_path):
    broken = tiny_moe_gguf(tmp_path / "broken.gguf", missing="blk.1.ffn_down_exps.weight")
    r = run_ctxq("plan", str(broken), "-c", "1024")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("Error: ") and "blk.1.ffn_down_exps.weight is missing" in r.stderr
