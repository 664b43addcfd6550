"""A small mixture-of-experts model made in code: a Qwen3-MoE (`qwen3moe`) GGUF with random weights.

The file has the keys and tensors llama.cpp's converter writes for Qwen3MoeForCausalLM
(`Qwen2MoeModel`/`Qwen3MoeModel`): per layer the attention with its q/k norms, the router
`ffn_gate_inp` (kept F32, as the converter keeps it), and the stacked experts `ffn_{gate,up,down}_exps`
of GGML shape {n_embd, n_ff_exp, n_expert} / {n_ff_exp, n_embd, n_expert}. Its tokenizer is SmolLM2's
(copied from the default model), so prompts are real text; the outputs mean nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .models import _write_atomic

ARCH = "qwen3moe"


def tiny_moe_gguf(dest: str | os.PathLike, *, std: float = 0.1, n_layer: int = 4, n_embd: int = 128, n_head: int = 4,
                  n_head_kv: int = 2, head_dim: int = 32, n_expert: int = 8, n_expert_used: int = 2,
                  n_ff_exp: int = 128, n_ctx_train: int = 32768, seed: int = 0,
                  missing: str | None = None) -> Path:
    """A random-weight qwen3moe GGUF at `dest` (F16 matrices, F32 norms and router); reused when it
    exists. `missing`: a tensor name to leave out (a broken file for error tests)."""
    import gguf

    from ..gguf.reader import read_gguf
    from ..models import fetch_default_model

    dest = Path(dest)
    if dest.is_file():
        return dest
    src = read_gguf(fetch_default_model())  # ctxq's reader: a third of a second, gguf's GGUFReader about five
    n_vocab = len(src.metadata["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)

    def mat(*shape: int, dtype=np.float16) -> np.ndarray:
        # std 0.1: with 0.02 (Qwen3-MoE's initializer_range) greedy decoding soon repeats one token
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def write(part: Path) -> None:
        w = gguf.GGUFWriter(str(part), ARCH)
        w.add_name("tiny-qwen3moe")
        w.add_block_count(n_layer)
        w.add_context_length(n_ctx_train)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff_exp * n_expert_used)  # the dense intermediate_size key; unused by the graph
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(1_000_000.0)  # Qwen3's rope_theta
        w.add_layer_norm_rms_eps(1e-6)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_file_type(1)  # MOSTLY_F16
        w.add_vocab_size(n_vocab)
        for key, value in src.metadata.items():
            if key.startswith("tokenizer."):
                vtype, sub = src.value_types[key]
                w.add_key_value(key, value, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
        tensors = {"token_embd.weight": mat(n_vocab, n_embd)}  # numpy order: GGML's ne reversed
        for il in range(n_layer):
            p = f"blk.{il}."
            tensors.update({
                p + "attn_norm.weight": ones(n_embd),
                p + "attn_q.weight": mat(n_head * head_dim, n_embd),
                p + "attn_k.weight": mat(n_head_kv * head_dim, n_embd),
                p + "attn_v.weight": mat(n_head_kv * head_dim, n_embd),
                p + "attn_output.weight": mat(n_embd, n_head * head_dim),
                p + "attn_q_norm.weight": ones(head_dim),
                p + "attn_k_norm.weight": ones(head_dim),
                p + "ffn_norm.weight": ones(n_embd),
                p + "ffn_gate_inp.weight": mat(n_expert, n_embd, dtype=np.float32),
                p + "ffn_gate_exps.weight": mat(n_expert, n_ff_exp, n_embd),
                p + "ffn_up_exps.weight": mat(n_expert, n_ff_exp, n_embd),
                p + "ffn_down_exps.weight": mat(n_expert, n_embd, n_ff_exp),
            })
        tensors["output_norm.weight"] = ones(n_embd)
        tensors["output.weight"] = mat(n_vocab, n_embd)
        for name, data in tensors.items():
            if name != missing:
                w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _write_atomic(write, dest)


def expert_bytes(path: str | os.PathLike, layers: list[int] | None = None) -> int:
    """Bytes of the expert tensors (llama.cpp's expert regex) of `layers` (default: all) in a GGUF."""
    from ..gguf.reader import read_gguf
    from ..llama.overrides import expert_layers

    g = read_gguf(path, skip_arrays=True)
    total = 0
    for t in g.tensors:
        found = expert_layers([t.name])
        if found and (layers is None or found[0] in layers):
            total += t.nbytes
    return total
