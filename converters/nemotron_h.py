"""Nemotron-H (HF NemotronHForCausalLM; llama.cpp's nemotron_h and, with experts, nemotron_h_moe archs,
src/models/nemotron-h.cpp, nemotron-h-moe.cpp): Mamba-2, attention (no position embedding), and
squared-ReLU MLP or expert layers, one kind per layer (`layers_block_type`, or the Hub's older
`hybrid_override_pattern` string: M Mamba, * attention, - MLP, E experts).

llama.cpp knows a layer's kind from per-layer head_count_kv and feed_forward_length (both 0: Mamba,
llama_model_nemotron_h::load_arch_hparams). Experts have no gate projection; the router is sigmoid with
a selection bias (e_score_correction), normalized and scaled as the config says. Mamba tensors as
converters/mamba.py writes them. The arch follows the layer kinds, not `num_experts_per_tok`, which
transformers 5 writes into every config (llama.cpp's converter would then take a dense model for MoE).
A multi-token-prediction head (`mtp.*`) is left out (llama.cpp's converter --no-mtp): the model's
own logits do not use it.
"""

from __future__ import annotations

import logging

import gguf

from ..errors import ConversionError
from . import experts, mamba, register
from .base import Family, Piece, rewriter

log = logging.getLogger(__name__)

_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba", "linear_attention": "mamba",
          "attention": "attention", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


def layer_kinds(cfg: dict) -> list[str]:
    pattern = cfg.get("layers_block_type") or cfg.get("layer_types") or cfg.get("hybrid_override_pattern")
    if not pattern:
        raise ConversionError("a Nemotron-H config needs layers_block_type (or hybrid_override_pattern)")
    kinds = [_KINDS.get(k) for k in pattern]
    if None in kinds:
        raise ConversionError(f"Nemotron-H layer kind {pattern[kinds.index(None)]!r} is not M, *, - or E")
    return kinds


def has_experts(cfg: dict) -> bool:
    return "moe" in layer_kinds(cfg)


def mixer(cfg: dict) -> mamba.Mixer:
    return mamba.Mixer(d_inner=cfg["mamba_num_heads"] * cfg["mamba_head_dim"], n_head=cfg["mamba_num_heads"],
                       n_group=int(cfg.get("n_groups") or 1), d_state=cfg["ssm_state_size"],
                       d_conv=int(cfg.get("conv_kernel") or 4))


def _config(cfg: dict) -> dict:
    out = dict(cfg)
    kinds = layer_kinds(cfg)
    kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    ff = int(cfg["moe_intermediate_size"] if has_experts(cfg) else cfg["intermediate_size"])
    out["num_hidden_layers"] = len(kinds)
    out["num_key_value_heads"] = [kv if k == "attention" else 0 for k in kinds]
    out["intermediate_size"] = [ff if k in ("mlp", "moe") else 0 for k in kinds]
    out["rms_norm_eps"] = float(cfg.get("layer_norm_epsilon", 1e-5))
    out["max_position_embeddings"] = 2**20  # as llama.cpp's converter writes for hybrids without RoPE
    if has_experts(cfg):
        out["num_experts"] = int(cfg["n_routed_experts"])  # the name experts.py reads
    return out


def _check(cfg: dict) -> None:
    if cfg.get("mlp_hidden_act", "relu2") != "relu2" or cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ConversionError("Nemotron-H with another activation than relu2 (MLP) and silu (Mamba): not what "
                              "llama.cpp's nemotron_h computes")
    if cfg.get("mamba_proj_bias") or cfg.get("mlp_bias") or cfg.get("attention_bias") or cfg.get("use_bias"):
        raise ConversionError("Nemotron-H with projection biases: llama.cpp's nemotron_h has none")
    if cfg.get("sliding_window"):
        raise ConversionError("Nemotron-H with a sliding window: llama.cpp's nemotron_h attends to the full context")
    limit = [float(x["__float__"] if isinstance(x, dict) else x) for x in (cfg.get("time_step_limit") or (0, "inf"))]
    if limit != [0.0, float("inf")]:  # ggml_ssm_scan clamps nothing
        raise ConversionError(f"Nemotron-H with time_step_limit {limit}: llama.cpp does not clamp dt")
    mixer(cfg).check("Nemotron-H")
    if has_experts(cfg):
        if "mlp" in layer_kinds(cfg):
            raise ConversionError("Nemotron-H with both MLP and expert layers: llama.cpp's nemotron_h_moe has one "
                                  "feed-forward width")
        if cfg.get("moe_latent_size"):
            raise ConversionError("Nemotron-H with latent experts (moe_latent_size): not converted by ctxq yet")
        if int(cfg.get("n_group") or 1) > int(cfg.get("topk_group") or 1):
            raise ConversionError("Nemotron-H with group-limited routing (topk_group < n_group): llama.cpp's "
                                  "nemotron_h_moe chooses experts from all groups")
        if int(cfg.get("n_shared_experts") or 0) != 1:
            raise ConversionError("Nemotron-H needs one shared expert (n_shared_experts) for llama.cpp's nemotron_h_moe")


def _hparams(cfg: dict, w: gguf.GGUFWriter) -> None:
    mixer(cfg).write(w)
    w.add_layer_norm_eps(float(cfg.get("layer_norm_epsilon", 1e-5)))  # read as the MTP head's norm epsilon
    w.add_rope_scaling_finetuned(False)  # GraniteHybridModel.set_gguf_parameters, which NemotronHModel inherits
    if has_experts(cfg):
        w.add_expert_count(int(cfg["n_routed_experts"]))
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
        w.add_expert_shared_feed_forward_length(int(cfg["moe_shared_expert_intermediate_size"]))
        w.add_expert_shared_count(int(cfg["n_shared_experts"]))
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))
        w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor") or 1.0))
        w.add_expert_group_count(int(cfg.get("n_group") or 1))
        w.add_expert_group_used_count(int(cfg.get("topk_group") or 1))


def _rename(name: str, cfg: dict | None = None) -> str | None:
    if name.startswith("mtp."):
        return None
    name = mamba.rename(name)
    # per-expert up/down, stacked as Qwen2-MoE's merged experts (experts.py, TensorNameMap's model.layers.N.mlp.experts)
    if ".mixer.experts." in name:
        return name.replace("backbone.layers.", "model.layers.", 1).replace(".mixer.experts.", ".mlp.experts.")
    return name.replace(".gate.e_score_correction_bias", ".gate.e_score_correction.bias")


def _transform(name: str, shape: tuple[int, ...], cfg: dict) -> list[Piece] | None:
    return mamba.transform(name, shape, mixer(cfg))


_COMMON = dict(extra_hparams=_hparams, permute_qk=True, check=_check, config=_config, rename=_rename,
               rewrite=rewriter(_transform))
NEMOTRON_H = Family(gguf.MODEL_ARCH.NEMOTRON_H, **_COMMON)
NEMOTRON_H_MOE = Family(gguf.MODEL_ARCH.NEMOTRON_H_MOE, experts=experts.QWEN, **_COMMON)
register(Family(gguf.MODEL_ARCH.NEMOTRON_H, select=lambda c: NEMOTRON_H_MOE if has_experts(c) else NEMOTRON_H,
                **_COMMON), "NemotronHForCausalLM")
