"""Tiny hybrid-recurrent and sliding-window models for the planner's tests, written as GGUF directly.

ctxq's converter does not convert these families, so each maker writes the tensors and metadata keys in
the layout llama.cpp's converter produces, as llama.cpp's loaders read them (the vendored
src/models/<arch>.cpp load_arch_hparams / load_arch_tensors). The data region is a sparse hole (zeros):
llama.cpp loads and runs it, and its allocations are the real ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as T

from ..gguf.writer import write_sparse_gguf
from .synthetic import model_keys

Spec = tuple[str, tuple[int, ...], int]


@dataclass(frozen=True)
class HybridGeometry:
    """The shapes a maker needs; fields a family does not use are ignored."""

    n_layer: int = 8
    n_embd: int = 256
    n_ff: int = 512
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_vocab: int = 2048
    n_ctx_train: int = 65536
    # linear attention (gated delta net) / Mamba-2
    ssm_d_conv: int = 4
    ssm_d_state: int = 32  # head size of the recurrent heads
    ssm_n_group: int = 2  # key heads (delta net) / groups (Mamba-2)
    ssm_dt_rank: int = 4  # value heads (delta net) / heads (Mamba-2)
    full_attention_interval: int = 4
    # MoE / sliding window (gpt-oss)
    n_expert: int = 4
    n_expert_used: int = 2
    n_swa: int = 128

    @property
    def d_inner(self) -> int:
        return self.ssm_d_state * self.ssm_dt_rank


def _f(shape) -> tuple[tuple[int, ...], int]:
    return tuple(shape), T.F32


def _h(shape) -> tuple[tuple[int, ...], int]:
    return tuple(shape), T.F16


def _qwen35_tensors(g: HybridGeometry, recurrent: list[bool], moe: bool = False, fused_ba: bool = False,
                    n_mtp: int = 0) -> list[Spec]:
    """llama_model_qwen35::load_arch_tensors; moe: routed plus shared experts (qwen35moe, qwen3next);
    fused_ba: qwen3next's one ssm_ba for beta and alpha; n_mtp: NextN blocks after the trunk (qwen35moe's
    load_block_mtp: a full-attention block with the MoE FFN and the nextn projections)."""
    e, q, kv = g.n_embd, g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    key_dim, value_dim = g.ssm_d_state * g.ssm_n_group, g.d_inner
    out: list[Spec] = [("token_embd.weight", *_h((e, g.n_vocab))), ("output_norm.weight", *_f((e,))),
                       ("output.weight", *_h((e, g.n_vocab)))]
    for il, recr in enumerate(recurrent):
        t: dict[str, tuple] = {"attn_norm.weight": _f((e,)), "post_attention_norm.weight": _f((e,))}
        if recr:
            t.update({"attn_qkv.weight": _h((e, 2 * key_dim + value_dim)), "attn_gate.weight": _h((e, value_dim)),
                      "ssm_conv1d.weight": _f((g.ssm_d_conv, 2 * key_dim + value_dim)),
                      "ssm_dt.bias": _f((g.ssm_dt_rank,)), "ssm_a": _f((g.ssm_dt_rank,)),
                      "ssm_norm.weight": _f((g.ssm_d_state,)), "ssm_out.weight": _h((value_dim, e))})
            t.update({"ssm_ba.weight": _h((e, 2 * g.ssm_dt_rank))} if fused_ba else
                     {"ssm_beta.weight": _h((e, g.ssm_dt_rank)), "ssm_alpha.weight": _h((e, g.ssm_dt_rank))})
        else:  # the query projection carries the output gate: 2 * q rows
            t.update({"attn_q.weight": _h((e, 2 * q)), "attn_k.weight": _h((e, kv)), "attn_v.weight": _h((e, kv)),
                      "attn_output.weight": _h((q, e)), "attn_q_norm.weight": _f((g.head_dim,)),
                      "attn_k_norm.weight": _f((g.head_dim,))})
        if moe:
            t.update({"ffn_gate_inp.weight": _f((e, g.n_expert)),
                      "ffn_gate_exps.weight": _h((e, g.n_ff, g.n_expert)),
                      "ffn_up_exps.weight": _h((e, g.n_ff, g.n_expert)),
                      "ffn_down_exps.weight": _h((g.n_ff, e, g.n_expert)),
                      "ffn_gate_inp_shexp.weight": _f((e,)), "ffn_gate_shexp.weight": _h((e, g.n_ff)),
                      "ffn_up_shexp.weight": _h((e, g.n_ff)), "ffn_down_shexp.weight": _h((g.n_ff, e))})
        else:
            t.update({"ffn_gate.weight": _h((e, g.n_ff)), "ffn_up.weight": _h((e, g.n_ff)),
                      "ffn_down.weight": _h((g.n_ff, e))})
        if il >= len(recurrent) - n_mtp:
            t.update({"nextn.eh_proj.weight": _h((2 * e, e)), "nextn.enorm.weight": _f((e,)),
                      "nextn.hnorm.weight": _f((e,))})
        out += [(f"blk.{il}.{name}", *st) for name, st in t.items()]
    return out


def _common_keys(w: gguf.GGUFWriter, g: HybridGeometry, name: str, tokenizer: bool = False) -> None:
    model_keys(w, g, name, 1, 1e-6)  # LLAMA_FTYPE_MOSTLY_F16
    if not tokenizer:
        w.add_tokenizer_model("none")  # llama.cpp adds vocab_size dummy tokens (llama_vocab::load)


def _attention_at(w: gguf.GGUFWriter, g: HybridGeometry, attention) -> None:
    """A dense FFN in every layer and KV heads only in the `attention` layers (head_count_kv 0 elsewhere)."""
    w.add_feed_forward_length(g.n_ff)
    w.add_head_count_kv([g.n_head_kv if il in attention else 0 for il in range(g.n_layer)])
    w.add_rope_dimension_count(g.head_dim)


def _ssm_keys(w: gguf.GGUFWriter, g: HybridGeometry, d_inner: int | None = None) -> None:
    w.add_ssm_conv_kernel(g.ssm_d_conv)
    w.add_ssm_inner_size(d_inner or g.d_inner)
    w.add_ssm_state_size(g.ssm_d_state)
    w.add_ssm_time_step_rank(g.ssm_dt_rank)
    w.add_ssm_group_count(g.ssm_n_group)


def qwen35_metadata(w: gguf.GGUFWriter, g: HybridGeometry, arch: str = "qwen35", name: str | None = None,
                    n_mtp: int = 0) -> None:
    """The keys llama_model_qwen35 (or qwen3next) ::load_arch_hparams reads, besides the tokenizer's."""
    n_rot = g.head_dim // 4  # partial_rotary_factor 0.25, as Qwen3.5 and Qwen3-Next
    _common_keys(w, g, name or f"tiny-{arch}", tokenizer=name is not None)
    w.add_feed_forward_length(g.n_ff)
    w.add_head_count_kv(g.n_head_kv)
    w.add_rope_dimension_count(n_rot)
    w.add_rope_freq_base(1e7)
    _ssm_keys(w, g)
    w.add_full_attention_interval(g.full_attention_interval)
    if arch in ("qwen35", "qwen35moe"):  # multi-section rope: sections sum to n_rot / 2 (Qwen3.5's [11, 11, 10] of 32)
        third = n_rot // 2 // 3
        w.add_rope_dimension_sections([third, third, n_rot // 2 - 2 * third, 0])
    if n_mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_mtp)
    if arch != "qwen35":
        w.add_expert_count(g.n_expert)
        w.add_expert_used_count(g.n_expert_used)
        w.add_expert_feed_forward_length(g.n_ff)
        w.add_expert_shared_feed_forward_length(g.n_ff)


def qwen35_tensors(g: HybridGeometry, arch: str = "qwen35", n_mtp: int = 0) -> list[Spec]:
    """g.n_layer counts the NextN blocks too (block_count); the last n_mtp of them are NextN blocks."""
    recurrent = [(il + 1) % g.full_attention_interval != 0 and il < g.n_layer - n_mtp for il in range(g.n_layer)]
    return _qwen35_tensors(g, recurrent, moe=arch != "qwen35", fused_ba=arch == "qwen3next", n_mtp=n_mtp)


def write_qwen35(path: str | os.PathLike, g: HybridGeometry = HybridGeometry(), arch: str = "qwen35",
                 n_mtp: int = 0) -> Path:
    """A Qwen3.5-shaped model (arch "qwen35"; "qwen35moe" and "qwen3next" give the MoE blocks of Qwen3.5-MoE
    and Qwen3-Next): gated delta net layers, every full_attention_interval-th layer full attention with a
    gated query; the last n_mtp blocks are NextN (multi-token prediction) blocks."""
    return write_sparse_gguf(path, arch, qwen35_tensors(g, arch, n_mtp), lambda w: qwen35_metadata(w, g, arch, n_mtp=n_mtp))


def _attn(g: HybridGeometry, q: int | None = None, bias: bool = False) -> dict[str, tuple]:
    """Separate Q, K, V and output projections (create_tensor_qkv without a fused attn_qkv)."""
    e, kv = g.n_embd, g.n_head_kv * g.head_dim
    q = q or g.n_head * g.head_dim
    t = {"attn_q.weight": _h((e, q)), "attn_k.weight": _h((e, kv)), "attn_v.weight": _h((e, kv)),
         "attn_output.weight": _h((g.n_head * g.head_dim, e))}
    if bias:
        t.update({"attn_q.bias": _f((q,)), "attn_k.bias": _f((kv,)), "attn_v.bias": _f((kv,)),
                  "attn_output.bias": _f((e,))})
    return t


def _mamba2(g: HybridGeometry, d_inner: int) -> dict[str, tuple]:
    """A Mamba-2 mixer (llama_model_granite_hybrid / nemotron_h::load_arch_tensors)."""
    e, heads, xbc = g.n_embd, g.ssm_dt_rank, d_inner + 2 * g.ssm_n_group * g.ssm_d_state
    return {"ssm_in.weight": _h((e, 2 * d_inner + 2 * g.ssm_n_group * g.ssm_d_state + heads)),
            "ssm_conv1d.weight": _f((g.ssm_d_conv, xbc)), "ssm_conv1d.bias": _f((xbc,)),
            "ssm_dt.bias": _f((heads,)), "ssm_a": _f((1, heads)), "ssm_d": _f((1, heads)),
            "ssm_norm.weight": _f((d_inner // g.ssm_n_group, g.ssm_n_group)), "ssm_out.weight": _h((d_inner, e))}


def _write(path, arch: str, g: HybridGeometry, blocks: list[dict[str, tuple]], metadata, tied: bool = False,
           output_norm: str = "output_norm.weight") -> Path:
    e = g.n_embd
    specs: list[Spec] = [("token_embd.weight", *_h((e, g.n_vocab))), (output_norm, *_f((e,)))]
    if not tied:
        specs.append(("output.weight", *_h((e, g.n_vocab))))
    specs += [(f"blk.{il}.{name}", *st) for il, t in enumerate(blocks) for name, st in t.items()]
    return write_sparse_gguf(path, arch, specs, metadata)


def write_gpt_oss(path: str | os.PathLike, g: HybridGeometry = HybridGeometry(n_layer=6),
                  expert_type: int = T.F16) -> Path:
    """A gpt-oss-shaped model (llama_model_openai_moe): sliding-window and full attention alternating
    (even layers slide), attention sinks and biases, every layer a mixture of experts (expert_type:
    gpt-oss ships MXFP4 experts)."""
    e, ff = g.n_embd, g.n_ff

    def block() -> dict[str, tuple]:
        return {"attn_norm.weight": _f((e,)), "post_attention_norm.weight": _f((e,)), **_attn(g, bias=True),
                "attn_sinks.weight": _f((g.n_head,)), "ffn_gate_inp.weight": _f((e, g.n_expert)),
                "ffn_gate_inp.bias": _f((g.n_expert,)),
                "ffn_gate_exps.weight": ((e, ff, g.n_expert), expert_type),
                "ffn_up_exps.weight": ((e, ff, g.n_expert), expert_type),
                "ffn_down_exps.weight": ((ff, e, g.n_expert), expert_type), "ffn_gate_exps.bias": _f((ff, g.n_expert)),
                "ffn_up_exps.bias": _f((ff, g.n_expert)), "ffn_down_exps.bias": _f((e, g.n_expert))}

    def metadata(w: gguf.GGUFWriter) -> None:
        _common_keys(w, g, "tiny-gpt-oss")
        w.add_feed_forward_length(ff)
        w.add_head_count_kv(g.n_head_kv)
        w.add_rope_dimension_count(g.head_dim)
        w.add_rope_freq_base(150000.0)
        w.add_expert_count(g.n_expert)
        w.add_expert_used_count(g.n_expert_used)
        w.add_expert_feed_forward_length(ff)
        w.add_sliding_window(g.n_swa)

    return _write(path, "gpt-oss", g, [block() for _ in range(g.n_layer)], metadata)


def write_lfm2(path: str | os.PathLike, g: HybridGeometry = HybridGeometry(n_layer=6),
               attention: tuple[int, ...] = (2, 5), l_cache: int = 3) -> Path:
    """An LFM2-shaped model (llama_model_lfm2): short-convolution layers, attention where head_count_kv is
    not 0, tied output, the output norm named token_embd_norm."""
    e = g.n_embd
    blocks = []
    for il in range(g.n_layer):
        t = {"ffn_norm.weight": _f((e,)), "ffn_gate.weight": _h((e, g.n_ff)), "ffn_up.weight": _h((e, g.n_ff)),
             "ffn_down.weight": _h((g.n_ff, e)), "attn_norm.weight": _f((e,))}
        if il in attention:
            t.update({"attn_q_norm.weight": _f((g.head_dim,)), "attn_k_norm.weight": _f((g.head_dim,)), **_attn(g)})
        else:
            t.update({"shortconv.conv.weight": _f((l_cache, e)), "shortconv.in_proj.weight": _h((e, 3 * e)),
                      "shortconv.out_proj.weight": _h((e, e))})
        blocks.append(t)

    def metadata(w: gguf.GGUFWriter) -> None:
        _common_keys(w, g, "tiny-lfm2")
        _attention_at(w, g, attention)
        w.add_shortconv_l_cache(l_cache)

    return _write(path, "lfm2", g, blocks, metadata, tied=True, output_norm="token_embd_norm.weight")


def write_granite_hybrid(path: str | os.PathLike, g: HybridGeometry = HybridGeometry(ssm_dt_rank=8, ssm_n_group=1),
                         attention: tuple[int, ...] = (3, 7)) -> Path:
    """A Granite-4-hybrid-shaped model (llama_model_granite_hybrid): Mamba-2 layers (d_inner = 2 n_embd),
    attention where head_count_kv is not 0, a dense FFN in every layer."""
    e, d_inner = g.n_embd, 2 * g.n_embd
    blocks = []
    for il in range(g.n_layer):
        t = {"attn_norm.weight": _f((e,)), **(_attn(g) if il in attention else _mamba2(g, d_inner)),
             "ffn_norm.weight": _f((e,)), "ffn_gate.weight": _h((e, g.n_ff)), "ffn_up.weight": _h((e, g.n_ff)),
             "ffn_down.weight": _h((g.n_ff, e))}
        blocks.append(t)

    def metadata(w: gguf.GGUFWriter) -> None:
        _common_keys(w, g, "tiny-granitehybrid")
        _attention_at(w, g, attention)
        _ssm_keys(w, g, d_inner)

    return _write(path, "granitehybrid", g, blocks, metadata)


def write_nemotron_h(path: str | os.PathLike, g: HybridGeometry = HybridGeometry(ssm_dt_rank=8),
                     pattern: str = "M-M*M-M*") -> Path:
    """A Nemotron-H-shaped model (llama_model_nemotron_h): Mamba-2 (M), MLP-only (-) and attention (*)
    layers, told apart by the per-layer head_count_kv and feed_forward_length arrays."""
    e, d_inner = g.n_embd, 2 * g.n_embd
    blocks = []
    for kind in pattern:
        t = {"attn_norm.weight": _f((e,))}
        if kind == "M":
            t.update(_mamba2(g, d_inner))
        elif kind == "*":
            t.update(_attn(g))
        else:  # squared-ReLU MLP: up and down only
            t.update({"ffn_up.weight": _h((e, g.n_ff)), "ffn_down.weight": _h((g.n_ff, e))})
        blocks.append(t)

    def metadata(w: gguf.GGUFWriter) -> None:
        _common_keys(w, g, "tiny-nemotron_h")
        w.add_feed_forward_length([g.n_ff if k == "-" else 0 for k in pattern])
        w.add_head_count_kv([g.n_head_kv if k == "*" else 0 for k in pattern])
        w.add_rope_dimension_count(g.head_dim)
        w.add_layer_norm_eps(1e-5)
        _ssm_keys(w, g, d_inner)

    return _write(path, "nemotron_h", g.__class__(**{**g.__dict__, "n_layer": len(pattern)}), blocks, metadata)


MAKERS: dict[str, Callable[..., Path]] = {
    "qwen35": write_qwen35,
    "qwen3next": lambda path, g=HybridGeometry(): write_qwen35(path, g, arch="qwen3next"),
    # 8 trunk layers and one NextN block, which llama.cpp leaves unloaded
    "qwen35moe": lambda path, g=HybridGeometry(n_layer=9): write_qwen35(path, g, arch="qwen35moe", n_mtp=1),
    "gpt-oss": write_gpt_oss,
    "lfm2": write_lfm2,
    "granitehybrid": write_granite_hybrid,
    "nemotron_h": write_nemotron_h,
}

# Qwen3.5-9B's per-layer shapes (transformers' Qwen3_5TextConfig defaults: 4096 wide, 16 heads / 4 KV of 256,
# linear attention 16 key / 32 value heads of 128, FFN 12288) on 4 layers (3 delta nets, 1 attention) and a
# 32k vocabulary: a realistic layer that a machine without a GPU still loads (1.9 GiB of f16 weights).
QWEN35_9B_4L = HybridGeometry(n_layer=4, n_embd=4096, n_ff=12288, n_head=16, n_head_kv=4, head_dim=256,
                              n_vocab=32768, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32)
# Nemotron-H-8B's per-layer shapes (4096 wide, Mamba-2 of 128 heads of 64 with 8 groups of state 128, attention
# 32 heads / 8 KV of 128, squared-ReLU MLP of 21504) on 5 layers "MM-M*" and a 32k vocabulary: over 2 RPC
# workers split 1:1 the Mamba-2 layer 1 ends the first device and its reader, layer 3, starts the second.
NEMOTRON_H_8B_5L = HybridGeometry(n_layer=5, n_embd=4096, n_ff=21504, n_head=32, n_head_kv=8, head_dim=128,
                                  n_vocab=32768, ssm_d_state=128, ssm_n_group=8, ssm_dt_rank=128)
# Granite-4.0-H-Micro's (2048 wide, Mamba-2 of 64 heads of 64, one group of state 128, attention 16 / 4 KV of
# 128, FFN 8192) on 5 layers, the last one attention, so that a Mamba-2 layer is read across the devices.
GRANITE_4_H_MICRO_5L = HybridGeometry(n_layer=5, n_embd=2048, n_ff=8192, n_head=16, n_head_kv=4, head_dim=128,
                                      n_vocab=32768, ssm_d_state=128, ssm_n_group=1, ssm_dt_rank=64)
# LFM2-2.6B's (2048 wide, FFN 10752, attention 32 / 8 KV of 64, short convolutions of 3) on 6 layers.
LFM2_2_6B_6L = HybridGeometry(n_layer=6, n_embd=2048, n_ff=10752, n_head=32, n_head_kv=8, head_dim=64,
                              n_vocab=32768)
# gpt-oss-20b's (2880 wide, 64 heads / 8 KV of 64, window 128, 32 MXFP4 experts of 2880, 4 used) on 4 layers.
GPT_OSS_20B_4L = HybridGeometry(n_layer=4, n_embd=2880, n_ff=2880, n_head=64, n_head_kv=8, head_dim=64,
                                n_vocab=32768, n_expert=32, n_expert_used=4, n_swa=128)
REALISTIC: dict[str, Callable[..., Path]] = {
    "qwen35-9b-4l": lambda path: write_qwen35(path, QWEN35_9B_4L),
    "nemotron-h-8b-5l": lambda path: write_nemotron_h(path, NEMOTRON_H_8B_5L, pattern="MM-M*"),
    "granite-4-h-micro-5l": lambda path: write_granite_hybrid(path, GRANITE_4_H_MICRO_5L, attention=(4,)),
    "lfm2-2.6b-6l": lambda path: write_lfm2(path, LFM2_2_6B_6L),
    "gpt-oss-20b-4l": lambda path: write_gpt_oss(path, GPT_OSS_20B_4L, expert_type=T.MXFP4),
}


# gpt-oss-120b's and gpt-oss-20b's config.json: 36 / 24 layers, hidden 2880, 64 heads of 64, 8 KV heads, 128 / 32
# experts of 2880 (4 used), a 128-token window on every other layer, vocabulary 201088.
GPT_OSS_120B = HybridGeometry(n_layer=36, n_embd=2880, n_ff=2880, n_head=64, n_head_kv=8, head_dim=64,
                              n_vocab=201088, n_expert=128, n_expert_used=4, n_swa=128, n_ctx_train=131072)
GPT_OSS_20B = HybridGeometry(n_layer=24, n_embd=2880, n_ff=2880, n_head=64, n_head_kv=8, head_dim=64,
                             n_vocab=201088, n_expert=32, n_expert_used=4, n_swa=128, n_ctx_train=131072)


def write_gpt_oss_released(path: str | os.PathLike, g: HybridGeometry = GPT_OSS_120B) -> Path:
    """gpt-oss as ggml-org ships it: MXFP4 experts, Q8_0 attention, embeddings and head, f32 norms, biases
    and router. The 120b's size, 59.02 GiB, is llama-bench's for that file (llama.cpp PR 19922's tables)."""
    f32 = lambda *shape: (shape, T.F32)  # noqa: E731
    e, ff, q, kv, E = g.n_embd, g.n_ff, g.n_head * g.head_dim, g.n_head_kv * g.head_dim, g.n_expert
    specs = [("token_embd.weight", (e, g.n_vocab), T.Q8_0), ("output_norm.weight", (e,), T.F32),
             ("output.weight", (e, g.n_vocab), T.Q8_0)]
    for il in range(g.n_layer):
        block = {"attn_norm.weight": f32(e), "post_attention_norm.weight": f32(e), "attn_q.weight": ((e, q), T.Q8_0),
                 "attn_k.weight": ((e, kv), T.Q8_0), "attn_v.weight": ((e, kv), T.Q8_0),
                 "attn_output.weight": ((q, e), T.Q8_0), "attn_q.bias": f32(q), "attn_k.bias": f32(kv),
                 "attn_v.bias": f32(kv), "attn_output.bias": f32(e), "attn_sinks.weight": f32(g.n_head),
                 "ffn_gate_inp.weight": f32(e, E), "ffn_gate_inp.bias": f32(E),
                 "ffn_gate_exps.weight": ((e, ff, E), T.MXFP4), "ffn_up_exps.weight": ((e, ff, E), T.MXFP4),
                 "ffn_down_exps.weight": ((ff, e, E), T.MXFP4), "ffn_gate_exps.bias": f32(ff, E),
                 "ffn_up_exps.bias": f32(ff, E), "ffn_down_exps.bias": f32(e, E)}
        specs += [(f"blk.{il}.{name}", *st) for name, st in block.items()]

    def metadata(w: gguf.GGUFWriter) -> None:
        model_keys(w, g, "gpt-oss", 38, 1e-5)  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
        w.add_tokenizer_model("none")
        w.add_feed_forward_length(ff)
        w.add_head_count_kv(g.n_head_kv)
        w.add_rope_dimension_count(g.head_dim)
        w.add_expert_count(E)
        w.add_expert_used_count(g.n_expert_used)
        w.add_expert_feed_forward_length(ff)
        w.add_sliding_window(g.n_swa)

    return write_sparse_gguf(path, "gpt-oss", specs, metadata)
