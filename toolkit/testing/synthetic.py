"""GGUF files with real model geometries and no real weights, for proving the planner.

`write_synthetic_gguf()` writes a complete header (architecture keys, a dummy vocabulary, every
tensor's name, shape and type) and leaves the data region as a sparse hole of the right size, so an
8B-shaped Q4_K_M file takes a few MB of disk and loads into the real llama.cpp like the real thing.
Type mixes follow llama.cpp's Q4_K_M recipe (llama_tensor_get_type in src/llama-quant.cpp).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
from gguf.constants import GGMLQuantizationType as T

from ..gguf.writer import write_sparse_gguf


@dataclass(frozen=True)
class Geometry:
    name: str
    arch: str  # GGUF architecture
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    qkv_bias: bool = False
    fused_qkv: bool = False  # phi3: attn_qkv and a fused gate+up ffn_up
    tied: bool = False
    n_swa: int = 0  # gemma2/3 sliding window
    n_expert: int = 0  # mixture of experts (qwen3moe): experts per layer, used per token, their width
    n_expert_used: int = 0
    n_ff_exp: int = 0

    def scaled(self, **kw) -> "Geometry":
        return replace(self, **kw)


# Shapes from the models' Hugging Face config.json files.
GEOMETRIES = {
    "llama3-8b": Geometry("Llama-3-8B", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "qwen2.5-7b": Geometry("Qwen2.5-7B", "qwen2", 28, 3584, 28, 4, 128, 18944, 152064, 32768, qkv_bias=True),
    "gemma2-9b": Geometry("Gemma-2-9B", "gemma2", 42, 3584, 16, 8, 256, 14336, 256000, 8192, tied=True,
                          n_swa=4096),
    "mistral-nemo-12b": Geometry("Mistral-Nemo-12B", "llama", 40, 5120, 32, 8, 128, 14336, 131072, 131072),
    "phi3-mini": Geometry("Phi-3-mini-4k", "phi3", 32, 3072, 32, 32, 96, 8192, 32064, 4096, fused_qkv=True),
    "llama3-70b": Geometry("Llama-3-70B", "llama", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
    # Qwen3-30B-A3B (config.json: hidden 2048, 48 layers, 32/4 heads of 128, 128 experts of 768, 8 used)
    "qwen3-30b-a3b": Geometry("Qwen3-30B-A3B", "qwen3moe", 48, 2048, 32, 4, 128, 6144, 151936, 40960,
                              n_expert=128, n_expert_used=8, n_ff_exp=768),
    # Qwen3-235B-A22B (hidden 4096, 94 layers, 64/4 heads of 128, 128 experts of 1536, 8 used)
    "qwen3-235b-a22b": Geometry("Qwen3-235B-A22B", "qwen3moe", 94, 4096, 64, 4, 128, 12288, 151936, 40960,
                                n_expert=128, n_expert_used=8, n_ff_exp=1536),
    # A small model for fast tests: same structure, tiny sizes (rows stay multiples of 256).
    "tiny": Geometry("tiny", "llama", 4, 256, 4, 2, 64, 512, 1024, 4096),
}


def _q4_k_m(name: str, il: int, n_layer: int, ne0: int) -> T:
    """The type llama.cpp's Q4_K_M recipe gives a tensor (simplified to the tensors these models have)."""
    if name.endswith("norm.weight") or name.endswith(".bias") or name.startswith("rope_"):
        return T.F32
    if name == "ffn_gate_inp.weight":  # the router stays F32 (llama_tensor_get_type: ffn_gate_inp is not quantized)
        return T.F32
    if name == "output.weight":
        t = T.Q6_K
    elif name in ("attn_v.weight", "ffn_down.weight", "attn_qkv.weight", "ffn_down_exps.weight"):
        # use_more_bits(i, n): i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2
        more = il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2
        t = T.Q6_K if more and name != "attn_qkv.weight" else (T.Q5_K if name == "attn_qkv.weight" else T.Q4_K)
    else:
        t = T.Q4_K
    if ne0 % 256:  # k-quant fallbacks for rows that are not a multiple of QK_K
        t = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}[t]
    return t


