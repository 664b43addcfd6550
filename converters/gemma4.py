"""Gemma 4 (text): llama.cpp's gemma4 arch (src/models/gemma4.cpp), as its converter of the vendored
version writes it (conversion/gemma.py, Gemma4Model on top of Gemma3Model).

- Sliding and full layers differ in head size (`head_dim` / `global_head_dim`, or `per_layer_config`)
  and may differ in KV heads: the full layers' sizes are the plain keys, the sliding ones `*_swa`,
  KV heads an array per layer when they differ.
- Full layers use "proportional" RoPE over `partial_rotary_factor` of the head; ggml's NEOX rope
  rotates the first dims, so the rest is frozen through `rope_freqs` (frequency factor 1e30).
- The last `num_kv_shared_layers` layers reuse earlier layers' caches (no K/V tensors).
- Per-layer embeddings (`hidden_size_per_layer_input`), `layer_scalar`, unshifted norms (x * w).
- Experts (26B-A4B, `enable_moe_block`) beside the dense MLP of every layer: the packed
  `experts.gate_up_proj` stays fused (`ffn_gate_up_exps`), `router.scale` becomes `ffn_gate_inp.scale`
  and `router.per_expert_scale` `ffn_down_exps.scale` (Gemma4Model.modify_tensors).
- The `…ForConditionalGeneration` checkpoints convert their language model; vision and audio towers
  are left out, as llama.cpp's text conversion leaves them.
The vocabulary is llama.cpp's `gemma4` tokenizer model (tokenizer.load_gemma4_vocab).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import gguf
import numpy as np

from ..errors import ConversionError
from . import register
from .base import Family, Rewritten

if TYPE_CHECKING:
    from .checkpoint import TensorRef

_SKIP = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
# Gemma4Model.generate_extra_tensors: frequency factor of the dims proportional RoPE leaves unrotated
_FROZEN = 1e30
_ROUTER_SCALE = re.compile(r"^model\.layers\.(\d+)\.router\.(scale|per_expert_scale)$")


def _full_layer_value(cfg: dict, key: str, plain: str):
    """A full-attention layer's value from `plain` (global_head_dim, ...) or per_layer_config, as
    Gemma4Model.set_gguf_parameters looks it up (the first full layer listed)."""
    if cfg.get(plain) is not None:
        return cfg[plain]
    types = cfg["layer_types"]
    for il, layer in (cfg.get("per_layer_config") or {}).items():
        if int(il) < len(types) and types[int(il)] == "full_attention" and key in layer:
            return layer[key]
    return None


def _config(cfg: dict) -> dict:
    """The config as llama.cpp reads it: the full layers' head size and RoPE as the plain keys, KV heads
    per layer where full layers have their own count, the MLP width per layer for double-wide MLPs."""
    out = dict(cfg)
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or []
    if len(types) != n:
        raise ConversionError(f"Gemma 4 config lists {len(types)} layer_types for {n} layers")
    hd_full = _full_layer_value(cfg, "head_dim", "global_head_dim")
    if hd_full is None:
        raise ConversionError("Gemma 4 config has neither global_head_dim nor a full layer's head_dim in "
                              "per_layer_config; llama.cpp's converter needs the full layers' head size")
    rp = cfg.get("rope_parameters") or {}
    full, swa = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    out.update(head_dim=int(hd_full), _head_dim_swa=int(cfg["head_dim"]), _rope_full=full, _rope_swa=swa,
               rope_parameters={"rope_type": "default", "rope_theta": float(full.get("rope_theta", 1_000_000.0))})
    kv_full = _full_layer_value(cfg, "num_key_value_heads", "num_global_key_value_heads")
    if kv_full is not None and cfg.get("num_key_value_heads") is not None:
        out["num_key_value_heads"] = [int(cfg["num_key_value_heads"] if t == "sliding_attention" else kv_full)
                                      for t in types]
    if cfg.get("use_double_wide_mlp"):
        first_shared = n - int(cfg.get("num_kv_shared_layers") or 0)
        ff = int(cfg["intermediate_size"])
        out["intermediate_size"] = [ff if il < first_shared else 2 * ff for il in range(n)]
    return out


def _check(cfg: dict) -> None:
    full, swa = cfg["_rope_full"], cfg["_rope_swa"]
    if full.get("rope_type") != "proportional":  # Gemma4Model.generate_extra_tensors asserts it
        raise ConversionError(f"Gemma 4 full-attention RoPE type {full.get('rope_type')!r}: llama.cpp's converter "
                              "and gemma4 graph implement 'proportional' only")
    if swa.get("rope_type", "default") != "default":
        raise ConversionError(f"Gemma 4 sliding-attention RoPE type {swa.get('rope_type')!r}: llama.cpp's gemma4 "
                              "graph applies plain RoPE there")
    if cfg.get("attention_bias"):
        raise ConversionError("Gemma 4 with attention_bias: llama.cpp's gemma4 graph has no attention biases")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConversionError(f"Gemma 4 hidden_activation {cfg['hidden_activation']!r}: llama.cpp's gemma4 "
                              "computes a tanh-GELU MLP")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ConversionError("Gemma 4 with use_bidirectional_attention='all': llama.cpp's gemma4 graph is causal "
                              "for text")
    if cfg.get("enable_moe_block") and not (cfg.get("num_experts") and cfg.get("top_k_experts")
                                            and cfg.get("moe_intermediate_size")):
        raise ConversionError("Gemma 4 with enable_moe_block needs num_experts, top_k_experts and "
                              "moe_intermediate_size in config.json")
    pl_vocab = cfg.get("vocab_size_per_layer_input")
    if cfg.get("hidden_size_per_layer_input") and pl_vocab is not None and pl_vocab != cfg.get("vocab_size"):
        raise ConversionError(f"Gemma 4 with vocab_size_per_layer_input {pl_vocab} != vocab_size "
                              f"{cfg.get('vocab_size')}: llama.cpp's gemma4 reads one per-layer row per token")
    _check_kv_sharing(cfg)


def _check_kv_sharing(cfg: dict) -> None:
    """llama.cpp (llama_model::create_memory, reuse callback) gives a shared sliding layer the cache of
    layer first_shared - 2 and a shared full layer that of first_shared - 1; transformers takes the last
    non-shared layer of the same type. They agree when the last two non-shared layers are sliding, full."""
    n, n_shared = cfg["num_hidden_layers"], int(cfg.get("num_kv_shared_layers") or 0)
    if not n_shared:
        return
    types, first = cfg["layer_types"], n - n_shared
    if first < 2 or types[first - 2] != "sliding_attention" or types[first - 1] != "full_attention":
        raise ConversionError(f"Gemma 4 with {n_shared} KV-shared layers after layer types {types[:first][-2:]}: "
                              "llama.cpp's gemma4 reuses the caches of layers first_shared-2 (sliding) and "
                              "first_shared-1 (full), so the converted model would compute differently")


def _hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    w.add_sliding_window(int(cfg["sliding_window"]))
    w.add_sliding_window_pattern(swa)
    w.add_rope_freq_base_swa(float(cfg["_rope_swa"].get("rope_theta", 10000.0)))
    w.add_shared_kv_layers(int(cfg.get("num_kv_shared_layers") or 0))
    w.add_embedding_length_per_layer_input(int(cfg.get("hidden_size_per_layer_input") or 0))
    hd_swa = cfg["_head_dim_swa"]
    w.add_key_length_swa(hd_swa)
    w.add_value_length_swa(hd_swa)
    w.add_rope_dimension_count_swa(int(hd_swa * float(cfg["_rope_swa"].get("partial_rotary_factor", 1.0))))
    if cfg.get("enable_moe_block"):  # TextModel.set_gguf_parameters reads num_experts and top_k_experts
        w.add_expert_count(int(cfg["num_experts"]))
        w.add_expert_used_count(int(cfg["top_k_experts"]))
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))


def _rope_freqs(cfg: dict) -> dict[str, np.ndarray]:
    """Factor 1 for the rotated pairs of the full layers' proportional RoPE, 1e30 (no rotation) for the rest."""
    half = cfg["head_dim"] // 2
    rotated = int(cfg["head_dim"] * float(cfg["_rope_full"]["partial_rotary_factor"]) / 2)
    return {"rope_freqs.weight": np.array([1.0] * rotated + [_FROZEN] * (half - rotated), dtype=np.float32)}


def _rename(name: str, cfg: dict) -> str | None:
    if name.startswith(_SKIP):
        return None
    return name.replace("model.language_model.", "model.", 1)


def _rewrite(name: str, ref: "TensorRef", cfg: dict) -> "list[Rewritten] | None":
    """The router's two scales, which gguf's TensorNameMap has no name for."""
    m = _ROUTER_SCALE.match(name)
    if m is None:
        return None
    out = "ffn_gate_inp.scale" if m.group(2) == "scale" else "ffn_down_exps.scale"
    return [(f"blk.{m.group(1)}.{out}", tuple(ref.shape), ref.load_f32)]


GEMMA4 = register(Family(gguf.MODEL_ARCH.GEMMA4, config=_config, check=_check, extra_hparams=_hparams,
                         extra_tensors=_rope_freqs, rename=_rename, rewrite=_rewrite), "Gemma4ForCausalLM",
                  "Gemma4ForConditionalGeneration")
