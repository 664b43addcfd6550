"""A model's work per layer for the speed estimate (planning/speed/model.py): parameters (FLOPs) and bytes read by
part, attention FLOPs and KV bytes per cached token, windows; read from the GGUF header alone."""

from __future__ import annotations

from dataclasses import dataclass

from ...gguf.info import ModelInfo, block_of, is_expert, kv_bytes
from ...gguf.reader import GGUFFile, read_gguf


@dataclass(frozen=True)
class LayerShape:
    """One layer's work: parameters (FLOPs = 2 x parameters x tokens) and bytes read, by part."""

    mixer_params: int = 0  # attention or recurrent-mixer weights every token multiplies
    mixer_bytes: int = 0
    ffn_params: int = 0  # dense FFN, router, shared experts
    ffn_bytes: int = 0
    expert_params: int = 0  # every routed expert together
    expert_bytes: int = 0
    attn_flops_per_key: int = 0  # QK^T and PV per query and visible key: 2 n_head (head_dim_k + head_dim_v)
    kv_bytes_per_key: int = 0  # K and V bytes of one cached token
    window: int = 0  # sliding window in tokens; 0: every earlier token
    state_bytes: int = 0  # recurrent state, read and written once per micro-batch


@dataclass(frozen=True)
class ModelShape:
    n_embd: int
    layers: tuple[LayerShape, ...]
    used_fraction: float = 1.0  # n_expert_used / n_expert: the share of the experts one token runs
    output_params: int = 0  # the output head (the last token of each n_batch in prefill, every decoded token)
    output_bytes: int = 0


def model_shape(info: ModelInfo, type_k: str = "f16", type_v: str = "f16", gguf: GGUFFile | None = None) -> ModelShape:
    """A model's shape from its header: parameters and bytes per part from the tensor index (`gguf`, else read
    again from info.path), heads, KV rows at type_k/type_v and windows from `info`."""
    g = gguf or read_gguf(info.path, skip_arrays=True)
    parts = [[0] * 6 for _ in range(info.n_layer)]  # params, bytes of mixer, ffn, experts
    out_params = embd = 0
    for t in g.tensors:
        il = block_of(t.name)
        if il is not None and il < info.n_layer and not info.layers[il].mtp:
            k = 2 if is_expert(t.name) else 1 if t.name.split(".")[2].startswith(("ffn_", "exp_probs")) else 0
            parts[il][2 * k] += t.n_elements
            parts[il][2 * k + 1] += t.nbytes
        elif t.name == "output.weight":
            out_params = t.n_elements
        elif t.name == "token_embd.weight":
            embd = t.n_elements
    layers = []
    for il, (la, p) in enumerate(zip(info.layers, parts)):
        attn = la.attention and not la.mtp
        layers.append(LayerShape(
            *p, attn_flops_per_key=2 * la.n_head * (info.head_dim_k + info.head_dim_v) if attn else 0,
            kv_bytes_per_key=kv_bytes(type_k, info.n_embd_k_gqa(il)) + kv_bytes(type_v, info.n_embd_v_gqa(il))
            if attn else 0, window=info.n_swa if la.sliding else 0, state_bytes=la.state_bytes))
    return ModelShape(info.n_embd, tuple(layers), info.expert_read_fraction,
                      out_params or (embd if info.output_tied else 0),
                      info.output_bytes + (info.token_embd_bytes if info.output_tied else 0))
