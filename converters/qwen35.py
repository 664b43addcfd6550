"""Qwen3.5 (dense and MoE) and Qwen3-Next: gated DeltaNet linear attention in most layers, gated full
attention in every `full_attention_interval`-th one (llama.cpp's qwen35, qwen35moe and qwen3next archs,
src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp).

The transforms are those of llama.cpp's converter of the vendored version (conversion/qwen.py,
Qwen3NextModel and _LinearAttentionVReorderBase):
- RMS norms store w and compute x * (1 + w): +1, except the gated norm of the linear attention;
- `A_log` becomes A = -exp(A_log) (`ssm_a`, no .weight suffix), `dt_bias` the bias of `ssm_dt`,
  the depthwise conv kernel (C, 1, K) becomes (C, K);
- Qwen3-Next's fused `in_proj_qkvz` (per key head: q, k, v, z) splits into `attn_qkv` (all q, all k,
  all v) and `attn_gate` (z);
- Qwen3.5 with fewer key heads than value heads reorders the value heads from grouped by key head to
  tiled (ggml's broadcast repeats key heads that way): the V rows of in_proj_qkv and of the conv kernel,
  in_proj_z, in_proj_a/b, A_log, dt_bias, and out_proj's columns;
- MTP blocks (`mtp.*`) are kept as NextN layers after the trunk, as llama.cpp's converter keeps them
  (its --no-mtp is not the default); llama.cpp loads them and leaves them out of the main graph.
The `…ForConditionalGeneration` checkpoints convert their language model; the vision tower is left out.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import gguf
import numpy as np

from ..errors import ConversionError
from . import experts, register
from .base import Family, Rewritten

if TYPE_CHECKING:
    from .checkpoint import Checkpoint, TensorRef

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# MTP tensors outside its decoder layer (conversion/qwen.py _QwenMtpMixin.filter_tensors)
_MTP_NAMES = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
              "norm": "shared_head.norm"}
# NextN tensors by the names llama.cpp reads (installed gguf's TensorNameMap lacks them for qwen35)
_NEXTN = {"eh_proj": "nextn.eh_proj", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm",
          "shared_head.norm": "nextn.shared_head_norm", "embed_tokens": "nextn.embed_tokens",
          "shared_head.head": "nextn.shared_head_head"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _heads(cfg: dict) -> tuple[int, int, int, int]:
    return (int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]),
            int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]))


def _layer_types(cfg: dict) -> list[str]:
    n = cfg["num_hidden_layers"] if "_n_main_layers" not in cfg else cfg["_n_main_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    step = int(cfg.get("full_attention_interval") or 4)  # transformers' and llama.cpp's default
    return ["linear_attention" if (il + 1) % step else "full_attention" for il in range(n)]


def _check(cfg: dict, moe: bool) -> None:
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim"):
        if not isinstance(cfg.get(key), int):
            raise ConversionError(f"config.json: {key} is missing or not an integer (the linear attention's shape)")
    nk, nv, dk, dv = _heads(cfg)
    if dk != dv:  # load_arch_tensors sizes both with ssm.state_size
        raise ConversionError(f"linear_key_head_dim {dk} differs from linear_value_head_dim {dv}: llama.cpp's "
                              "gated DeltaNet needs them equal")
    if nv % nk:
        raise ConversionError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
    types = _layer_types(cfg)
    if len(types) != cfg["num_hidden_layers"] or set(types) - {"linear_attention", "full_attention"}:
        raise ConversionError(f"layer_types must name linear_attention or full_attention for each of the "
                              f"{cfg['num_hidden_layers']} layers")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {cfg['hidden_act']!r}: llama.cpp's Qwen3.5/Qwen3-Next compute SiLU")
    if cfg.get("attention_bias"):
        raise ConversionError("attention_bias: llama.cpp's Qwen3.5/Qwen3-Next attention has no biases")
    if not moe:
        return
    if not experts.n_experts(cfg) or not cfg.get("num_experts_per_tok"):
        raise ConversionError("a MoE config needs num_experts and num_experts_per_tok")
    # qwen3next.cpp / qwen35moe.cpp: experts in every layer, chosen weights always normalized
    dense = [il for il in range(cfg["num_hidden_layers"]) if il in (cfg.get("mlp_only_layers") or [])
             or (il + 1) % int(cfg.get("decoder_sparse_step") or 1)]
    if dense:
        raise ConversionError(f"layers {', '.join(map(str, dense[:8]))} have a dense MLP (mlp_only_layers/"
                              "decoder_sparse_step), which llama.cpp's graph cannot run")
    if not cfg.get("norm_topk_prob", True):
        raise ConversionError("norm_topk_prob false: llama.cpp always normalizes the chosen experts' weights")


def _n_mtp(ckpt: "Checkpoint") -> int:
    found = {int(m[1]) for n in ckpt.tensors if (m := _MTP_LAYER.match(n.removeprefix("model.")))}
    return max(found) + 1 if found else 0


def _configure(cfg: dict, ckpt: "Checkpoint") -> dict:
    cfg = dict(cfg)
    r = cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" not in r and "partial_rotary_factor" not in cfg:
        cfg["partial_rotary_factor"] = 0.25  # Qwen3NextModel.set_gguf_parameters' default
    n = cfg["num_hidden_layers"]
    cfg["_n_main_layers"], cfg["_n_mtp"] = n, _n_mtp(ckpt)
    cfg["num_hidden_layers"] = n + cfg["_n_mtp"]  # block_count counts the NextN layers
    return cfg


def _rename(name: str, cfg: dict) -> str | None:
    if name.startswith(("model.visual.", "visual.", "model.vision_tower.")):
        return None
    name = name.replace("model.language_model.", "model.", 1).replace("model.mtp.", "mtp.", 1)
    if not name.startswith("mtp."):
        return name
    n = cfg["_n_main_layers"]
    if m := _MTP_LAYER.match(name):
        return f"model.layers.{n + int(m[1])}.{m[2]}"
    head, _, tail = name[4:].partition(".")
    if head in _MTP_NAMES:
        return f"model.layers.{n}.{_MTP_NAMES[head]}.{tail}"
    raise ConversionError(f"tensor {name} of the MTP block has no place in llama.cpp's NextN layer")


def _tiled(x: np.ndarray, axis: int, nk: int, nv: int, hd: int) -> np.ndarray:
    """Value heads from grouped by key head [K0: v0..v(r-1), K1: ...] to tiled [K0 v0, K1 v0, ..., K0 v1, ...]
    along `axis` (conversion/qwen.py _reorder_v_heads)."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(nk, nv // nk, hd, *rest).swapaxes(0, 1).reshape(nv * hd, *rest)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def _rewriter(qkvz: bool, reorder: bool):
    """The per-tensor transforms (module docstring); `qkvz`: Qwen3-Next's fused projection, `reorder`:
    Qwen3.5's value-head order."""

    def rewrite(name: str, ref: "TensorRef", cfg: dict) -> list[Rewritten] | None:
        m = _LAYER.match(name)
        if m is None:
            if name == "model.norm.weight":
                return [(name, ref.shape, lambda: ref.load_f32() + np.float32(1))]
            return None
        il, rest = int(m[1]), m[2]
        nk, nv, dk, dv = _heads(cfg)
        tile = reorder and nk != nv and rest.startswith("linear_attn.")
        if rest in _NEXTN or rest.removesuffix(".weight") in _NEXTN:
            gname = f"blk.{il}.{_NEXTN[rest.removesuffix('.weight')]}.weight"
            plus = 1 if rest.endswith("norm.weight") else 0
            return [(gname, ref.shape, lambda: ref.load_f32() + np.float32(plus))]
        if rest == "linear_attn.A_log":
            return [(f"blk.{il}.ssm_a", ref.shape,
                     lambda: -np.exp(_tiled(ref.load_f32(), 0, nk, nv, 1) if tile else ref.load_f32()))]
        if rest == "linear_attn.dt_bias":
            return [(f"model.layers.{il}.linear_attn.dt_proj.bias", ref.shape,
                     lambda: _tiled(ref.load_f32(), 0, nk, nv, 1) if tile else ref.load_f32())]
        if rest == "linear_attn.conv1d.weight":
            shape = (ref.shape[0], ref.shape[-1])

            def conv():
                x = ref.load_f32().reshape(shape)
                if tile:
                    x = np.concatenate([x[:2 * nk * dk], _tiled(x[2 * nk * dk:], 0, nk, nv, dv)])
                return x
            return [(name, shape, conv)]
        if qkvz and rest == "linear_attn.in_proj_qkvz.weight":
            return _split_qkvz(il, ref, nk, nv, dk, dv)
        if tile and rest == "linear_attn.in_proj_qkv.weight":
            return [(name, ref.shape, lambda: np.concatenate(
                [(x := ref.load_f32())[:2 * nk * dk], _tiled(x[2 * nk * dk:], 0, nk, nv, dv)]))]
        if tile and rest in ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_a.weight",
                             "linear_attn.in_proj_b.weight", "linear_attn.out_proj.weight"):
            axis, hd = (1, dv) if "out_proj" in rest else (0, dv if "_z." in rest else 1)
            return [(name, ref.shape, lambda: _tiled(ref.load_f32(), axis, nk, nv, hd))]
        if rest.endswith("norm.weight") and rest != "linear_attn.norm.weight":
            return [(name, ref.shape, lambda: ref.load_f32() + np.float32(1))]
        return None

    return rewrite


