"""Llama, Mistral and Mixtral: llama.cpp's LLAMA architecture, with Q/K rows permuted for its rotary
layout. Mixtral is LLAMA with experts (llama_model_llama::load_arch_tensors takes ffn_*_exps when
expert_count > 0, of width feed_forward_length); its experts' w1/w3/w2 are gate/up/down."""

from __future__ import annotations

import logging

import gguf

from ..errors import ConversionError
from . import experts, register
from .base import Family, llama3_rope_factors

log = logging.getLogger(__name__)


def _check(cfg: dict) -> None:
    if cfg.get("sliding_window") and cfg.get("model_type") in ("mistral", "mixtral"):
        # llama.cpp's LLAMA graph has no sliding window; it matters only past the window.
        log.warning("sliding_window=%s is not used by llama.cpp's llama architecture; attention will be "
                    "full beyond %s tokens", cfg["sliding_window"], cfg["sliding_window"])


LLAMA = register(Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, extra_tensors=llama3_rope_factors, check=_check),
                 "LlamaForCausalLM", "MistralForCausalLM")


def _check_mixtral(cfg: dict) -> None:
    _check(cfg)
    if cfg.get("hidden_act", "silu") != "silu":  # build_moe_ffn is called with LLM_FFN_SILU
        raise ConversionError(f"Mixtral hidden_act {cfg['hidden_act']!r}: llama.cpp's llama graph computes SiLU experts")
    if not experts.n_experts(cfg) or not cfg.get("num_experts_per_tok"):
        raise ConversionError("a Mixtral config needs num_local_experts and num_experts_per_tok")


def _mixtral_hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    experts.write_counts(cfg, w, None)  # the llama arch sizes experts by feed_forward_length


MIXTRAL = register(Family(gguf.MODEL_ARCH.LLAMA, extra_hparams=_mixtral_hparams, permute_qk=True,
                          check=_check_mixtral, experts=experts.QWEN), "MixtralForCausalLM")