def tensor_specs(g: Geometry, mix: str = "Q4_K_M") -> list[tuple[str, tuple[int, ...], T]]:
    """(name, ggml shape, type) for every tensor of the model."""
    def typ(name, il, ne0):
        if name.endswith("norm.weight") or name.endswith(".bias"):
            return T.F32 if mix in ("F16", "Q8_0", "Q4_0") else _q4_k_m(name, il, g.n_layer, ne0)
        if mix in ("F16", "Q8_0"):
            return T[mix]
        if mix == "Q4_0":  # llama_tensor_get_type: the output head of a Q4_0 file is Q6_K
            return T.Q6_K if name == "output.weight" and ne0 % 256 == 0 else T.Q4_0
        return _q4_k_m(name, il, g.n_layer, ne0)

    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    out = [("token_embd.weight", (g.n_embd, g.n_vocab), typ("token_embd.weight", -1, g.n_embd))]
    for il in range(g.n_layer):
        layer = [("attn_norm.weight", (g.n_embd,))]
        if g.fused_qkv:
            layer += [("attn_qkv.weight", (g.n_embd, q + 2 * kv))]
        else:
            layer += [("attn_q.weight", (g.n_embd, q)), ("attn_k.weight", (g.n_embd, kv)),
                      ("attn_v.weight", (g.n_embd, kv))]
            if g.qkv_bias:
                layer += [("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))]
        layer += [("attn_output.weight", (q, g.n_embd)), ("ffn_norm.weight", (g.n_embd,))]
        if g.n_expert:  # qwen3moe: q/k norms, the router and the stacked experts (no dense FFN)
            e, f = g.n_expert, g.n_ff_exp
            layer += [("attn_q_norm.weight", (g.head_dim,)), ("attn_k_norm.weight", (g.head_dim,)),
                      ("ffn_gate_inp.weight", (g.n_embd, e)), ("ffn_gate_exps.weight", (g.n_embd, f, e)),
                      ("ffn_up_exps.weight", (g.n_embd, f, e)), ("ffn_down_exps.weight", (f, g.n_embd, e))]
            out += [(f"blk.{il}.{n}", s, typ(n, il, s[0])) for n, s in layer]
            continue
        if g.arch == "gemma2":
            layer += [("post_attention_norm.weight", (g.n_embd,)), ("post_ffw_norm.weight", (g.n_embd,))]
        if g.fused_qkv:
            layer += [("ffn_up.weight", (g.n_embd, 2 * g.n_ff))]
        else:
            layer += [("ffn_gate.weight", (g.n_embd, g.n_ff)), ("ffn_up.weight", (g.n_embd, g.n_ff))]
        layer += [("ffn_down.weight", (g.n_ff, g.n_embd))]
        out += [(f"blk.{il}.{n}", s, typ(n, il, s[0])) for n, s in layer]
    out.append(("output_norm.weight", (g.n_embd,), T.F32))
    if not g.tied:
        out.append(("output.weight", (g.n_embd, g.n_vocab), typ("output.weight", -1, g.n_embd)))
    return out


def model_keys(w: gguf.GGUFWriter, g, name: str, file_type: int, rms_eps: float) -> None:
    """The keys every test model has, from a geometry with n_ctx_train, n_embd, n_layer, n_head, head_dim and
    n_vocab (`Geometry`, `hybrid.HybridGeometry`)."""
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_context_length(g.n_ctx_train)
    w.add_embedding_length(g.n_embd)
    w.add_block_count(g.n_layer)
    w.add_head_count(g.n_head)
    w.add_key_length(g.head_dim)
    w.add_value_length(g.head_dim)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(g.n_vocab)


def write_synthetic_gguf(path: str | os.PathLike, g: Geometry, mix: str = "Q4_K_M") -> Path:
    """Write a loadable GGUF of geometry g whose data region is a sparse hole."""

    def metadata(w: gguf.GGUFWriter) -> None:
        # LLAMA_FTYPE_MOSTLY_Q4_K_M / F16 / Q8_0 / Q4_0
        model_keys(w, g, g.name, {"Q4_K_M": 15, "F16": 1, "Q8_0": 7, "Q4_0": 2}[mix], 1e-5)
        w.add_feed_forward_length(g.n_ff)
        w.add_head_count_kv(g.n_head_kv)
        w.add_rope_dimension_count(g.head_dim)
        if g.n_swa:
            w.add_sliding_window(g.n_swa)
        if g.n_expert:
            w.add_expert_count(g.n_expert)
            w.add_expert_used_count(g.n_expert_used)
            w.add_expert_feed_forward_length(g.n_ff_exp)
        w.add_tokenizer_model("none")  # llama.cpp adds vocab_size dummy tokens (llama_vocab::load)

    return write_sparse_gguf(path, g.arch, tensor_specs(g, mix), metadata)


_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def write_sparse_hf_checkpoint(dest: str | os.PathLike, g: Geometry, tokenizer_from: str | os.PathLike) -> Path:
    """A Hugging Face folder (config.json, tokenizer files, one bf16 model.safetensors whose data is a
    sparse hole) with geometry g: enough for `ctxq plan HF_FOLDER`, which reads headers only."""
    if g.arch not in _HF_ARCH:
        raise ValueError(f"no Hugging Face config for {g.arch}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [_HF_ARCH[g.arch]], "model_type": g.arch, "hidden_size": g.n_embd,
           "num_hidden_layers": g.n_layer, "num_attention_heads": g.n_head, "num_key_value_heads": g.n_head_kv,
           "head_dim": g.head_dim, "intermediate_size": g.n_ff, "vocab_size": g.n_vocab,
           "max_position_embeddings": g.n_ctx_train, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": g.tied, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    write_hf_config(dest, cfg, tokenizer_from)
    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    shapes = {"model.embed_tokens.weight": (g.n_vocab, g.n_embd), "model.norm.weight": (g.n_embd,)}
    if not g.tied:
        shapes["lm_head.weight"] = (g.n_vocab, g.n_embd)
    for il in range(g.n_layer):
        p = f"model.layers.{il}."
        shapes.update({p + "input_layernorm.weight": (g.n_embd,), p + "post_attention_layernorm.weight": (g.n_embd,),
                       p + "self_attn.q_proj.weight": (q, g.n_embd), p + "self_attn.k_proj.weight": (kv, g.n_embd),
                       p + "self_attn.v_proj.weight": (kv, g.n_embd), p + "self_attn.o_proj.weight": (g.n_embd, q),
                       p + "mlp.gate_proj.weight": (g.n_ff, g.n_embd), p + "mlp.up_proj.weight": (g.n_ff, g.n_embd),
                       p + "mlp.down_proj.weight": (g.n_embd, g.n_ff)})
        if g.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    write_sparse_safetensors(dest / "model.safetensors", shapes)
    return dest


def write_hf_config(dest: Path, cfg: dict, tokenizer_from: str | os.PathLike) -> None:
    """config.json and the tokenizer files of `tokenizer_from` (those it has) in the folder `dest`."""
    import shutil

    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = Path(tokenizer_from) / name
        if src.is_file():
            shutil.copy(src, dest / name)


def write_sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A BF16 safetensors file with these tensors' header and their data left as a sparse hole."""
    header, off = {}, 0
    for name, shape in shapes.items():
        n = 2  # bf16
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + off)  # the weights: a sparse hole
