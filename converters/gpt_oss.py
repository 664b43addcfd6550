"""gpt-oss (HF GptOssForCausalLM, llama.cpp's gpt-oss arch, src/models/openai-moe.cpp).

Experts come packed: gate and up alternate in `gate_up_proj`'s columns and are split apart; their
biases too (converters/experts.py). OpenAI's release keeps expert weights in MXFP4, which is copied
into ggml's MXFP4 blocks as it is (no requantization). Attention has biases and per-head sinks, and
alternate layers a sliding window: llama_model_openai_moe::load_arch_hparams reads
attention.sliding_window and, through load_swa_pattern, the per-layer sliding_window_pattern array
written here from `layer_types`.
"""

from __future__ import annotations

import logging

import gguf

from ..errors import ConversionError
from . import experts, register
from .base import Family, rope

log = logging.getLogger(__name__)

# build_moe_ffn's LLM_FFN_SWIGLU_OAI_MOE (src/llama-graph.cpp) fixes alpha = 1.702 and limit = 7.0;
# transformers' GptOssExperts takes the limit from the config (alpha is fixed there too).
_SWIGLU_LIMIT = 7.0


def _layer_types(cfg: dict) -> list[bool]:
    types = cfg.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    # GptOssConfig's default: sliding on even layers, full on odd ones
    return [(il + 1) % 2 == 1 for il in range(cfg["num_hidden_layers"])]


def _check(cfg: dict) -> None:
    if float(cfg.get("swiglu_limit", _SWIGLU_LIMIT)) != _SWIGLU_LIMIT:
        raise ConversionError(f"gpt-oss swiglu_limit={cfg['swiglu_limit']}: llama.cpp's gpt-oss computes experts "
                              f"with a limit of {_SWIGLU_LIMIT}")
    if not cfg.get("attention_bias", True):
        raise ConversionError("gpt-oss without attention biases: llama.cpp's gpt-oss graph needs them")
    if not experts.n_experts(cfg):
        raise ConversionError("a gpt-oss config needs num_local_experts")
    r = rope(cfg)
    if r["rope_type"] == "yarn" and r.get("truncate") is False:
        # ggml_rope_yarn_corr_dims always floors/ceils YaRN's correction range; gpt-oss's config says
        # not to (measured on a random checkpoint with a 64-token original context: relative L2 0.13
        # against transformers, 3.5e-4 with truncate=true). llama.cpp's own conversion is the same.
        log.warning("gpt-oss YaRN with truncate=false: llama.cpp rounds the correction range, so logits "
                    "differ slightly from transformers' (as with llama.cpp's own converter)")
    if any(_layer_types(cfg)) and not cfg.get("sliding_window"):
        raise ConversionError("gpt-oss layer_types name sliding layers but sliding_window is not set")


def _hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    # every expert is intermediate_size wide (llama.cpp reads it as expert_feed_forward_length)
    experts.write_counts(cfg, w, cfg["intermediate_size"])
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    w.add_sliding_window_pattern(_layer_types(cfg))


GPT_OSS = register(Family(gguf.MODEL_ARCH.GPT_OSS, extra_hparams=_hparams, check=_check, experts=experts.GPT_OSS),
                   "GptOssForCausalLM")
