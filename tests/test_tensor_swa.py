"""Tensor mode on sliding-window layers with a head size of their own (Gemma 4: `attention.key_length_swa`), against
real loads over loopback RPC workers (scripts/tensor_truth.py, each worker's GGML_RPC_DEBUG log), loaded as ctxq runs
a plan: the sliding layers' caches hold their window (swa_full=False; the C API's default is a full-size cache)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ctxq.gguf.shards import read_model
from ctxq.planning.tensor.split import TensorSplit
from ctxq.gguf.info import model_info
from ctxq.testing import upstream_models

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import tensor_truth  # noqa: E402

MiB = 2**20


def _build(name: str):
    if upstream_models.NOT_BUILDABLE.get(name):
        pytest.skip(upstream_models.NOT_BUILDABLE[name])
    return upstream_models.build(name)  # llama.cpp's converter; cached after the first build


@pytest.fixture(scope="module")
def gemma4_moe():
    return _build("gemma4-moe")


@pytest.mark.parametrize("name,split,kv,batch", [("gemma4-moe", "1:1:1", "q8_0", True),
                                                 ("gemma4-moe", "5:3:2", "f16", True),
                                                 ("gemma4-kvshare", "5:3:2", "q8_0", False)])
def test_gemma4_cards_are_what_llama_cpp_allocates(name, split, kv, batch):
    """llama_hparams::n_embd_head_k(il) is the sliding layers' own head size (32 here, 64 on the full layers): it sets
    their granularity (whole heads) and so which card gets each head. With the full layers' size for every layer,
    card 1 of gemma4-moe 1:1:1 was planned 0.046 MiB of weights and 0.066 MiB of KV under what it allocates. Gemma 4's
    per-layer input projection (per_layer_model_proj, per_layer_proj_norm: made with layer 0) is whole on every card
    (was 0.031 MiB under on each). Now weights within 0.01 MiB (tensors padded to 128 bytes), KV to the byte, compute
    never under and within 0.01 MiB. gemma4-kvshare is loaded without a batch: this llama.cpp aborts at its first
    batch in tensor mode (ggml-backend-meta.cpp:1098), so the plan's all-reduce scratch is left out of its compute."""
    rows = tensor_truth.compare(_build(name), 4096, kv, split, label=split, batch=batch)
    for r in rows:
        assert not r.warnings, r.warnings
        assert 0 <= r.diff("weights") <= 0.01 * MiB, (r.card, r.diff("weights") / MiB)
        assert r.diff("kv") == 0, (r.card, r.planned["kv"], r.measured["kv"])
        assert 0 <= r.diff("compute") <= 0.01 * MiB, (r.card, r.diff("compute") / MiB)


def test_sliding_layers_are_cut_by_their_own_heads(gemma4_moe):
    """Without a load: on 3 even cards each sliding layer's K (2 heads of 32) goes whole heads to two cards, the full
    layers' K (2 heads of 64) likewise; the granularity is one head of the layer's own size."""
    g = read_model(gemma4_moe)
    from ctxq.planning.facts import model_facts
    info = model_facts(g, model_info(g), n_ctx=4096, n_ubatch=512, n_batch=512, flash_attn=True)
    assert [la.sliding for la in info.layers] == [True, True, False, True, True, False]
    cb = TensorSplit(g, info, 3, "f16", "f16").at([1, 1, 1])
    for il, la in enumerate(info.layers):
        head = 32 if la.sliding else 64
        assert sorted(cb.k_cell[il]) == [0, 2 * head, 2 * head], (il, cb.k_cell[il])  # f16: 2 bytes an element
