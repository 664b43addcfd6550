"""LFM2 and LFM2-MoE (HF Lfm2ForCausalLM, Lfm2MoeForCausalLM; llama.cpp's lfm2 and lfm2moe archs,
src/models/lfm2.cpp, lfm2moe.cpp): gated short convolutions in most layers, attention with per-head
Q/K norms in the others. llama.cpp tells them apart by head_count_kv, written per layer (0 for a
conv layer: llama_model_lfm2::load_arch_hparams sets is_recr from it). The conv kernel
(hidden, 1, L) becomes 2-D (hidden, L), as convert_hf_to_gguf's LFM2Model.modify_tensors squeezes it.
LFM2-MoE's first num_dense_layers have a dense MLP, the rest sigmoid-routed experts with a per-expert
selection bias (`expert_bias`, llama.cpp's exp_probs_b).
"""

from __future__ import annotations

import gguf

from ..errors import ConversionError
from . import experts, register
from .base import Family, Piece, rewriter


def _ff_dim(cfg: dict) -> int:
    """The MLP width HF builds (Lfm2MLP: 2/3 of block_ff_dim, scaled, rounded up to block_multiple_of)."""
    ff = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            ff = int(cfg["block_ffn_dim_multiplier"] * ff)
        m = int(cfg.get("block_multiple_of") or 256)
        ff = m * ((ff + m - 1) // m)
    return ff


def _attention_layers(cfg: dict) -> list[bool]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types:
        return [t == "full_attention" for t in types]
    idxs = set(cfg.get("full_attn_idxs") or [])
    return [il in idxs for il in range(n)]


def _check(cfg: dict) -> None:
    if cfg.get("conv_bias"):  # llama.cpp's shortconv block has no bias terms
        raise ConversionError("LFM2 with conv_bias: llama.cpp's lfm2 short convolution has no biases")
    if not any(_attention_layers(cfg)):
        raise ConversionError("an LFM2 config needs layer_types (or full_attn_idxs) naming its attention layers")


def _config(cfg: dict, moe: bool) -> dict:
    out = dict(cfg)
    attn = _attention_layers(cfg)
    out["num_key_value_heads"] = [int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) if a else 0
                                  for a in attn]
    out["rms_norm_eps"] = float(cfg.get("norm_eps", 1e-5))
    if not moe:
        out["intermediate_size"] = _ff_dim(cfg)
    return out


def _hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    w.add_shortconv_l_cache(int(cfg.get("conv_L_cache") or 3))


def _transform(name: str, shape: tuple[int, ...], cfg: dict) -> list[Piece] | None:
    if name.endswith("conv.conv.weight") and len(shape) == 3:
        return [Piece(name, (shape[0], shape[2]), lambda x: x[:, 0, :])]
    return None


LFM2 = register(Family(gguf.MODEL_ARCH.LFM2, extra_hparams=_hparams, check=_check,
                       config=lambda c: _config(c, moe=False), rewrite=rewriter(_transform)),
                "Lfm2ForCausalLM", "LFM2ForCausalLM")


def _check_moe(cfg: dict) -> None:
    _check(cfg)
    if not experts.n_experts(cfg) or not cfg.get("num_experts_per_tok"):
        raise ConversionError("an LFM2-MoE config needs num_experts and num_experts_per_tok")
    # Lfm2MoeSparseMoeBlock: sigmoid scores, + expert_bias to choose, normalized when norm_topk_prob;
    # build_moe_ffn in src/models/lfm2moe.cpp normalizes the chosen weights always
    if not cfg.get("norm_topk_prob", True):
        raise ConversionError("LFM2-MoE with norm_topk_prob false: llama.cpp's lfm2moe always normalizes the "
                              "chosen experts' weights")
    if not cfg.get("use_expert_bias", True):
        raise ConversionError("LFM2-MoE without expert_bias: llama.cpp's lfm2moe needs the selection bias")
    if float(cfg.get("routed_scaling_factor") or 1.0) != 1.0:
        raise ConversionError(f"LFM2-MoE routed_scaling_factor={cfg['routed_scaling_factor']}: llama.cpp's lfm2moe "
                              "does not scale the experts' output")


def _moe_hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    _hparams(cfg, w)
    experts.write_counts(cfg, w, cfg["moe_intermediate_size"])
    w.add_leading_dense_block_count(int(cfg.get("num_dense_layers") or 0))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _rename_moe(name: str, cfg: dict | None = None) -> str | None:
    # per-expert w1/w3/w2 stacked as Mixtral's (experts.py); expert_bias is the router's selection bias
    name = name.replace(".feed_forward.experts.", ".block_sparse_moe.experts.")
    return name.replace(".feed_forward.expert_bias", ".feed_forward.expert_bias.bias")


LFM2MOE = register(Family(gguf.MODEL_ARCH.LFM2MOE, extra_hparams=_moe_hparams, check=_check_moe,
                          config=lambda c: _config(c, moe=True), rewrite=rewriter(_transform), rename=_rename_moe,
                          experts=experts.QWEN), "Lfm2MoeForCausalLM")
