"""A random-weight Qwen3.5-shaped chat model: hybrid recurrent layers behind SmolLM2's real tokenizer.

For the session test of issue 22 (llama.cpp saves a hybrid's recurrent state with the sequence): greedy
tokens must compare exactly, so the weights are random (not a sparse hole of zeros) and text tokenizes.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from .hybrid import HybridGeometry, qwen35_metadata, qwen35_tensors
from .models import _write_atomic

CHAT_GEOMETRY = HybridGeometry(n_layer=4, n_embd=64, n_ff=128, n_head=2, n_head_kv=1, head_dim=32, n_vocab=0,
                               ssm_d_state=16, ssm_n_group=1, ssm_dt_rank=2, full_attention_interval=4)


def tiny_chat_qwen35_gguf(dest: str | os.PathLike, seed: int = 0) -> Path:
    """Layers 0-2 gated delta nets, layer 3 attention; every `tokenizer.*` key of the default model (SmolLM2)
    copied; weights N(0, 0.02), norms ones, ssm_a negative (a decay). Reuses `dest` when it exists."""
    from ..models import fetch_default_model

    dest = Path(dest)
    if dest.is_file():
        return dest
    src = gguf.GGUFReader(str(fetch_default_model()))
    g = HybridGeometry(**{**CHAT_GEOMETRY.__dict__, "n_vocab": len(src.fields["tokenizer.ggml.tokens"].data)})
    rng = np.random.default_rng(seed)

    def data(name: str, shape: tuple[int, ...]) -> np.ndarray:
        np_shape = tuple(reversed(shape))  # ggml's ne0 is numpy's last axis
        if name.endswith("norm.weight"):
            return np.ones(np_shape, dtype=np.float32)
        if name.endswith("ssm_a"):
            return -np.abs(rng.standard_normal(np_shape, dtype=np.float32)) - 0.5
        return rng.standard_normal(np_shape, dtype=np.float32) * 0.02

    def write(part: Path) -> None:
        w = gguf.GGUFWriter(str(part), "qwen35")
        qwen35_metadata(w, g, name="tiny-chat-qwen35")
        w.add_file_type(0)  # ALL_F32
        for key, field in src.fields.items():
            if key.startswith("tokenizer."):
                vtype = gguf.GGUFValueType(field.types[0])
                sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), vtype, sub)
        for name, shape, _ in qwen35_tensors(g):
            w.add_tensor(name, data(name, shape))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _write_atomic(write, dest)
