"""SmolLM3 (HF SmolLM3ForCausalLM, llama.cpp's smollm3 arch, src/models/smollm3.cpp): Llama with
NoPE layers. llama.cpp rotates Q/K as its llama graph does (so Q/K rows are permuted, as
convert_hf_to_gguf's SmolLM3Model inherits from LlamaModel) and skips RoPE on every fourth layer:
llama_model_smollm3::load_arch_hparams fixes n_no_rope_layer_step = 4, read from nothing in the GGUF.
"""

from __future__ import annotations

import gguf

from ..errors import ConversionError
from . import register
from .base import Family, rope

_NO_ROPE_STEP = 4  # llama_model_smollm3::load_arch_hparams


def _check(cfg: dict) -> None:
    n = cfg["num_hidden_layers"]
    # transformers' SmolLM3Config: no_rope_layers[il] is 1 where layer il uses RoPE
    got = [int(x) for x in (cfg.get("no_rope_layers") or [])[:n]]
    want = [int((il + 1) % _NO_ROPE_STEP != 0) for il in range(n)]
    if got and got != want:
        nope = [il for il, x in enumerate(got) if not x]
        raise ConversionError(f"SmolLM3 with NoPE layers {nope[:8]}: llama.cpp's smollm3 graph skips RoPE on every "
                              f"{_NO_ROPE_STEP}th layer only (layers {[il for il in range(n) if not want[il]][:8]})")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ConversionError("SmolLM3 with a sliding window: llama.cpp's smollm3 graph attends to the full context")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ConversionError("SmolLM3 with attention_bias or mlp_bias: llama.cpp's smollm3 graph has no output "
                              "projection or MLP biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"SmolLM3 hidden_act {cfg['hidden_act']!r}: llama.cpp's smollm3 computes a SiLU MLP")
    if rope(cfg)["rope_type"] == "llama3":  # no rope_freqs tensor in llama_model_smollm3::load_arch_tensors
        raise ConversionError("SmolLM3 with llama3 RoPE scaling: llama.cpp's smollm3 graph has no rope_freqs")


SMOLLM3 = register(Family(gguf.MODEL_ARCH.SMOLLM3, permute_qk=True, check=_check), "SmolLM3ForCausalLM")
