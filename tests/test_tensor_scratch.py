"""Tensor mode's all-reduce scratch (issue 54): what each card holds after the first full micro-batch, against the
plan, on real loads over loopback RPC workers started with GGML_RPC_DEBUG=1 (scripts/tensor_truth.py reads each
worker's log: the buffers allocated after the context is made are the scratch)."""

from __future__ import annotations

import math
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


def test_one_card_has_no_scratch(moe):
    """One card: no all-reduce (n_reduce_steps = ceil(log2 1) = 0)."""
    info = model_info(read_model(moe))
    assert allreduce_bytes(info, 1, 512) == 0
    p = ctxq.plan(moe, 4096, simulate="1", split_mode="tensor", kv="q8_0")
    assert p.split_mode == "tensor" and p.gpus[0].compute < ctxq.plan(
        moe, 4096, simulate="1,1,1", split_mode="tensor", kv="q8_0", split="1,1,1").gpus[0].compute


@pytest.mark.parametrize("split", ["1:1", "1:1:1"])
def test_shared_experts_built_first_still_count_every_routed_expert(tmp_path_factory, split):
    """hunyuan-moe builds its shared FFN before the routed experts and adds the two, which lets llama.cpp merge the
    two all-reduces (get_i_delayed); but build_moe_ffn forward-expands the routed experts first, so their
    [n_embd, n_expert_used, n_ubatch] partial result is still reached and sizes the scratch. Measured: each card
    holds n_expert_used times the residual, per step (the plan once counted the residual alone: 0.25 MiB under on
    2 cards, 0.5 on 3, for this model)."""
    model = _hunyuan_moe_gguf(tmp_path_factory.mktemp("hy") / "hunyuan-moe.gguf")
    info = model_info(read_model(model))
    n = len(split.split(":"))
    rows = tensor_truth.compare(model, 4096, "f16", split, label=split)
    # an independent figure: ceil(log2 n) buffers of f32 [128 wide, 2 experts used, 512 tokens]
    want = math.ceil(math.log2(n)) * 128 * 2 * 512 * 4
    assert info.n_embd == 128 and info.n_expert_used == 2
    for r in rows:
        assert r.allreduce == want, (r.card, r.allreduce / MiB, want / MiB)
        assert 0 <= r.diff("compute") <= 0.01 * MiB, (r.card, r.diff("compute") / MiB)
        assert not r.under() and not r.warnings


def _hunyuan_moe_gguf(dest: Path) -> Path:
    """A random-weight hunyuan-moe GGUF (the tensors and keys llama.cpp's llama_model_hunyuan_moe loads: q/k norms,
    a router, stacked experts, one shared FFN), SmolLM2's tokenizer: llama.cpp's converter cannot write one without
    a tiktoken vocabulary (upstream_models.NOT_BUILDABLE)."""
    import gguf
    import numpy as np

    from ctxq.gguf.reader import read_gguf
    from ctxq.models import fetch_default_model

    n_layer, n_embd, n_head, n_head_kv, hd, n_expert, n_used, n_ff = 4, 128, 4, 2, 32, 8, 2, 128
    src = read_gguf(fetch_default_model())
    n_vocab = len(src.metadata["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(0)

    def mat(*shape, dtype=np.float16):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(dtype)

    w = gguf.GGUFWriter(str(dest), "hunyuan-moe")
    w.add_block_count(n_layer)
    w.add_context_length(32768)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)  # the experts' width in llama_model_hunyuan_moe::load_arch_tensors
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_expert_feed_forward_length(n_ff)
    w.add_expert_shared_feed_forward_length(n_ff)
    w.add_file_type(1)
    for key, value in src.metadata.items():
        if key.startswith("tokenizer."):
            vt, sub = src.value_types[key]
            w.add_key_value(key, value, gguf.GGUFValueType(vt), None if sub is None else gguf.GGUFValueType(sub))
    ones = np.ones(n_embd, dtype=np.float32)
    t = {"token_embd.weight": mat(n_vocab, n_embd)}  # numpy order: GGML's ne reversed
    for il in range(n_layer):
        b = f"blk.{il}."
        t.update({b + "attn_norm.weight": ones, b + "attn_q.weight": mat(n_head * hd, n_embd),
                  b + "attn_k.weight": mat(n_head_kv * hd, n_embd), b + "attn_v.weight": mat(n_head_kv * hd, n_embd),
                  b + "attn_output.weight": mat(n_embd, n_head * hd), b + "attn_q_norm.weight": ones[:hd],
                  b + "attn_k_norm.weight": ones[:hd], b + "ffn_norm.weight": ones,
                  b + "ffn_gate_inp.weight": mat(n_expert, n_embd, dtype=np.float32),
                  b + "ffn_gate_exps.weight": mat(n_expert, n_ff, n_embd),
                  b + "ffn_up_exps.weight": mat(n_expert, n_ff, n_embd),
                  b + "ffn_down_exps.weight": mat(n_expert, n_embd, n_ff),
                  b + "ffn_gate_shexp.weight": mat(n_ff, n_embd), b + "ffn_up_shexp.weight": mat(n_ff, n_embd),
                  b + "ffn_down_shexp.weight": mat(n_embd, n_ff)})
    t["output_norm.weight"] = ones
    t["output.weight"] = mat(n_vocab, n_embd)
    for name, data in t.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest
