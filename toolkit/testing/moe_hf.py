"""Header-only mixture-of-experts Hugging Face checkpoints at real geometry, for `ctxq plan HF_FOLDER`.

Like `ctxq.testing.synthetic.write_sparse_hf_checkpoint` for dense models: config.json, the tokenizer
files of another model, and one bf16 model.safetensors whose data is a sparse hole, with the
per-expert tensor names `save_pretrained` writes. Planning reads headers only, so a 61 GB checkpoint
costs a few MB of disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .synthetic import write_hf_config, write_sparse_safetensors


@dataclass(frozen=True)
class MoEGeometry:
    name: str
    hf_arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    n_vocab: int
    n_ctx_train: int


# Qwen/Qwen3-30B-A3B's config.json (48 layers, 128 experts of width 768, 8 used: issue 21's shape)
MOE_GEOMETRIES = {
    "qwen3-30b-a3b": MoEGeometry("Qwen3-30B-A3B", "Qwen3MoeForCausalLM", 48, 2048, 32, 4, 128, 768, 128, 8,
                                 151936, 40960),
}


def write_sparse_moe_checkpoint(dest: str | os.PathLike, g: MoEGeometry, tokenizer_from: str | os.PathLike) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [g.hf_arch], "model_type": "qwen3_moe", "hidden_size": g.n_embd,
           "num_hidden_layers": g.n_layer, "num_attention_heads": g.n_head, "num_key_value_heads": g.n_head_kv,
           "head_dim": g.head_dim, "intermediate_size": 6144, "moe_intermediate_size": g.n_ff_exp,
           "num_experts": g.n_expert, "num_experts_per_tok": g.n_expert_used, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": g.n_vocab,
           "max_position_embeddings": g.n_ctx_train, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    write_hf_config(dest, cfg, tokenizer_from)
    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    shapes = {"model.embed_tokens.weight": (g.n_vocab, g.n_embd), "model.norm.weight": (g.n_embd,),
              "lm_head.weight": (g.n_vocab, g.n_embd)}
    for il in range(g.n_layer):
        p = f"model.layers.{il}."
        shapes.update({p + "input_layernorm.weight": (g.n_embd,), p + "post_attention_layernorm.weight": (g.n_embd,),
                       p + "self_attn.q_proj.weight": (q, g.n_embd), p + "self_attn.k_proj.weight": (kv, g.n_embd),
                       p + "self_attn.v_proj.weight": (kv, g.n_embd), p + "self_attn.o_proj.weight": (g.n_embd, q),
                       p + "self_attn.q_norm.weight": (g.head_dim,), p + "self_attn.k_norm.weight": (g.head_dim,),
                       p + "mlp.gate.weight": (g.n_expert, g.n_embd)})
        for e in range(g.n_expert):
            x = f"{p}mlp.experts.{e}."
            shapes.update({x + "gate_proj.weight": (g.n_ff_exp, g.n_embd), x + "up_proj.weight": (g.n_ff_exp, g.n_embd),
                           x + "down_proj.weight": (g.n_embd, g.n_ff_exp)})
    write_sparse_safetensors(dest / "model.safetensors", shapes)
    return dest