def _split_qkvz(il: int, ref: "TensorRef", nk: int, nv: int, dk: int, dv: int) -> list[Rewritten]:
    """Qwen3-Next's in_proj_qkvz rows, per key head [q, k, v, z], as all q, all k, all v (attn_qkv) and
    all z (attn_gate) (Qwen3NextModel.modify_tensors)."""
    r = nv // nk * dv
    per = 2 * dk + 2 * r
    hidden = ref.shape[1]

    def part(lo: int, hi: int) -> np.ndarray:
        return ref.load_f32().reshape(nk, per, hidden)[:, lo:hi].reshape(-1, hidden)

    return [(f"blk.{il}.attn_qkv.weight", (nk * (2 * dk + r), hidden),
             lambda: np.concatenate([part(0, dk), part(dk, 2 * dk), part(2 * dk, 2 * dk + r)])),
            (f"blk.{il}.attn_gate.weight", (nk * r, hidden), lambda: part(2 * dk + r, per))]


def _hparams(moe: bool, sections: bool):
    def write(cfg: dict, w: gguf.GGUFWriter) -> None:
        if moe:
            experts.write_counts(cfg, w, cfg.get("moe_intermediate_size"))
            if cfg.get("shared_expert_intermediate_size") is not None:
                w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
        nk, nv, dk, dv = _heads(cfg)
        w.add_ssm_conv_kernel(int(cfg["linear_conv_kernel_dim"]))
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(nk)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(dv * nv)
        recurrent = [t == "linear_attention" for t in _layer_types(cfg)] + [False] * cfg["_n_mtp"]
        w.add_array(f"{w.arch}.attention.recurrent_layers", recurrent)  # (no add_recurrent_layers in gguf 0.19.0)
        w.add_full_attention_interval(int(cfg.get("full_attention_interval") or 4))
        if sections:
            # llama.cpp's qwen35 loaders require the (interleaved) MRoPE sections; text positions are
            # the same in every section, so any split computes the same rotation
            sec = list((cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("mrope_section")
                       or [11, 11, 10])
            w.add_rope_dimension_sections((sec + [0, 0, 0, 0])[:4])
        if cfg["_n_mtp"]:
            w.add_nextn_predict_layers(cfg["_n_mtp"])
    return write


def _family(arch: gguf.MODEL_ARCH, moe: bool, qkvz: bool, reorder: bool, sections: bool) -> Family:
    return Family(arch, extra_hparams=_hparams(moe, sections), check=lambda cfg: _check(cfg, moe),
                  experts=experts.QWEN if moe else None, configure=_configure, rename=_rename,
                  rewrite=_rewriter(qkvz, reorder))


QWEN35 = register(_family(gguf.MODEL_ARCH.QWEN35, False, False, True, True),
                  "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
QWEN35MOE = register(_family(gguf.MODEL_ARCH.QWEN35MOE, True, False, True, True),
                     "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
QWEN3NEXT = register(_family(gguf.MODEL_ARCH.QWEN3NEXT, True, True, False, False), "Qwen3NextForCausalLM")
