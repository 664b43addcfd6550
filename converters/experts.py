"""Mixture-of-experts weights: one 3-D tensor per layer and projection, as llama.cpp reads them.

llama.cpp keeps all experts of a layer's projection in one tensor, `blk.N.ffn_{gate,up,down}_exps`
of ggml shape {n_in, n_out, n_expert} (numpy (n_expert, n_out, n_in)); its converter stacks the
per-expert matrices in expert order (convert_hf_to_gguf, Qwen2MoeModel.modify_tensors). Checkpoints
store them in one of three ways, all read here, one expert (or one block of its rows) at a time:

- per expert: `...layers.N.mlp.experts.E.gate_proj.weight` (Qwen3-MoE) or
  `...layers.N.block_sparse_moe.experts.E.w1.weight` (Mixtral), each (n_out, n_in);
- packed by transformers 5: `...layers.N.mlp.experts.gate_up_proj` (E, 2*ff, hidden), gate rows
  first, and `down_proj` (E, hidden, ff);
- packed as gpt-oss: `gate_up_proj` (E, hidden, 2*ff) with gate and up in alternating columns,
  `down_proj` (E, ff, hidden) (both x @ W, so transposed), biases `gate_up_proj_bias` (E, 2*ff) and
  `down_proj_bias`; and, in OpenAI's release, the weights as MXFP4 `*_blocks`/`*_scales` bytes.

Each stacked tensor gets a name the family's gguf `TensorNameMap` knows (`...experts.gate_proj.weight`,
`...experts.w1.weight`), so the mapping to GGUF names stays gguf's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import gguf
import numpy as np

from ..errors import ConversionError
from .checkpoint import TensorRef

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts)"
                         r"\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_PACKED = re.compile(r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<what>gate_up_proj|down_proj)"
                     r"(?P<tail>_bias|_blocks|_scales)?$")
_MXFP4 = gguf.GGMLQuantizationType.MXFP4
_QK_MXFP4 = gguf.GGML_QUANT_SIZES[_MXFP4][0]  # 32 weights share one e8m0 scale (ggml-common.h block_mxfp4)


@dataclass(frozen=True)
class Layout:
    """How a family's packed expert tensors are laid out (per-expert tensors need no description)."""

    interleaved: bool = False  # gpt-oss: gate/up alternate in the last axis, and weights are (in, out)


QWEN = Layout()  # transformers 5's packed Qwen3-MoE and Mixtral
GPT_OSS = Layout(interleaved=True)


@dataclass
class Stacked:
    """One output tensor made of all experts: an HF-style name, numpy shape, and its data as blocks
    (float32 rows, or raw bytes of `raw_type` already in ggml's layout)."""

    name: str
    shape: tuple[int, ...]
    blocks: Callable[[], Iterable[np.ndarray]]
    raw_type: gguf.GGMLQuantizationType | None = None


def n_experts(cfg: dict) -> int:
    """transformers' names for it: Qwen3-MoE saves num_local_experts (moe.md 2.5), Qwen2-MoE num_experts,
    GLM-4.5 n_routed_experts (the shared experts are not counted)."""
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)


