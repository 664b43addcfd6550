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


def _qwen35_tensors(g: HybridGeometry, recurrent: list[bool], moe: bool = False) -> list[Spec]:
    """llama_model_qwen35::load_arch_tensors; moe: qwen3next's (one ssm_ba for beta and alpha, and
    routed plus shared experts)."""
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
            t.update({"ssm_ba.weight": _h((e, 2 * g.ssm_dt_rank))} if moe else
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
        out += [(f"blk.{il}.{name}", *st) for name, st in t.items()]
    return out


def _common_keys(w: gguf.GGUFWriter, g: HybridGeometry, name: str) -> None:
    w.add_name(name)
    w.add_file_type(1)  # LLAMA_FTYPE_MOSTLY_F16
    w.add_context_length(g.n_ctx_train)
    w.add_embedding_length(g.n_embd)
    w.add_block_count(g.n_layer)
    w.add_head_count(g.n_head)
    w.add_key_length(g.head_dim)
    w.add_value_length(g.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(g.n_vocab)
    w.add_tokenizer_model("none")  # llama.cpp adds vocab_size dummy tokens (llama_vocab::load)


def _ssm_keys(w: gguf.GGUFWriter, g: HybridGeometry) -> None:
    w.add_ssm_conv_kernel(g.ssm_d_conv)
    w.add_ssm_inner_size(g.d_inner)
    w.add_ssm_state_size(g.ssm_d_state)
    w.add_ssm_time_step_rank(g.ssm_dt_rank)
    w.add_ssm_group_count(g.ssm_n_group)


def write_qwen35(path: str | os.PathLike, g: HybridGeometry = HybridGeometry(), arch: str = "qwen35") -> Path:
    """A Qwen3.5-shaped model (arch "qwen35"; "qwen3next" gives Qwen3-Next's MoE blocks): gated delta net
    layers, every full_attention_interval-th layer full attention with a gated query."""
    recurrent = [(il + 1) % g.full_attention_interval != 0 for il in range(g.n_layer)]
    n_rot = g.head_dim // 4  # partial_rotary_factor 0.25, as Qwen3.5 and Qwen3-Next

    def metadata(w: gguf.GGUFWriter) -> None:
        _common_keys(w, g, f"tiny-{arch}")
        w.add_feed_forward_length(g.n_ff)
        w.add_head_count_kv(g.n_head_kv)
        w.add_rope_dimension_count(n_rot)
        w.add_rope_freq_base(1e7)
        _ssm_keys(w, g)
        w.add_full_attention_interval(g.full_attention_interval)
        if arch == "qwen35":  # multi-section rope: sections sum to n_rot / 2 (Qwen3.5's [11, 11, 10] of 32)
            third = n_rot // 2 // 3
            w.add_rope_dimension_sections([third, third, n_rot // 2 - 2 * third, 0])
        else:
            w.add_expert_count(g.n_expert)
            w.add_expert_used_count(g.n_expert_used)
            w.add_expert_feed_forward_length(g.n_ff)
            w.add_expert_shared_feed_forward_length(g.n_ff)

    return write_sparse_gguf(path, arch, _qwen35_tensors(g, recurrent, moe=arch == "qwen3next"), metadata)


MAKERS: dict[str, Callable[..., Path]] = {
    "qwen35": write_qwen35,
    "qwen3next": lambda path, g=HybridGeometry(): write_qwen35(path, g, arch="qwen3next"),
}
