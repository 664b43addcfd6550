"""Small random checkpoints of architectures outside ctxq's tables, converted by llama.cpp's own converter.

Each entry of `SPECS` is a transformers config (the class's defaults, shrunk: 128 wide, a few layers) with
random weights from the transformers model class, SmolLM2's tokenizer (its pre-tokenizer hash is one the
converter knows: "smollm"), saved as a Hugging Face folder and converted by the `convert_hf_to_gguf.py` of
the llama.cpp that llama-cpp-python vendors (`ctxq.conversion.upstream`, fetched from the sdist, never
committed). No rule of ctxq's wrote these files, so they test the planner on what it was not taught.

`build(name)` returns the GGUF, cached under `<ctxq home>/upstream-models/` by name, config, output type,
transformers and llama-cpp-python versions. The loader facts a config must meet (layer counts that switch
features on, gating functions) are those of /work/shared/research/architectures.md, cited per entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import tempfiles
from ..conversion.upstream import llama_cpp_python_version, run_converter
from ..errors import CtxqError
from ..paths import ctxq_home

# The shared tiny shape; SmolLM2's 49,152-token vocabulary and special ids (bos 1, eos 2, pad 2).
_BASE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             vocab_size=49152, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, pad_token_id=2,
             tie_word_embeddings=False)
# The MoE part, in the words most configs use: 8 experts of 64, 2 used.
_MOE = dict(moe_intermediate_size=64, num_experts_per_tok=2)


@dataclass(frozen=True)
class Spec:
    hf_arch: str  # config.json "architectures" and the transformers class that makes the weights
    model_type: str
    config: dict = field(default_factory=dict)  # over _BASE and the config class's defaults
    arch: str = ""  # the GGUF architecture llama.cpp's converter writes (checked after conversion)
    moe: bool = False  # has routed experts: its cells place them in host memory too
    note: str = ""  # why the config looks as it does
    added_tokens: tuple[str, ...] = ()  # special tokens the converter looks up by name, added after SmolLM2's
    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement) on the saved tensor names
    converter_args: tuple[str, ...] = ()  # more options for convert_hf_to_gguf.py
    spm_bpe: bool = False  # a SentencePiece-style BPE tokenizer (byte fallback) instead of SmolLM2's
    saved_config: dict = field(default_factory=dict)  # keys written to config.json over what transformers saves


def _layers(n: int, every: int, first: str, second: str) -> list[str]:
    """n layer kinds, every `every`-th one `second` (the usual sliding/full and linear/full patterns)."""
    return [second if (i + 1) % every == 0 else first for i in range(n)]


# Gemma 4's full-attention layers have heads twice as wide as its sliding ones (512 and 256 in the real config);
# the converter reads the full layers' head size from per_layer_config (conversion/gemma.py).
_GEMMA4_FULL = {"02": {"head_dim": 64}, "05": {"head_dim": 64}}
# The SentencePiece-style BPE tokenizer of write_tokenizer(spm_bpe=True): 4 specials, 256 byte tokens, "▁",
# printable ASCII and a few merges
SPM_MERGES = [("▁", "t"), ("t", "h"), ("h", "e"), ("▁", "a")]
SPM_VOCAB = 4 + 256 + 1 + 94 + len(SPM_MERGES)
SPM_IDS = dict(vocab_size=SPM_VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2)

SPECS: dict[str, Spec] = {
    "deepseek-v3": Spec("DeepseekV3ForCausalLM", "deepseek_v3", dict(
        num_hidden_layers=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=32, head_dim=32, scoring_func="sigmoid", topk_method="noaux_tc", rope_scaling=None, **_MOE),
        arch="deepseek2", moe=True, note="MLA: llama.cpp keeps only the compressed K (is_mla)"),
    "deepseek-v2-lite": Spec("DeepseekV2ForCausalLM", "deepseek_v2", dict(
        num_hidden_layers=27, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, head_dim=32,
        topk_method="greedy", rope_scaling=None, **_MOE),
        arch="deepseek2", moe=True, note="27 layers: deepseek2.cpp's is_lite (no q_lora) is by layer count"),
    "gemma3n": Spec("Gemma3nForCausalLM", "gemma3n_text", dict(
        num_hidden_layers=10, intermediate_size=[256] * 10, activation_sparsity_pattern=[0.95] * 2 + [0.0] * 8,
        num_kv_shared_layers=0, vocab_size_per_layer_input=49152, hidden_size_per_layer_input=256,
        layer_types=_layers(10, 5, "sliding_attention", "full_attention"), sliding_window=512,
        tie_word_embeddings=True), arch="gemma3n",
        note="per-layer embeddings 256 wide (llama-hparams.h's n_embd_altup) and laurel rank 64: llama.cpp's "
             "gemma3n loader has both fixed. No KV-shared layers: transformers 5 makes them without k/v "
             "projections, which llama.cpp's loader requires (and this build gives them their own KV anyway)"),
    "gemma4": Spec("Gemma4ForCausalLM", "gemma4_text", dict(
        num_hidden_layers=6, layer_types=_layers(6, 3, "sliding_attention", "full_attention"), sliding_window=512,
        vocab_size_per_layer_input=SPM_VOCAB, hidden_size_per_layer_input=0, per_layer_config=_GEMMA4_FULL,
        tie_word_embeddings=True, **SPM_IDS), arch="gemma4", spm_bpe=True,
        note="no per-layer embeddings (as the 31B); the converter takes Gemma 4's vocabulary only as a "
             "SentencePiece-style BPE tokenizer.json (gguf-py's LlamaHfVocab)"),
    "gemma4-kvshare": Spec("Gemma4ForCausalLM", "gemma4_text", dict(
        num_hidden_layers=8, layer_types=_layers(8, 4, "sliding_attention", "full_attention"), sliding_window=512,
        num_kv_shared_layers=4, use_double_wide_mlp=True, vocab_size_per_layer_input=SPM_VOCAB,
        hidden_size_per_layer_input=16,
        per_layer_config={"03": {"head_dim": 64}, "07": {"head_dim": 64}}, tie_word_embeddings=True, **SPM_IDS),
        arch="gemma4", spm_bpe=True,
        note="Gemma 4 E2B/E4B's layout: per-layer inputs, the last 4 layers reuse the KV of layers 2 (sliding) and "
             "3 (full) (gemma4.cpp: n_layer_kv_from_start = n_layer - attention.shared_kv_layers)"),
    "gemma4-moe": Spec("Gemma4ForCausalLM", "gemma4_text", dict(
        num_hidden_layers=6, layer_types=_layers(6, 3, "sliding_attention", "full_attention"), sliding_window=512,
        vocab_size_per_layer_input=SPM_VOCAB, hidden_size_per_layer_input=0, per_layer_config=_GEMMA4_FULL,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64,
        tie_word_embeddings=True, **SPM_IDS), arch="gemma4", moe=True, spm_bpe=True),
    "llama4": Spec("Llama4ForCausalLM", "llama4_text", dict(
        num_hidden_layers=8, intermediate_size=64, intermediate_size_mlp=256, num_local_experts=8,
        num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8192, layer_types=None,
        no_rope_layers=None, moe_layers=None), arch="llama4", moe=True, note="chunked attention on 3 of 4 layers"),
    "olmo3": Spec("Olmo3ForCausalLM", "olmo3", dict(
        num_hidden_layers=8, sliding_window=4096, layer_types=_layers(8, 4, "sliding_attention", "full_attention")),
        arch="olmo2", note="OLMo 3 is olmo2 with sliding_window in llama.cpp"),
    "cohere2": Spec("Cohere2ForCausalLM", "cohere2", dict(
        num_hidden_layers=8, sliding_window=4096, layer_types=_layers(8, 4, "sliding_attention", "full_attention"),
        tie_word_embeddings=True, rotary_pct=1.0), arch="cohere2",
        note="rotary_pct: the converter reads it (command_r.py) and Cohere2Config does not write it"),
    "glm4moe": Spec("Glm4MoeForCausalLM", "glm4_moe", dict(
        num_hidden_layers=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
        partial_rotary_factor=0.5, num_nextn_predict_layers=0, vocab_size=49152 + 3, **_MOE), arch="glm4moe",
        moe=True, added_tokens=("[gMASK]", "<|user|>", "<|observation|>"),
        note="the converter's _set_vocab_glm takes bos/eot/eom from GLM's special tokens"),
    "nemotron-h-moe": Spec("NemotronHForCausalLM", "nemotron_h", dict(
        layers_block_type=["mamba", "moe", "mamba", "attention", "mamba", "moe", "attention", "moe"],
        n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
        num_experts_per_tok=2, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
        use_mamba_kernels=False), arch="nemotron_h_moe", moe=True, note="the arch of Nemotron 3 Nano"),
    "granite4-moe": Spec("GraniteMoeHybridForCausalLM", "granitemoehybrid", dict(
        num_hidden_layers=8, layer_types=_layers(8, 4, "mamba", "attention"), num_local_experts=8,
        num_experts_per_tok=2, intermediate_size=64, shared_intermediate_size=256, mamba_n_heads=8, mamba_d_head=32,
        mamba_d_state=16, mamba_n_groups=1, mamba_expand=2), arch="granitehybrid", moe=True,
        saved_config=dict(layer_types=_layers(8, 4, "mamba", "attention")),
        note="layer_types as Granite 4's config.json words them (the converter looks for 'attention'; "
             "transformers 5 saves 'full_attention')"),
    "kimi-linear": Spec("KimiLinearForCausalLM", "kimi_linear", dict(
        num_hidden_layers=8, num_key_value_heads=4, layer_types=_layers(8, 4, "linear_attention", "full_attention"),
        mlp_layer_types=["dense"] + ["sparse"] * 7, num_experts=8, num_experts_per_token=2, moe_intermediate_size=64,
        kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, qk_head_dim=64,
        linear_head_dim=32, linear_num_heads=4, first_k_dense_replace=1, num_shared_experts=1,
        linear_attn_config=dict(full_attn_layers=[4, 8], kda_layers=[1, 2, 3, 5, 6, 7], head_dim=32, num_heads=4,
                                short_conv_kernel_size=4)),
        arch="kimi-linear", moe=True, saved_config=dict(moe_router_activation_func="sigmoid"), renames=((r"(layers\.0\.)block_sparse_moe\.(\w+_proj)", r"\1mlp.\2"),),
        note="MLA and delta-net layers. The converter reads the released config.json's linear_attn_config, "
             "first_k_dense_replace and moe_router_activation_func (llama.cpp needs the gating function), and "
             "the dense layer 0 as mlp.*: transformers 5 writes none of them"),
    "smollm3": Spec("SmolLM3ForCausalLM", "smollm3", dict(num_hidden_layers=4), arch="smollm3"),
    "exaone4": Spec("Exaone4ForCausalLM", "exaone4", dict(
        num_hidden_layers=64, sliding_window=4096, layer_types=_layers(64, 4, "sliding_attention", "full_attention")),
        arch="exaone4", note="64 layers: exaone4.cpp turns the sliding window on only at n_layer == 64"),
    "minimax-m2": Spec("MiniMaxM2ForCausalLM", "minimax_m2", dict(
        num_hidden_layers=4, num_local_experts=8, intermediate_size=64, num_experts_per_tok=2, rotary_dim=16,
        scoring_func="sigmoid", use_qk_norm=True), arch="minimax-m2", moe=True,
        note="scoring_func sigmoid: llama-graph.cpp aborts without a gating function"),
    "qwen35moe": Spec("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", dict(
        num_hidden_layers=8, layer_types=_layers(8, 4, "linear_attention", "full_attention"), num_experts=8,
        shared_expert_intermediate_size=64, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, rope_parameters=dict(
            rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
            mrope_interleaved=True), **_MOE), arch="qwen35moe", moe=True,
        converter_args=("--no-mtp",), saved_config=dict(model_type="qwen3_moe"),
        note="--no-mtp: transformers' model has no multi-token-prediction block and the converter asks for one. "
             "mrope sections summing to the 8 rotated dims / 2, as the real ones do. config.json says qwen3_moe: "
             "for qwen3_5_moe_text transformers 5 loads Qwen3_5Tokenizer whatever the files say, and SmolLM2's "
             "vocabulary through Qwen's pre-tokenizer has a hash the converter does not know"),
    "lfm2moe": Spec("Lfm2MoeForCausalLM", "lfm2_moe", dict(
        num_hidden_layers=6, num_dense_layers=2, num_experts=8, layer_types=["conv", "conv", "full_attention",
                                                                           "conv", "conv", "full_attention"],
        tie_word_embeddings=True, **_MOE), arch="lfm2moe", moe=True,
        note="dense layers 0, 1 and the first attention at 2, as LFM2-8B-A1B"),
    "olmoe": Spec("OlmoeForCausalLM", "olmoe", dict(num_hidden_layers=4, num_key_value_heads=4, num_experts=8,
                                                    intermediate_size=64, num_experts_per_tok=2),
                  arch="olmoe", moe=True, note="multi-head: olmoe.cpp takes K/V of n_head heads"),
    "falcon-h1": Spec("FalconH1ForCausalLM", "falcon_h1", dict(
        num_hidden_layers=4, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
        mamba_expand=1, projectors_bias=False), arch="falcon-h1"),
    "ernie45-moe": Spec("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", dict(
        num_hidden_layers=4, moe_num_experts=8, moe_k=2, moe_layer_start_index=1, moe_intermediate_size=64,
        moe_num_shared_experts=1), arch="ernie4_5-moe", moe=True),
    "hunyuan-moe": Spec("HunYuanMoEV1ForCausalLM", "hunyuan_v1_moe", dict(
        num_hidden_layers=4, num_experts=8, moe_topk=[2] * 4, intermediate_size=64, num_shared_expert=[1] * 4,
        moe_intermediate_size=[64] * 4), arch="hunyuan-moe", moe=True,
        note="per-layer lists: the converter (hunyuan.py) reads moe_topk, num_shared_expert and "
             "moe_intermediate_size as Hunyuan-A13B's config.json has them"),
    "hunyuan-dense": Spec("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense", dict(num_hidden_layers=4),
                          arch="hunyuan-dense"),
    "seed-oss": Spec("SeedOssForCausalLM", "seed_oss", dict(num_hidden_layers=4), arch="seed_oss"),
    "dots1": Spec("Dots1ForCausalLM", "dots1", dict(
        num_hidden_layers=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
        scoring_func="sigmoid", **_MOE), arch="dots1", moe=True, note="multi-head, sigmoid gating"),
    "ministral3": Spec("Ministral3ForCausalLM", "ministral3", dict(num_hidden_layers=4), arch="mistral3"),
    "apertus": Spec("ApertusForCausalLM", "apertus", dict(num_hidden_layers=4), arch="apertus"),
    "glm4": Spec("Glm4ForCausalLM", "glm4", dict(num_hidden_layers=4, partial_rotary_factor=0.5,
                                                   vocab_size=49152 + 3), arch="glm4",
                 added_tokens=("[gMASK]", "<|user|>", "<|observation|>"),
                 note="gate and up in one tensor (ffn_up of 2 n_ff rows): tensor mode's segments"),
}
NAMES = tuple(SPECS)
# Entries that cannot be built or converted with these versions, and why (the tests skip them with the reason).
NOT_BUILDABLE: dict[str, str] = {
    "ernie45-moe": "llama.cpp's converter reads ERNIE-4.5's vocabulary only from a SentencePiece tokenizer.model "
                   "(conversion/ernie.py set_vocab), which needs the sentencepiece package: not a test dependency",
    "hunyuan-moe": "llama.cpp's converter reads Hunyuan-A13B's vocabulary as a tiktoken tokenizer "
                   "(conversion/hunyuan.py set_vocab: tokenizer.mergeable_ranks), which no tokenizer.json gives",
}


class NotBuildable(CtxqError):
    """transformers cannot make the checkpoint, or llama.cpp's converter refuses it (the reason says which)."""


