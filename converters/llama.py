"""Llama and Mistral: llama.cpp's LLAMA architecture, with Q/K rows permuted for its rotary layout."""

from __future__ import annotations

import logging

import gguf

from . import register
from .base import Family, llama3_rope_factors

log = logging.getLogger(__name__)


def _check(cfg: dict) -> None:
    if cfg.get("sliding_window") and cfg.get("model_type") == "mistral":
        # llama.cpp's LLAMA graph has no sliding window; it matters only past the window.
        log.warning("sliding_window=%s is not used by llama.cpp's llama architecture; attention will be "
                    "full beyond %s tokens", cfg["sliding_window"], cfg["sliding_window"])


LLAMA = register(Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, extra_tensors=llama3_rope_factors, check=_check),
                 "LlamaForCausalLM", "MistralForCausalLM")
