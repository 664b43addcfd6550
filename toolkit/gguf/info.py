"""`ctxq inspect`: what a GGUF model is, and the numbers the planner needs, from its header alone."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from gguf.constants import GGMLQuantizationType, LlamaFileType

from ..errors import GGUFError
from .reader import GGUFFile, read_gguf, tensor_nbytes
from ..units import round_up

# Sliding-window rules per architecture, as each llama_model_<arch>::load_hparams sets them
# (src/models/<arch>.cpp): (default window or None when the key must be present, pattern).
# pattern n: layer il is SWA when il % n < n - 1 (llama_hparams::set_swa_pattern).
SWA_RULES: dict[str, tuple[int | None, int]] = {
    "gemma2": (4096, 2),
    "gemma3": (None, 6),
}

# Bytes per element for the KV-cache types ctxq chooses between (ggml block sizes).
KV_TYPES = ("f16", "q8_0", "q4_0")


def kv_bytes(type_name: str, n_elements: int) -> int:
    """Bytes of one KV row of n_elements (ggml_row_size); GGUFError if the type's blocks do not divide it."""
    return tensor_nbytes(int(GGMLQuantizationType[type_name.upper()]), (n_elements,))


KV_PAD = 256  # llama_context pads the KV cache to 256 cells (llama_kv_cache::get_padding)


def kv_cells(info: ModelInfo, n_ctx: int, n_ubatch: int, il: int) -> int:
    """Cells of layer il's KV cache at n_ctx: padded to 256; sliding-window layers hold a window
    (llama_kv_cache::get_size, llama_kv_cache_iswa)."""
    size = round_up(n_ctx, KV_PAD)
    if info.swa_layers[il] and info.n_swa:
        return min(size, round_up(info.n_swa + n_ubatch, KV_PAD))
    return size


def layer_kv_bytes(info: ModelInfo, il: int, n_ctx: int, n_ubatch: int, type_k: str, type_v: str) -> int:
    """Bytes of layer il's K and V cache."""
    return kv_cells(info, n_ctx, n_ubatch, il) * (kv_bytes(type_k, info.n_embd_k_gqa(il))
                                                 + kv_bytes(type_v, info.n_embd_v_gqa(il)))


_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


@dataclass
class ModelInfo:
    """A model's geometry and weight sizes; every size is in bytes."""

    path: str
    arch: str
    name: str | None
    file_type: str | None
    n_params: int
    file_size: int
    tensor_types: dict[str, int]  # ggml type name -> tensor count
    n_layer: int
    n_ctx_train: int | None
    n_embd: int
    n_head: list[int]  # per layer
    n_head_kv: list[int]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_swa: int  # sliding window in tokens, 0 when the model has none
    swa_layers: list[bool]  # per layer
    layer_bytes: list[int]  # weights of blk.<il>.*
    token_embd_bytes: int
    output_bytes: int  # output.weight and output_norm; 0 for the tied part when tied
    output_tied: bool  # no output.weight: the output reuses token_embd (a copy on the output device)
    output_type: str | None  # ggml type of the output projection's weight (or token_embd's when tied)
    other_bytes: int  # tensors outside layers, embeddings and output (rope factors, ...)
    kv_bytes_per_token: dict[str, int] = field(default_factory=dict)  # f16 / q8_0 / q4_0, all layers

    def n_embd_k_gqa(self, il: int) -> int:
        return self.head_dim_k * self.n_head_kv[il]

    def n_embd_v_gqa(self, il: int) -> int:
        return self.head_dim_v * self.n_head_kv[il]

    def to_dict(self) -> dict:
        return asdict(self)