def cache_key(name: str, outtype: str = "f16", extra: dict | None = None) -> str:
    """Name, every setting of its entry (and `extra`), output type, transformers and llama-cpp-python versions,
    hashed."""
    import transformers

    blob = json.dumps([name, asdict(SPECS[name]), outtype, transformers.__version__, llama_cpp_python_version(),
                       extra], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build(name: str, outtype: str = "f16") -> Path:
    """The GGUF of checkpoint `name` converted by llama.cpp's converter (`outtype` as its --outtype); cached."""
    if name not in SPECS:
        raise CtxqError(f"unknown upstream model {name!r}: one of {', '.join(NAMES)}")
    dest = ctxq_home() / "upstream-models" / f"{name}-{outtype}-{cache_key(name, outtype)}.gguf"
    if dest.is_file():
        return dest
    with tempfiles.building(dest), tempfiles.folder(dest, "build") as tmp:  # swept by `ctxq cache clean` if killed
        if dest.is_file():  # another process built it while this one waited
            return dest
        write_checkpoint(name, tmp / "hf")
        part = tmp / "out.gguf"
        try:
            run_converter(tmp / "hf", part, outtype, extra=list(SPECS[name].converter_args), timeout=600)
        except CtxqError as e:
            raise NotBuildable(f"{name}: {e}") from e
        os.replace(part, dest)
    return dest


def write_checkpoint(name: str, out: Path) -> Path:
    """The Hugging Face folder of `name`: config.json, random weights (seed 0) as safetensors, SmolLM2's tokenizer."""
    import torch

    s = SPECS[name]
    cls, cfg = make_config(name, s, {**_BASE, **s.config})
    try:
        torch.manual_seed(0)
        model = cls(cfg)
    except Exception as e:  # transformers' own check of the config: the reason is its message
        raise NotBuildable(f"{name}: transformers could not make {s.hf_arch}: {type(e).__name__}: {e}") from e
    model.save_pretrained(out, safe_serialization=True)
    if s.renames:
        _rename_tensors(out / "model.safetensors", s.renames)
    if s.saved_config:
        cfg_file = out / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **s.saved_config}, indent=2) + "\n")
    write_tokenizer(out, s.added_tokens, s.spm_bpe)
    return out


