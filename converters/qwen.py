"""Qwen2 (Q/K/V biases) and Qwen3 (per-head Q/K RMS norms). Both rotate halves (NEOX), as HF does."""

from __future__ import annotations

import gguf

from ..errors import ConversionError
from . import register
from .base import Family


def _check(cfg: dict) -> None:
    layers = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or "sliding_attention" in layers:
        raise ConversionError("Qwen sliding-window attention is not supported by llama.cpp's qwen2/qwen3 graphs")


QWEN2 = register(Family(gguf.MODEL_ARCH.QWEN2, check=_check), "Qwen2ForCausalLM")
QWEN3 = register(Family(gguf.MODEL_ARCH.QWEN3, check=_check), "Qwen3ForCausalLM")
