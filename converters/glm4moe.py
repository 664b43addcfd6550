"""GLM-4.5 / GLM-4.5-Air (HF Glm4MoeForCausalLM, llama.cpp's glm4moe arch, src/models/glm4-moe.cpp).

The first `first_k_dense_replace` layers have a dense MLP, the others routed experts chosen by a
sigmoid router with a per-expert selection bias (`e_score_correction_bias`, llama.cpp's exp_probs_b),
optionally within groups, plus `n_shared_experts` shared ones. Attention has Q/K/V biases, optional
per-head Q/K norms, and rotates only part of each head (partial_rotary_factor, 0.5 by default), in
halves. The checkpoint's NextN layer (`model.layers.<num_hidden_layers>`) is kept, as llama.cpp's
converter keeps it (conversion/glm.py Glm4MoeModel), and counted in block_count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf

from ..errors import ConversionError
from . import experts, register
from .base import Family

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

# Glm4MoeModel._set_vocab_glm: the special tokens llama.cpp's converter names (by text)
SPECIAL = (("bos", "[gMASK]"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"), ("eom", "<|observation|>"))


def _check(cfg: dict) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"GLM-4.5 hidden_act {cfg['hidden_act']!r}: llama.cpp computes SiLU experts")
    if not cfg.get("n_routed_experts") or not cfg.get("num_experts_per_tok"):
        raise ConversionError("a GLM-4.5 config needs n_routed_experts and num_experts_per_tok")
    n_group = int(cfg.get("n_group") or 1)
    if n_group > 1 and cfg["n_routed_experts"] % n_group:  # llama_model::load_hparams asserts it
        raise ConversionError(f"n_routed_experts {cfg['n_routed_experts']} is not a multiple of n_group {n_group}")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConversionError(f"GLM-4.5 topk_method {cfg['topk_method']!r}: llama.cpp selects experts as noaux_tc")


def _configure(cfg: dict, ckpt: "Checkpoint") -> dict:
    cfg = dict(cfg)
    r = cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" not in r and "partial_rotary_factor" not in cfg:
        cfg["partial_rotary_factor"] = 0.5  # Glm4MoeModel.set_gguf_parameters' default
    cfg["_n_nextn"] = int(cfg.get("num_nextn_predict_layers") or 0)
    cfg["num_hidden_layers"] += cfg["_n_nextn"]
    return cfg


def _hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    experts.write_counts(cfg, w, cfg.get("moe_intermediate_size"))
    if cfg.get("n_shared_experts") is not None:
        w.add_expert_shared_count(int(cfg["n_shared_experts"]))
    if cfg.get("first_k_dense_replace") is not None:
        w.add_leading_dense_block_count(int(cfg["first_k_dense_replace"]))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob") is not None:
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if cfg.get("n_group") is not None:  # (TextModel.set_gguf_parameters writes both when present)
        w.add_expert_group_count(int(cfg["n_group"]))
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(int(cfg["topk_group"]))
    if cfg.get("num_nextn_predict_layers") is not None:
        w.add_nextn_predict_layers(int(cfg["num_nextn_predict_layers"]))


GLM4_MOE = register(Family(gguf.MODEL_ARCH.GLM4_MOE, extra_hparams=_hparams, check=_check, experts=experts.QWEN,
                           configure=_configure, special_tokens=SPECIAL), "Glm4MoeForCausalLM")