def make_config(name: str, s: Spec, values: dict):
    """The transformers model class of `s` and its config with `values` over the class's defaults."""
    import transformers

    cls = getattr(transformers, s.hf_arch, None)
    if cls is None:
        raise NotBuildable(f"{name}: transformers {transformers.__version__} has no {s.hf_arch}")
    try:
        cfg = transformers.AutoConfig.for_model(s.model_type, **values)
    except Exception as e:
        raise NotBuildable(f"{name}: transformers refused the config: {type(e).__name__}: {e}") from e
    cfg.architectures = [s.hf_arch]
    return cls, cfg


def write_tokenizer(out: Path, added_tokens: tuple[str, ...] = (), spm_bpe: bool = False) -> None:
    """SmolLM2's tokenizer files in `out`, with `added_tokens` as special tokens after its own
    (`spm_bpe`: the small SentencePiece-style one instead)."""
    from .smollm2_hf import rebuild_smollm2_hf

    if spm_bpe:
        return _write_spm_bpe_tokenizer(out)

    tok = rebuild_smollm2_hf()
    shutil.copy(tok / "tokenizer_config.json", out / "tokenizer_config.json")
    if added_tokens:
        from tokenizers import AddedToken, Tokenizer

        t = Tokenizer.from_file(str(tok / "tokenizer.json"))
        t.add_special_tokens([AddedToken(x, special=True, normalized=False) for x in added_tokens])
        t.save(str(out / "tokenizer.json"))
    else:
        shutil.copy(tok / "tokenizer.json", out / "tokenizer.json")


def _rename_tensors(path: Path, renames: tuple[tuple[str, str], ...]) -> None:
    import re

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    for pattern, repl in renames:
        tensors = {re.sub(pattern, repl, k): v for k, v in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_spm_bpe_tokenizer(out: Path) -> None:
    """A BPE tokenizer.json as SentencePiece exports it (byte fallback, "▁" for spaces, a Sequence decoder):
    what gguf-py's LlamaHfVocab accepts. Ids as Gemma's: pad 0, eos 1, bos 2, unk 3."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + [chr(c) for c in range(33, 127)]
    tokens += ["".join(m) for m in SPM_MERGES]
    assert len(tokens) == SPM_VOCAB
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=SPM_MERGES, unk_token="<unk>",
                     byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
        "bos_token": "<bos>", "unk_token": "<unk>"}, indent=2) + "\n")
