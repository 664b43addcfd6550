"""Qwen2 (Q/K/V biases), Qwen3 (per-head Q/K RMS norms) and Qwen3-MoE (Qwen3 attention, experts in
every layer). All rotate halves (NEOX), as HF does."""

from __future__ import annotations

import gguf

from ..errors import ConversionError
from . import experts, register
from .base import Family


def _check(cfg: dict) -> None:
    layers = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or "sliding_attention" in layers:
        raise ConversionError("Qwen sliding-window attention is not supported by llama.cpp's qwen2/qwen3 graphs")


QWEN2 = register(Family(gguf.MODEL_ARCH.QWEN2, check=_check), "Qwen2ForCausalLM")
QWEN3 = register(Family(gguf.MODEL_ARCH.QWEN3, check=_check), "Qwen3ForCausalLM")


def _check_moe(cfg: dict) -> None:
    _check(cfg)
    n = cfg["num_hidden_layers"]
    step = int(cfg.get("decoder_sparse_step") or 1)
    # transformers' Qwen3MoeDecoderLayer: a dense MLP where the layer is in mlp_only_layers or
    # (il + 1) % decoder_sparse_step != 0; llama.cpp's qwen3moe graph has experts in every layer.
    dense = [il for il in range(n) if il in (cfg.get("mlp_only_layers") or []) or (il + 1) % step]
    if dense:
        raise ConversionError(f"layers {', '.join(map(str, dense[:8]))} of this Qwen3-MoE have a dense MLP "
                              "(mlp_only_layers/decoder_sparse_step), which llama.cpp's qwen3moe graph cannot run")
    if not cfg.get("norm_topk_prob", True):  # build_moe_ffn(..., norm_w = true) in src/models/qwen3moe.cpp
        raise ConversionError("Qwen3-MoE with norm_topk_prob false: llama.cpp's qwen3moe always normalizes "
                              "the chosen experts' weights")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"Qwen3-MoE hidden_act {cfg['hidden_act']!r}: llama.cpp computes SiLU experts")
    if not experts.n_experts(cfg) or not cfg.get("num_experts_per_tok"):
        raise ConversionError("a Qwen3-MoE config needs num_experts (or num_local_experts) and num_experts_per_tok")


def _moe_hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    experts.write_counts(cfg, w, cfg.get("moe_intermediate_size"))


QWEN3MOE = register(Family(gguf.MODEL_ARCH.QWEN3MOE, extra_hparams=_moe_hparams, check=_check_moe,
                           experts=experts.QWEN), "Qwen3MoeForCausalLM")
