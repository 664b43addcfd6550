"""Derived models: GGUF headers that llama.cpp loads without weights (the data region a sparse hole), for its
dry runs (`compute.py`) and its accounting (`facts.py`): the source's architecture keys with only some layers
(renumbered, per-layer arrays cut to them), optionally a small vocabulary, and explicit per-layer flags.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CtxqError, LlamaAborted
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
# Architectures whose header says how many trailing layers reuse the KV cache of earlier ones: llama_model_gemma4::
# load_arch_hparams sets n_layer_kv_from_start = n_layer - attention.shared_kv_layers, and the KV-reuse callback of
# llama_model::create_memory gives a shared layer layer n_layer_kv_from_start - 2 (sliding) or - 1 (full). A derived
# model writes the count of the shared layers it keeps, which must come last and find those two there (kv_reuse_ok).
# Gemma 3n's first shared layer is fixed at 20 in gemma3n.cpp, not read from the header: its derived models (under
# 20 layers) give each kept layer a cache of its own.
SHARED_KV_KEY = {"gemma4": "attention.shared_kv_layers"}



@dataclass(frozen=True)
class LayerFlags:
    """Per kept layer: sliding window, recurrent (None: leave the source's keys)."""

    swa: tuple[bool, ...] | None = None
    recurrent: tuple[bool, ...] | None = None


def first_shared(src: GGUFFile) -> int | None:
    """The first layer that reuses another's KV cache (SHARED_KV_KEY), None where none does."""
    key = SHARED_KV_KEY.get(src.arch)
    n = int(src.arch_get(key) or 0) if key else 0
    return int(src.arch_get("block_count")) - n if n else None


def kv_reuse_ok(layers: tuple[int, ...], sliding: list[bool], first: int | None) -> bool:
    """A derived model of these source layers (in this order; `sliding`: each kept layer's flag) passes llama.cpp's
    KV-reuse callback: at least 2 layers with a cache of their own (GGML_ASSERT(n_layer_kv_from_start >= 2)), the
    shared ones after them, each finding a cache of its kind where llama.cpp looks (llama-kv-cache.cpp asserts it)."""
    if first is None:
        return True
    k = sum(1 for il in layers if il < first)
    return k >= 2 and all(il >= first for il in layers[k:]) and all(
        sliding[k - 2] if sliding[j] else not sliding[k - 1] for j in range(k, len(layers)))


def with_reuse_targets(layers: tuple[int, ...], sliding: list[bool], first: int | None) -> tuple[int, ...]:
    """Sorted `layers` with the layers their KV-shared ones need (kv_reuse_ok; `sliding`: the source's flags): the
    source's own targets (its last sliding and full layers with a cache) where a shared full layer is kept, else
    the first sliding layers with a cache, so that a model of sliding layers stays one."""
    layers = tuple(sorted(layers))
    if first is None or kv_reuse_ok(layers, [sliding[il] for il in layers], first):
        return layers
    kept = set(layers)
    shared = [il for il in layers if il >= first]
    if any(not sliding[il] for il in shared):
        kept |= {first - 2, first - 1}
    else:
        for il in (il for il in range(first) if sliding[il] and il not in kept):
            if sum(1 for j in kept if j < first) >= 2:
                break
            kept.add(il)
    return tuple(sorted(kept))


def _derived_path(src: GGUFFile, layers: tuple[int, ...], small_vocab: bool, swa) -> Path:
    st = os.stat(src.path)
    key = hashlib.sha256(f"{src.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{layers}|{small_vocab}|{swa}|v6"
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
    first = first_shared(src)
    if first is not None:  # never hand llama.cpp a header that trips its KV-reuse asserts (an abort, not an error)
        pattern = src.arch_get("attention.sliding_window_pattern")
        sliding = list(flags.swa) if flags.swa is not None else [bool(pattern[il]) for il in layers] \
            if isinstance(pattern, list) else [False] * len(layers)
        if not kv_reuse_ok(layers, sliding, first):
            raise CtxqError(f"a derived model of {src.arch} layers {list(layers)} cannot keep its KV sharing "
                            f"(layers {first}+ reuse the caches of layers {first - 2} and {first - 1})")
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
    the model loaded and the context's settings were refused); an abort stays a LlamaAborted."""
    if isinstance(e, LlamaAborted):
        return LlamaAborted(f"llama.cpp aborted on this {src.arch} model ({src.path.name}): {e.reason}",
                            reason=e.reason, path=str(src.path))
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
            if key == f"{arch}.{SHARED_KV_KEY.get(arch)}" and layers is not None:
                value = sum(1 for il in layers if il >= n_layer - value)  # the kept shared layers (kv_reuse_ok)
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
