"""What a family module declares, and the metadata every llama-style family shares.

A family is data: its GGUF architecture, whether Q/K rows are permuted for llama.cpp's rotary
layout, whether norm weights are shifted by +1 (Gemma stores w and computes x * (1 + w)), which
Hugging Face tensors llama.cpp does not use, and a function for its extra metadata keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import gguf
import numpy as np

from ..errors import ConversionError

if TYPE_CHECKING:
    from .checkpoint import Checkpoint, TensorRef
    from .experts import Layout


# One tensor as a family's `rewrite` makes it: name (mapped by TensorNameMap, or already a GGUF name),
# numpy shape, and a loader of the whole float32 array.
Rewritten = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


@dataclass(frozen=True)
class Family:
    arch: gguf.MODEL_ARCH
    extra_hparams: Callable[[dict, gguf.GGUFWriter], None] | None = None
    permute_qk: bool = False  # llama.cpp's LLAMA arch uses interleaved (GPT-J style) rotary pairs
    norm_shift: float = 0.0
    ties_output: bool = False  # llama.cpp's graph computes the output with token_embd, whatever lm_head holds
    extra_tensors: Callable[[dict], dict[str, np.ndarray]] | None = None
    check: Callable[[dict], None] | None = None  # refuses configs llama.cpp would compute differently
    experts: "Layout | None" = None  # mixture of experts: how packed expert tensors are laid out (experts.py)
    # Families whose checkpoints need more than renaming (qwen35.py, glm4moe.py):
    # `configure` returns the config the conversion works from (defaults llama.cpp's converter assumes,
    # extra NextN blocks counted in num_hidden_layers); `rename` maps a checkpoint name to the name gguf's
    # TensorNameMap knows, or None to leave the tensor out; `rewrite` turns one (renamed) tensor into
    # the tensors llama.cpp reads, as (name, numpy shape, loader of the whole float32 array), or None
    # for the usual mapping.
    configure: Callable[[dict, "Checkpoint"], dict] | None = None
    rename: Callable[[str, dict], str | None] | None = None
    rewrite: "Callable[[str, TensorRef, dict], list[Rewritten] | None] | None" = None
    special_tokens: tuple[tuple[str, str], ...] = ()  # (kind, token text) llama.cpp's converter sets where unset
    # Hybrids (lfm2.py, granite_hybrid.py, nemotron_h.py): `config` gives the config as llama.cpp's converter
    # reads it before any check (per-layer head counts, derived widths); `select` picks the family where the
    # llama.cpp arch depends on the config (Nemotron-H with or without experts).
    config: Callable[[dict], dict] | None = None
    select: "Callable[[dict], Family] | None" = None

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


def text_config(config: dict) -> dict:
    """The language model's config (multimodal wrappers keep it under text_config)."""
    return config.get("text_config") or config


def resolve(family: Family, config: dict) -> tuple[Family, dict]:
    """The family and the language model's config as a conversion writes them: the family the config
    selects (`Family.select`), and the config as llama.cpp's converter reads it (`Family.config`)."""
    cfg = text_config(config)
    if family.select:
        family = family.select(cfg)
    return family, (family.config(cfg) if family.config else cfg)


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def rope(cfg: dict) -> dict:
    """RoPE settings in one dict (transformers 5 `rope_parameters`, 4.x `rope_scaling` + `rope_theta`)."""
    params = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in params:  # per layer type (Gemma 3); the global layers' settings
        params = dict(params["full_attention"])
    legacy = cfg.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def write_common(cfg: dict, w: gguf.GGUFWriter) -> None:
    """The keys llama.cpp's llama_model::load_hparams reads for every architecture here."""
    n_head = cfg["num_attention_heads"]
    w.add_context_length(int(cfg.get("max_position_embeddings") or 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    if cfg.get("intermediate_size") is not None:  # MoE-only configs (Qwen3.5-MoE) have none, nor does llama.cpp's file
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or n_head)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    hd = head_dim(cfg)
    w.add_key_length(hd)
    w.add_value_length(hd)
    r = rope(cfg)
    w.add_rope_freq_base(float(r["rope_theta"]))
    w.add_rope_dimension_count(int(hd * float(r.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))))
    kind = r["rope_type"]
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(r["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(r["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(r["original_max_position_embeddings"]))
        if r.get("beta_fast") is not None:  # llama.cpp's defaults are 32 and 1 (llama_hparams)
            w.add_rope_scaling_yarn_beta_fast(float(r["beta_fast"]))
        if r.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(r["beta_slow"]))
    elif kind not in ("default", "llama3"):  # llama3 is written as the rope_freqs tensor
        raise ConversionError(f"RoPE type {kind!r} is not supported by ctxq convert yet")


