"""Gemma 2 and Gemma 3 (text): norm weights +1, logit soft-capping, sliding-window layers.

Sliding layers are written as a per-layer bool array (`attention.sliding_window_pattern`), which
llama_model_base::load_swa_pattern reads in preference to the period, so any `layer_types` list
converts exactly.
"""

from __future__ import annotations

import math

import gguf

from ..errors import ConversionError
from . import register
from .base import Family, head_dim

# llama_model_gemma2/3::load_arch_hparams: 1/sqrt(n_embd/n_head) for the 27B sizes (these layer
# counts), 1/sqrt(head_dim) otherwise; HF uses query_pre_attn_scalar ** -0.5.
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _swa_layers(cfg: dict, period: int) -> list[bool]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    period = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or period)
    return [(il + 1) % period != 0 for il in range(n)]


def _check_scale(cfg: dict, arch: str) -> None:
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is None:
        return
    if cfg["num_hidden_layers"] == _27B_LAYERS[arch]:
        used = cfg["hidden_size"] / cfg["num_attention_heads"]
    else:
        used = head_dim(cfg)
    if not math.isclose(float(scalar), float(used), rel_tol=1e-6):
        raise ConversionError(f"query_pre_attn_scalar={scalar} but llama.cpp's {arch} scales attention by "
                              f"1/sqrt({used:g}) for this shape; the converted model would compute differently")


def _gemma2_hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    if cfg.get("attn_logit_softcapping") is not None:
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
    if cfg.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    w.add_sliding_window(int(cfg.get("sliding_window") or 4096))
    w.add_sliding_window_pattern(_swa_layers(cfg, 2))


def _gemma3_hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConversionError("Gemma 3 with attention logit soft-capping is not supported by llama.cpp's gemma3 graph")
    if cfg.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    swa = _swa_layers(cfg, 6)
    if cfg.get("sliding_window") and any(swa):
        w.add_sliding_window(int(cfg["sliding_window"]))
        w.add_sliding_window_pattern(swa)
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        w.add_rope_freq_base_swa(float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0))


def _check2(cfg: dict) -> None:
    _check_scale(cfg, "gemma2")


def _check3(cfg: dict) -> None:
    _check_scale(cfg, "gemma3")
    full = (cfg.get("rope_parameters") or {}).get("full_attention") or cfg.get("rope_scaling") or {}
    if full.get("rope_type", full.get("type", "default")) not in ("default", "linear"):
        raise ConversionError(f"Gemma 3 RoPE type {full.get('rope_type')!r} is not supported by ctxq convert yet")


# Gemma 2: llama.cpp always ties the output to token_embd (src/models/gemma2.cpp, load_arch_tensors:
# `output` is token_embd, TENSOR_DUPLICATED); Gemma 3's graph takes an output.weight when there is one.
GEMMA2 = register(Family(gguf.MODEL_ARCH.GEMMA2, extra_hparams=_gemma2_hparams, norm_shift=1.0,
                         ties_output=True, check=_check2), "Gemma2ForCausalLM")
GEMMA3 = register(Family(gguf.MODEL_ARCH.GEMMA3, extra_hparams=_gemma3_hparams, norm_shift=1.0, check=_check3),
                  "Gemma3ForCausalLM")
