"""Phi-3: fused QKV (`attn_qkv`) and fused gate+up (`ffn_up`, gate half first, as HF's Phi3MLP chunks it)."""

from __future__ import annotations

import logging

import gguf

from ..errors import ConversionError
from . import register
from .base import Family, rope

log = logging.getLogger(__name__)


def _check(cfg: dict) -> None:
    if rope(cfg)["rope_type"] not in ("default",):
        raise ConversionError(f"Phi-3 RoPE type {rope(cfg)['rope_type']!r} (long context factors) is not supported "
                              "by ctxq convert yet; use a 4k-context Phi-3 checkpoint")
    if cfg.get("sliding_window"):
        # llama_model_phi3::load_arch_hparams turns Phi SWA off; it matters only past the window.
        log.warning("Phi-3 sliding_window=%s is ignored by llama.cpp", cfg["sliding_window"])


def _extra(cfg: dict, w: gguf.GGUFWriter) -> None:
    w.add_rope_scaling_orig_ctx_len(int(cfg.get("original_max_position_embeddings")
                                        or cfg.get("max_position_embeddings") or 4096))


PHI3 = register(Family(gguf.MODEL_ARCH.PHI3, extra_hparams=_extra, check=_check), "Phi3ForCausalLM")