def _per_layer(value, n_layer: int, what: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise GGUFError(f"{what} has {len(value)} entries for {n_layer} layers")
        return [int(v) for v in value]
    if not isinstance(value, int):
        raise GGUFError(f"{what} is missing or not an integer")
    return [value] * n_layer


def model_info(source: str | os.PathLike | GGUFFile) -> ModelInfo:
    """Read a GGUF's header and tensor index (never its weights) into a `ModelInfo`."""
    g = source if isinstance(source, GGUFFile) else read_gguf(source, skip_arrays=True)
    arch = g.arch
    n_layer = g.arch_get("block_count")
    n_embd = g.arch_get("embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int) or n_layer <= 0 or n_embd <= 0:
        raise GGUFError(f"{g.path}: missing {arch}.block_count or {arch}.embedding_length")
    n_head = _per_layer(g.arch_get("attention.head_count"), n_layer, f"{arch}.attention.head_count")
    n_head_kv = _per_layer(g.arch_get("attention.head_count_kv", n_head), n_layer,
                           f"{arch}.attention.head_count_kv")
    h0 = max(n_head) or 1
    head_dim_k = int(g.arch_get("attention.key_length", n_embd // h0))
    head_dim_v = int(g.arch_get("attention.value_length", n_embd // h0))

    n_swa, swa_layers = 0, [False] * n_layer
    pattern_arr = g.arch_get("attention.sliding_window_pattern")
    window = g.arch_get("attention.sliding_window")
    if arch in SWA_RULES:
        default, pattern = SWA_RULES[arch]
        n_swa = int(window) if isinstance(window, int) else (default or 0)
        if n_swa > 0:
            if isinstance(pattern_arr, list) and len(pattern_arr) == n_layer:
                swa_layers = [bool(x) for x in pattern_arr]
            else:
                if isinstance(pattern_arr, int) and not isinstance(pattern_arr, bool):
                    pattern = int(pattern_arr)
                swa_layers = [pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer)]

    layer_bytes = [0] * n_layer
    token_embd = output = other = 0
    output_type = None
    types: Counter[str] = Counter()
    n_params = 0
    for t in g.tensors:
        types[t.type_name] += 1
        n_params += t.n_elements
        m = _LAYER_RE.match(t.name)
        if m and int(m.group(1)) < n_layer:
            layer_bytes[int(m.group(1))] += t.nbytes
        elif t.name == "token_embd.weight":
            token_embd += t.nbytes
        elif t.name.startswith("output"):
            output += t.nbytes
            if t.name == "output.weight":
                output_type = t.type_name
        else:
            other += t.nbytes
    tied = g.tensor("output.weight") is None
    if tied and g.tensor("token_embd.weight") is not None:
        output_type = g.tensor("token_embd.weight").type_name

    n_vocab = g.get("tokenizer.ggml.tokens")
    if n_vocab is None:
        embd = g.tensor("token_embd.weight")
        n_vocab = embd.shape[1] if embd else 0
    ftype = g.get("general.file_type")
    try:
        file_type = LlamaFileType(ftype).name.removeprefix("MOSTLY_") if isinstance(ftype, int) else None
    except ValueError:
        file_type = f"FTYPE_{ftype}"

    info = ModelInfo(
        path=str(g.path), arch=arch, name=g.get("general.name"), file_type=file_type,
        n_params=n_params, file_size=g.file_size, tensor_types=dict(sorted(types.items())),
        n_layer=n_layer, n_ctx_train=g.arch_get("context_length"), n_embd=n_embd,
        n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim_k, head_dim_v=head_dim_v,
        n_vocab=int(n_vocab), n_swa=n_swa, swa_layers=swa_layers, layer_bytes=layer_bytes,
        token_embd_bytes=token_embd, output_bytes=output, output_tied=tied, output_type=output_type,
        other_bytes=other,
    )
    for kv in KV_TYPES:
        try:
            info.kv_bytes_per_token[kv] = sum(
                kv_bytes(kv, info.n_embd_k_gqa(il)) + kv_bytes(kv, info.n_embd_v_gqa(il)) for il in range(n_layer))
        except GGUFError:
            pass  # rows not a multiple of the type's block: llama.cpp cannot use that KV type
    return info