def write_counts(cfg: dict, w: gguf.GGUFWriter, n_ff_exp: int | None) -> None:
    """The keys llama.cpp's load_hparams reads for every MoE arch (LLM_KV_EXPERT_COUNT, _USED_COUNT),
    and expert_feed_forward_length where the arch reads it."""
    w.add_expert_count(n_experts(cfg))
    w.add_expert_used_count(int(cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token") or 0))
    if n_ff_exp:
        w.add_expert_feed_forward_length(int(n_ff_exp))


def stack_experts(tensors: dict[str, TensorRef], n_expert: int, layout: Layout) -> tuple[list[Stacked], set[str]]:
    """The stacked expert tensors, and the checkpoint names they consumed."""
    out: list[Stacked] = []
    used: set[str] = set()
    groups: dict[tuple[str, str], dict[int, TensorRef]] = {}
    packed: dict[str, dict[str, TensorRef]] = {}
    for name, ref in tensors.items():
        if m := _PER_EXPERT.match(name):
            groups.setdefault((m["prefix"], m["proj"]), {})[int(m["e"])] = ref
            used.add(name)
        elif m := _PACKED.match(name):
            packed.setdefault(m["prefix"], {})[m["what"] + (m["tail"] or "")] = ref
            used.add(name)
    for (prefix, proj), refs in sorted(groups.items()):
        missing = sorted(set(range(n_expert)) - set(refs))
        if missing or len(refs) != n_expert:
            raise ConversionError(f"{prefix}: expert {missing[0] if missing else max(refs)} of {proj} is "
                                  f"{'missing' if missing else 'beyond the config'}'s {n_expert} experts; "
                                  "the checkpoint is incomplete or its config does not match it")
        first = refs[0]
        if any(r.shape != first.shape for r in refs.values()):
            raise ConversionError(f"{prefix}.*.{proj}: the experts' shapes differ")
        ordered = [refs[e] for e in range(n_expert)]
        out.append(Stacked(f"{prefix}.{proj}.weight", (n_expert, *first.shape),
                           (lambda rs: lambda: (b for r in rs for b in r.iter_f32()))(ordered)))
    for prefix, parts in sorted(packed.items()):
        out += _unpack(prefix, parts, n_expert, layout)
    return out, used


def _unpack(prefix: str, parts: dict[str, TensorRef], n_expert: int, layout: Layout) -> list[Stacked]:
    out = []
    if "gate_up_proj_blocks" in parts or "down_proj_blocks" in parts:
        return _mxfp4(prefix, parts, n_expert) + [s for s in _unpack(prefix, {k: v for k, v in parts.items()
                                                   if k.endswith("_bias")}, n_expert, layout)]
    gu, down = parts.get("gate_up_proj"), parts.get("down_proj")
    for ref in (gu, down):
        if ref is not None and (len(ref.shape) != 3 or ref.shape[0] != n_expert):
            raise ConversionError(f"{ref.name}: shape {ref.shape} is not (experts={n_expert}, rows, columns)")
    if gu is not None:
        if layout.interleaved:  # (E, hidden, 2ff): gate in even columns, up in odd ones, as x @ W
            ff = gu.shape[2] // 2
            for i, proj in enumerate(("gate_proj", "up_proj")):
                out.append(Stacked(f"{prefix}.{proj}.weight", (n_expert, ff, gu.shape[1]),
                                   (lambda r, i: lambda: (_slab(r, e)[:, i::2].T for e in range(n_expert)))(gu, i)))
        else:  # (E, 2ff, hidden): gate rows, then up rows
            ff = gu.shape[1] // 2
            for i, proj in enumerate(("gate_proj", "up_proj")):
                out.append(Stacked(f"{prefix}.{proj}.weight", (n_expert, ff, gu.shape[2]),
                                   (lambda r, i: lambda: (_slab(r, e)[i * ff:(i + 1) * ff] for e in range(n_expert)))(gu, i)))
    if down is not None:
        if layout.interleaved:  # (E, ff, hidden) as x @ W: each expert transposed
            out.append(Stacked(f"{prefix}.down_proj.weight", (n_expert, down.shape[2], down.shape[1]),
                               (lambda r: lambda: (_slab(r, e).T for e in range(n_expert)))(down)))
        else:
            out.append(Stacked(f"{prefix}.down_proj.weight", down.shape,
                               (lambda r: lambda: (_slab(r, e) for e in range(n_expert)))(down)))
    if (b := parts.get("gate_up_proj_bias")) is not None:  # (E, 2ff), alternating as the weights
        for i, proj in enumerate(("gate_proj", "up_proj")):
            out.append(Stacked(f"{prefix}.{proj}.bias", (n_expert, b.shape[1] // 2),
                               (lambda r, i: lambda: [r.load_f32()[:, i::2]])(b, i)))
    if (b := parts.get("down_proj_bias")) is not None:
        out.append(Stacked(f"{prefix}.down_proj.bias", b.shape, (lambda r: lambda: [r.load_f32()])(b)))
    return out


def _slab(ref: TensorRef, e: int) -> np.ndarray:
    """Expert `e` of a packed (E, rows, columns) tensor as float32, contiguous."""
    return np.ascontiguousarray(ref.rows(e, 1)[0])


# --- MXFP4 (gpt-oss as released) -----------------------------------------------------------------
# transformers/OpenAI: `*_blocks` (E, rows, n_in/32, 16) bytes, element 2k in the low nibble of byte k,
# 2k+1 in the high one; `*_scales` (E, rows, n_in/32) e8m0 exponents. ggml's block_mxfp4 is the
# exponent byte, then 16 bytes whose low nibbles hold elements 0..15 and high nibbles 16..31
# (ggml-common.h; dequantize_row_mxfp4). The 4-bit codes are the same e2m1 values in both (ggml's
# kvalues_mxfp4 are doubled and its e8m0 scale halved), so only the order of nibbles changes.


def _to_ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(..., nb, 16) HF bytes and (..., nb) scales -> (..., nb * 17) bytes of ggml block_mxfp4."""
    lo, hi = blocks & 0x0F, blocks >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)  # element order
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    return np.concatenate([scales[..., None].astype(np.uint8), qs], axis=-1).reshape(*scales.shape[:-1], -1)


def _mxfp4(prefix: str, parts: dict[str, TensorRef], n_expert: int) -> list[Stacked]:
    out = []
    for what, projs in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        blocks, scales = parts.get(f"{what}_blocks"), parts.get(f"{what}_scales")
        if blocks is None or scales is None:
            raise ConversionError(f"{prefix}.{what}: MXFP4 blocks without scales (or the reverse)")
        if blocks.dtype != "U8" or scales.dtype != "U8" or blocks.shape[-1] != _QK_MXFP4 // 2:
            raise ConversionError(f"{blocks.name}: not MXFP4 blocks of {_QK_MXFP4} weights")
        rows, n_in = blocks.shape[1], blocks.shape[2] * _QK_MXFP4
        step = len(projs)  # gate/up rows alternate, as in the float layout
        for i, proj in enumerate(projs):
            out.append(Stacked(f"{prefix}.{proj}.weight", (n_expert, rows // step, n_in),
                               (lambda b, s, i, k: lambda: (_to_ggml_mxfp4(b.raw(e)[i::k], s.raw(e)[i::k])
                                                            for e in range(n_expert)))(blocks, scales, i, step),
                               raw_type=_MXFP4))
    return out