def llama3_rope_factors(cfg: dict) -> dict[str, np.ndarray]:
    """`rope_freqs.weight` for Llama 3.1-style scaling: llama.cpp divides each rotary frequency by
    this factor. The rule is Meta's (transformers' _compute_llama3_parameters)."""
    r = rope(cfg)
    if r["rope_type"] != "llama3":
        return {}
    base, dim = float(r["rope_theta"]), head_dim(cfg)
    factor, lo, hi = float(r["factor"]), float(r.get("low_freq_factor", 1.0)), float(r.get("high_freq_factor", 4.0))
    old_ctx = float(r.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.array(out, dtype=np.float32)}


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF keeps each head's rotary halves apart; llama.cpp's LLAMA graph rotates adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LM_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


def output_is_token_embd(ckpt: "Checkpoint", family: Family, cfg: dict) -> bool:
    """Whether lm_head.weight is left out, llama.cpp then computing the output with token_embd.

    It is, when the config ties it (as before) or the family's llama.cpp graph always ties it
    (`Family.ties_output`). Either way a lm_head.weight that differs from the embedding carries
    information the GGUF would lose: transformers 5 computes with a present, different lm_head even
    when the config says tied (transformers 4 overwrote it), so such a checkpoint is refused."""
    head = ckpt.tensors.get(_LM_HEAD)
    tied = bool(cfg.get("tie_word_embeddings", False))
    if head is None or not (tied or family.ties_output):
        return False
    embed = (ckpt.tensors.get(_EMBED) or ckpt.tensors.get("language_model." + _EMBED)
             or ckpt.tensors.get("model.language_model.embed_tokens.weight"))  # Qwen3.5's multimodal wrapper
    if embed is None or head.equals(embed):
        return True  # (without an embedding, plan_tensors refuses the checkpoint)
    if family.ties_output:
        raise ConversionError(f"{ckpt.folder}: {_LM_HEAD} differs from the token embedding, but llama.cpp's "
                              f"{family.arch_name} always computes the output with the embedding; the converted "
                              "model would compute differently")
    raise ConversionError(f"{ckpt.folder}: config.json ties the output to the token embedding but {_LM_HEAD} "
                          "differs from it (transformers 5 computes with it, 4 did not); set tie_word_embeddings "
                          f"to false in config.json to keep {_LM_HEAD}, or delete it to use the embedding")


@dataclass(frozen=True)
class Piece:
    """One output tensor made from a whole HF tensor: a name for TensorNameMap, its numpy shape, and
    the function from the source's float32 array to it."""

    name: str
    shape: tuple[int, ...]
    fn: Callable[[np.ndarray], np.ndarray]


def rewriter(transform: "Callable[[str, tuple[int, ...], dict], list[Piece] | None]"):
    """A `Family.rewrite` from a transform that sees only a tensor's name and shape (the hybrids'
    reshapes and splits): each Piece is made from the whole source tensor when it is written."""
    def rewrite(name: str, ref: "TensorRef", cfg: dict) -> "list[Rewritten] | None":
        pieces = transform(name, tuple(ref.shape), cfg)
        if pieces is None:
            return None
        return [(pc.name, pc.shape, (lambda f: lambda: f(ref.load_f32()))(pc.fn)) for pc in pieces]
    return rewrite


@dataclass
class TensorPlan:
    """One output tensor: GGUF name, numpy shape, output type, and its float32 data as blocks of
    whole rows in C order (a generator, so only one block is in memory)."""

    name: str
    shape: tuple[int, ...]
    type: gguf.GGMLQuantizationType
    blocks: Callable[[], Iterable[np.ndarray]]
    raw: bool = False  # blocks are already `type`'s bytes in ggml's layout (MXFP4 experts), written as they are
