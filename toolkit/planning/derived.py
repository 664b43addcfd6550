"""Derived models: GGUF headers that llama.cpp loads without weights (the data region a sparse hole), for its
dry runs (`compute.py`) and its accounting (`facts.py`): the source's architecture keys with only some layers
(renumbered, per-layer arrays cut to them), optionally a small vocabulary, and explicit per-layer flags.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CtxqError
from ..gguf.info import block_of
from ..gguf.reader import GGUFFile
from ..paths import ctxq_home

# Arrays of a fixed length that a model with that many layers must not have cut to the kept layers
# (rope.dimension_sections: always 4, get_key_or_arr(..., 4, true) in llama_model_qwen35::load_arch_hparams).
_FIXED_ARRAYS = (".rope.dimension_sections",)
_SMALL_VOCAB = 256  # small enough that the output head is never a device's peak
# tensors outside the blocks with one slice per layer along a dim (llama-arch.cpp: the per-layer inputs)
_PER_LAYER_DIM = {"per_layer_token_embd.weight": 0, "per_layer_model_proj.weight": 1}
# Keys a loader requires only for some layer counts, written into a derived model as the value the source's
# layer count implies: llama_model_deepseek2::load_arch_hparams reads q_lora_rank unless n_layer is 26 or 27
# ("lite" variants, whose query has no LoRA: the tensors follow q_lora_rank > 0, so 0 keeps them as they are).
_LAYER_COUNT_KEYS = {"deepseek2": {"attention.q_lora_rank": (0, "UINT32")}}
# Tensors outside the blocks that llama.cpp creates only while loading a full-attention layer, so that a derived
# model whose kept layers all slide must not have them (it refuses one: "wrong number of tensors"):
# llama_model_gemma4::load_arch_tensors creates rope_freqs for !is_swa(i) layers only.
_FULL_LAYER_TENSORS = {"gemma4": ("rope_freqs.weight",)}
# Architectures whose derived models need two layers: llama_model::create_memory's KV-reuse callback for Gemma 3n
# and Gemma 4 asserts n_layer_kv_from_start >= 2 (an abort, not an error: one layer must never be written for them).
MIN_LAYERS = {"gemma3n": 2, "gemma4": 2}



@dataclass(frozen=True)
class LayerFlags:
    """Per kept layer: sliding window, recurrent (None: leave the source's keys)."""

    swa: tuple[bool, ...] | None = None
    recurrent: tuple[bool, ...] | None = None


def _derived_path(src: GGUFFile, layers: tuple[int, ...], small_vocab: bool, swa) -> Path:
    st = os.stat(src.path)
    key = hashlib.sha256(f"{src.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{layers}|{small_vocab}|{swa}|v5"
                         .encode()).hexdigest()[:20]
    d = ctxq_home() / "derived"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{key}.gguf"


def write_derived(src: GGUFFile, layers: tuple[int, ...], small_vocab: bool,
                  flags: LayerFlags | None = None) -> Path:
    """A GGUF with src's architecture keys and only the given layers (renumbered 0..), weights a hole.

    `flags` gives the kept layers' sliding-window flags, written as the explicit per-layer pattern
    array that llama_model_base::load_swa_pattern reads before any per-architecture default, and their
    recurrent flags as `attention.recurrent_layers`, read before full_attention_interval
    (llama_model_qwen35::load_arch_hparams).
    """
    flags = flags or LayerFlags()
    out = _derived_path(src, layers, small_vocab, flags)
    if out.exists():
        return out
    n_vocab, src_layers = _SMALL_VOCAB if small_vocab else _vocab_size(src), int(src.arch_get("block_count"))
    remap = {il: i for i, il in enumerate(layers)}
    specs = []
    unused = _FULL_LAYER_TENSORS.get(src.arch, ()) if flags.swa is not None and all(flags.swa) else ()
    for t in src.tensors:
        name, shape = t.name, t.shape
        if name in unused:
            continue
        il = block_of(name)
        if il is not None:
            if il not in remap:
                continue
            name = f"blk.{remap[il]}." + name.split(".", 2)[2]
        if small_vocab and name in ("token_embd.weight", "output.weight", "per_layer_token_embd.weight"):
            shape = (shape[0], n_vocab)
        if name in _PER_LAYER_DIM:  # one slice per layer along this dim: the kept layers' (Gemma 3n, Gemma 4 E)
            d = _PER_LAYER_DIM[name]
            shape = tuple(n * len(layers) // src_layers if i == d else n for i, n in enumerate(shape))
        specs.append((name, shape, t.type))
    write_sparse(src, out, specs, layers=layers, n_vocab=n_vocab, flags=flags)
    return out


def model_path(src: GGUFFile) -> str:
    """A local file llama.cpp can load the header of: the model itself, or for a Hub model whose header
    alone was fetched, a header-only copy with its data region a sparse hole (write_sparse)."""
    need = src.data_offset + sum(t.nbytes for t in src.tensors)
    if src.path.stat().st_size >= need:
        return str(src.path)
    return str(sparse_copy(src))


def load_error(src: GGUFFile, e: CtxqError) -> CtxqError:
    """A failed llama.cpp load as one line naming the architecture and llama.cpp's reason (`e` itself when
    the model loaded and the context's settings were refused)."""
    if not hasattr(e, "reason"):
        return e
    return CtxqError(f"llama.cpp cannot load this {src.arch} model ({src.path.name}): {e.reason}")


def sparse_copy(src: GGUFFile) -> Path:
    """A header-only copy of src with every tensor (a Hub model's header, to ask llama.cpp about)."""
    out = _derived_path(src, ("all",), False, None)
    if not out.exists():
        write_sparse(src, out, [(t.name, t.shape, t.type) for t in src.tensors])
    return out


def write_sparse(src: GGUFFile, out: Path, specs: list[tuple[str, tuple, int]], *,
                 layers: tuple[int, ...] | None = None, n_vocab: int | None = None,
                 flags: LayerFlags | None = None) -> Path:
    """src's architecture keys and the tensors `specs` (name, ggml shape, ggml type) as a loadable
    header-only GGUF at `out`; `layers` keeps those layers' entries of per-layer arrays."""
    import gguf  # here: a plan whose derived models exist needs neither gguf's nor numpy's import (0.16 s)
    from ..gguf.writer import write_sparse_gguf
    arch = src.arch
    n_layer = int(src.arch_get("block_count"))
    n_vocab = n_vocab or _vocab_size(src)
    swa, recr = (flags.swa, flags.recurrent) if flags else (None, None)

    def metadata(w: gguf.GGUFWriter) -> None:
        for key, value in src.metadata.items():
            if key.startswith("tokenizer.") or key in ("general.architecture", "general.alignment"):
                continue
            if swa is not None and key == f"{arch}.attention.sliding_window_pattern":
                continue
            if recr is not None and key == f"{arch}.attention.recurrent_layers":
                continue
            vtype, etype = src.value_types[key]
            if layers is not None and isinstance(value, list) and len(value) == n_layer \
                    and not key.endswith(_FIXED_ARRAYS):
                value = [value[i] for i in layers]  # per-layer arrays (head counts, SWA pattern)
            if key == f"{arch}.block_count" and layers is not None:
                value = len(layers)
            if key == f"{arch}.leading_dense_block_count" and layers is not None and isinstance(value, int):
                value = sum(1 for i in layers if i < value)  # the kept dense layers stay the leading ones
            if key == f"{arch}.nextn_predict_layers" and layers is not None:
                value = 0  # derived models keep no NextN block (compute_peaks leaves them out)
            if key == f"{arch}.vocab_size":
                value = n_vocab
            w.add_key_value(key, value, gguf.GGUFValueType(vtype),
                            sub_type=gguf.GGUFValueType(etype) if etype is not None else None)
        if swa is not None:
            w.add_key_value(f"{arch}.attention.sliding_window_pattern", list(swa), gguf.GGUFValueType.ARRAY,
                            sub_type=gguf.GGUFValueType.BOOL)
        if recr is not None:
            w.add_key_value(f"{arch}.attention.recurrent_layers", list(recr), gguf.GGUFValueType.ARRAY,
                            sub_type=gguf.GGUFValueType.BOOL)
        if f"{arch}.vocab_size" not in src.metadata:
            w.add_vocab_size(n_vocab)
        for key, (value, vtype) in _LAYER_COUNT_KEYS.get(arch, {}).items():
            if f"{arch}.{key}" not in src.metadata:
                w.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType[vtype])
        w.add_tokenizer_model("none")  # llama.cpp then adds vocab_size dummy tokens (llama_vocab::load)

    return write_sparse_gguf(out, arch, specs, metadata)


def _vocab_size(g: GGUFFile) -> int:
    toks = g.get("tokenizer.ggml.tokens")
    if toks is not None:
        return int(toks) if isinstance(toks, int) else len(toks)
    t = g.tensor("token_embd.weight")
    return t.shape[1]
