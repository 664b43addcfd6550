"""Tensor mode's all-reduce scratch (issue 54): what each card holds after the first full micro-batch, against the
plan, on real loads over loopback RPC workers started with GGML_RPC_DEBUG=1 (scripts/tensor_truth.py reads each
worker's log: the buffers allocated after the context is made are the scratch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ctxq
from ctxq.gguf.info import model_info
from ctxq.gguf.shards import read_model
from ctxq.planning.tensor.mode import allreduce_bytes
from ctxq.testing.moe import tiny_moe_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import tensor_truth  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return tiny_moe_gguf(tmp_path_factory.mktemp("moe") / "qwen3moe.gguf")


@pytest.mark.parametrize("split", ["1:1", "1:1:1", "5:3:2"])
def test_moe_scratch_is_what_each_card_allocates(moe, split):
    """A MoE whose routed experts open their own all-reduce (qwen3moe: build_moe_ffn, no shared branch before it):
    ceil(log2 cards) buffers of f32 [n_embd, n_expert_used, n_ubatch] on every card, to the byte; the plan's compute
    (llama.cpp's one-device dry run + that scratch) no smaller than what each card holds and within 0.01 MiB."""
    info = model_info(read_model(moe))
    n = len(split.split(":"))
    rows = tensor_truth.compare(moe, 4096, "q8_0", split, label=split)
    want = allreduce_bytes(info, n, 512)
    assert want == (1 if n == 2 else 2) * info.n_embd * 512 * 4 * info.n_expert_used
    for r in rows:
        assert r.allreduce == want, (r.card, r.allreduce / MiB, want / MiB)
        assert 0 <= r.diff("compute") <= 0.01 * MiB, (r.card, r.diff("compute") / MiB)
        assert not r.under() and not r.warnings


def test_one_card_has_no_scratch_and_a_merged_routed_all_reduce_is_the_residual(moe):
    """One card: no all-reduce (n_reduce_steps = ceil(log2 1) = 0). hunyuan-moe adds its shared experts (computed
    first) to the routed ones directly, so the routed partial result never opens a subgraph: the residual only."""
    info = model_info(read_model(moe))
    assert allreduce_bytes(info, 1, 512) == 0
    from dataclasses import replace
    merged = replace(info, arch="hunyuan-moe")
    assert allreduce_bytes(merged, 4, 512) == 2 * info.n_embd * 512 * 4
    assert allreduce_bytes(merged, 5, 512) == 3 * info.n_embd * 512 * 4
    p = ctxq.plan(moe, 4096, simulate="1,1,1", split_mode="tensor", kv="q8_0", split="1,1,1")
    assert p.gpus[0].compute >= allreduce_bytes(info, 3, 512)
