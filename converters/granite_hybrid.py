"""Granite 4 hybrid (HF GraniteMoeHybridForCausalLM, llama.cpp's granitehybrid arch,
src/models/granite-hybrid.cpp): Mamba-2 layers and attention layers, each followed by experts
with a shared expert (or by the shared MLP alone when there are no experts), and Granite's four
multipliers. As convert_hf_to_gguf's GraniteHybridModel: head_count_kv per layer (0 for a Mamba layer:
load_arch_hparams makes it recurrent), the fused expert and shared-MLP input projections split into
gate and up (gate first, as GraniteMoeHybridMoE chunks them), Q/K rows permuted for llama.cpp's
rotary layout, Mamba tensors as converters/mamba.py writes them. Granite 4's hybrids use no
position embedding: the file says so with rope.scaling.finetuned = false, and llama.cpp's converter
writes a context length of 2**20 for them.
"""

from __future__ import annotations

import re

import gguf

from ..errors import ConversionError
from . import experts, mamba, register
from .base import Family, Piece, rewriter

_NO_ROPE_CONTEXT = 2**20  # GraniteHybridModel.set_gguf_parameters, for the hybrids without RoPE


def mixer(cfg: dict) -> mamba.Mixer:
    return mamba.Mixer(d_inner=int(cfg.get("mamba_expand") or 2) * cfg["hidden_size"], n_head=cfg["mamba_n_heads"],
                       n_group=int(cfg.get("mamba_n_groups") or 1), d_state=cfg["mamba_d_state"],
                       d_conv=int(cfg.get("mamba_d_conv") or 4))


def _mamba_layers(cfg: dict) -> list[bool]:
    # "mamba"/"attention" in the Hub's configs; transformers 5 saves "linear_attention"/"full_attention"
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * cfg["num_hidden_layers"]
    if unknown := set(types) - {"mamba", "linear_attention", "attention", "full_attention"}:
        raise ConversionError(f"Granite 4 hybrid layer type {sorted(unknown)[0]!r} is not Mamba or attention")
    return [t in ("mamba", "linear_attention") for t in types]


def _check(cfg: dict) -> None:
    if not any(_mamba_layers(cfg)):
        raise ConversionError("a Granite 4 hybrid without Mamba layers is a granite/granitemoe model, which ctxq "
                              "convert does not write yet")
    if cfg.get("position_embedding_type") not in (None, "nope"):
        raise ConversionError(f"Granite 4 hybrid with position_embedding_type {cfg['position_embedding_type']!r}: "
                              "llama.cpp's granitehybrid runs its hybrids without RoPE")
    if int(cfg.get("mamba_expand") or 2) != 2:  # GGML_ASSERT(2 * n_embd == d_inner) in load_arch_tensors
        raise ConversionError(f"Granite 4 hybrid with mamba_expand {cfg['mamba_expand']}: llama.cpp's granitehybrid "
                              "needs 2")
    if cfg.get("mamba_proj_bias"):
        raise ConversionError("Granite 4 hybrid with mamba_proj_bias: llama.cpp's granitehybrid has no Mamba "
                              "projection biases")
    # transformers 5 writes infinity as {"__float__": "Infinity"}, the Hub's configs as a bare Infinity
    limit = [float(x["__float__"] if isinstance(x, dict) else x) for x in (cfg.get("time_step_limit") or (0, "inf"))]
    if limit != [0.0, float("inf")]:  # ggml_ssm_scan clamps nothing
        raise ConversionError(f"Granite 4 hybrid with time_step_limit {limit}: llama.cpp does not clamp dt")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias"):
        raise ConversionError("Granite 4 hybrid with another activation than silu, or attention biases: not what "
                              "llama.cpp's granitehybrid computes")
    d_head = cfg.get("mamba_d_head")
    mixer(cfg).check("Granite 4 hybrid", None if d_head in (None, "auto") else int(d_head))


def _config(cfg: dict) -> dict:
    out = dict(cfg)
    kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    out["num_key_value_heads"] = [0 if m else kv for m in _mamba_layers(cfg)]
    out["max_position_embeddings"] = _NO_ROPE_CONTEXT
    out.pop("head_dim", None)  # GraniteModel.set_gguf_parameters ignores it
    if not experts.n_experts(cfg) and cfg.get("shared_intermediate_size"):
        # without experts the layer's MLP is the shared one (GraniteMoeHybridDecoderLayer), which llama.cpp
        # sizes by feed_forward_length (the Hub's dense hybrids have both widths equal)
        out["intermediate_size"] = int(cfg["shared_intermediate_size"])
    return out


def _hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    # GraniteModel.set_gguf_parameters writes each multiplier only when it is set (and not 0)
    for key, add in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier", w.add_embedding_scale),
                     ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
        if cfg.get(key):
            add(float(cfg[key]))
    # as GraniteMoeModel.set_gguf_parameters, also for dense hybrids (expert_count 0); experts are
    # intermediate_size wide (n_ff in load_arch_tensors). llama_model::load_hparams asserts used <= count.
    n = experts.n_experts(cfg)
    w.add_expert_count(n)
    w.add_expert_used_count(int(cfg.get("num_experts_per_tok") or 0) if n else 0)
    if cfg.get("shared_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(cfg["shared_intermediate_size"]))
    mixer(cfg).write(w)
    w.add_rope_scaling_finetuned(False)


def _rename(name: str, cfg: dict | None = None) -> str | None:
    name = mamba.rename(name)
    # the experts' fused input and output projections, as transformers 5's packed experts (experts.py)
    name = re.sub(r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj", name)
    return re.sub(r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj", name)


def _transform(name: str, shape: tuple[int, ...], cfg: dict) -> list[Piece] | None:
    if m := re.match(r"(.*\.layers\.\d+)\.shared_mlp\.(input|output)_linear\.weight$", name):
        # with experts the shared MLP is llama.cpp's shared expert, without them the layer's MLP
        mlp = f"{m[1]}.mlp.shared_expert" if experts.n_experts(cfg) else f"{m[1]}.mlp"
        if m[2] == "output":
            return [Piece(f"{mlp}.down_proj.weight", shape, lambda x: x)]
        ff = shape[0] // 2
        return [Piece(f"{mlp}.gate_proj.weight", (ff, shape[1]), lambda x: x[:ff]),
                Piece(f"{mlp}.up_proj.weight", (ff, shape[1]), lambda x: x[ff:])]
    return mamba.transform(name, shape, mixer(cfg))


GRANITE_HYBRID = register(Family(gguf.MODEL_ARCH.GRANITE_HYBRID, extra_hparams=_hparams, permute_qk=True,
                                 check=_check, config=_config, rename=_rename, rewrite=rewriter(_transform),
                                 experts=experts.QWEN), "GraniteMoeHybridForCausalLM")
