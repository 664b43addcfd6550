"""Issue 30: Gemma 4 (text) converted by ctxq's own converter (converters/gemma4.py), checked as the
other 2026 families (tests/test_convert_2026.py) on random small checkpoints made by transformers 5:
llama.cpp computes transformers' logits, and the tensor table and `gemma4.*` keys equal what llama.cpp's
convert_hf_to_gguf.py of the vendored version writes for the same checkpoint.

The tokenizer is Gemma's kind: a BPE over text whose spaces are U+2581, with byte fallback and no
pre-tokenizer, which llama.cpp reads as its `gemma4` tokenizer model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers reference logits need torch (pip install ctxq[test])")
transformers = pytest.importorskip("transformers", reason="reference logits need transformers (ctxq[test])")

from ctxq import convert  # noqa: E402
from ctxq.testing.gemma_tokenizer import write_gemma_tokenizer  # noqa: E402

from .conftest import run_ctxq  # noqa: E402
from .test_convert import (CORPUS, compare, hf_ids, llama_logits, quantize_checked,  # noqa: E402
                           randomize, reference_logits)
from .test_convert_2026 import _reference, _same_meta, table  # noqa: E402

_SWA, _FULL = "sliding_attention", "full_attention"
# Widths not powers of two where Gemma 4 allows; sliding window 8 < the ~120-token prompt; full layers
# with their own head size (global_head_dim) and proportional RoPE over a quarter of it.
BASE = dict(hidden_size=60, intermediate_size=84, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            global_head_dim=24, max_position_embeddings=512, sliding_window=8, final_logit_softcapping=30.0,
            eos_token_id=1, bos_token_id=2, pad_token_id=0)
VARIANTS = {
    # E2B/E4B-like: per-layer embeddings, the last two layers reuse the caches of layers 1 (sliding) and 2 (full)
    # and have MLPs twice as wide (use_double_wide_mlp)
    "e2b": dict(BASE, num_hidden_layers=5, layer_types=[_SWA, _SWA, _FULL, _SWA, _FULL], hidden_size_per_layer_input=8,
                num_kv_shared_layers=2, use_double_wide_mlp=True),
    # 31B-like: no per-layer embeddings, full layers with K = V (no v_proj) and one KV head, untied output
    "31b": dict(BASE, num_hidden_layers=4, layer_types=[_SWA, _FULL, _SWA, _FULL], hidden_size_per_layer_input=0,
                attention_k_eq_v=True, num_global_key_value_heads=1, tie_word_embeddings=False),
    # 26B-A4B-like: 4 experts (2 per token, fused gate/up) beside the dense MLP in every layer
    "moe": dict(BASE, num_hidden_layers=4, layer_types=[_SWA, _FULL, _SWA, _FULL], hidden_size_per_layer_input=0,
                attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
                top_k_experts=2, moe_intermediate_size=32),
}
VARIANTS["e2b_mm"] = VARIANTS["e2b"]  # inside Gemma4ForConditionalGeneration, with a vision tower (MULTIMODAL)
MULTIMODAL = {"e2b_mm"}


def make(folder: Path, variant: str, seed: int = 0, **overrides) -> Path:
    """A random Gemma4ForCausalLM (or ConditionalGeneration) checkpoint of `variant`, saved as safetensors
    with its tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    n_tok = write_gemma_tokenizer(folder, CORPUS)
    # as many embedding rows as tokens, as Gemma 4's checkpoints (llama.cpp's converter cuts token_embd to
    # the tokenizer's size, Gemma3Model.modify_tensors)
    args = {**VARIANTS[variant], "vocab_size_per_layer_input": n_tok, **overrides, "vocab_size": n_tok}
    cfg = transformers.Gemma4TextConfig(**args)
    cls = transformers.Gemma4ForCausalLM
    if variant in MULTIMODAL:  # media token ids inside the small vocabulary (the Hub's lie past 255,999)
        vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=2, head_dim=16)
        cfg = transformers.Gemma4Config(text_config=cfg, vision_config=vision, audio_config=None,
                                        **{k: n_tok - 1 - i for i, k in enumerate(
                                            ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id"))})
        cls = transformers.Gemma4ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# Gemma 4 attends with scale 1 to RMS-normed Q and K (llama_model_gemma4::load_arch_hparams,
# f_attention_scale = 1), so rounding inside attention costs more than in other families: an f16 KV cache
# alone moves the "e2b" logits by 4.0e-3 (1.4e-2 for the same checkpoint without the double-wide MLPs),
# so llama.cpp runs here with an f32 cache. What is left at f32 weights (1.0e-3, flat over positions
# from the first) fits ggml's CPU GELU, an f16 lookup table (ggml-cpu/vec.h, GGML_GELU_FP16; not
# isolated further). f16 weights
# move them by 8.5e-3 (1.3e-2 and a top-1 flip without the double-wide MLPs), so the f16 file is compared
# with transformers running the same f16-rounded matrices (1-D tensors stay F32 in both): 4.8e-3 left,
# ggml's F16 matmul rounding the activations to f16 too (vec_dot_type of F16 in ggml-cpu).
LIMITS = (("f32", 3e-3), ("f16", 2e-2))


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gemma4_matches_transformers_and_llama_cpp(variant, tmp_path):
    folder = make(tmp_path / variant, variant)
    ids = hf_ids(folder)
    assert len(ids) > 40  # spans the sliding window (8) several times
    refs = {"f32": reference_logits(folder, ids), "f16": reference_logits_f16(folder, ids)}
    for kind, limit in LIMITS:
        ref = refs[kind]
        r = convert(folder, kind, tmp_path / f"{variant}-{kind}.gguf")
        got, toks = llama_logits(r.path, ids, type_k=0, type_v=0)  # GGML_TYPE_F32 cache
        assert toks == ids, f"{variant}: llama.cpp tokenizes differently from transformers"
        rel, flips, _ = compare(ref, got)
        agree = float((ref.argmax(1) == got.argmax(1)).mean())
        print(f"gemma4 {variant} {kind}: relative L2 {rel:.2e}, top-1 agreement {agree:.3f} over {len(ids)} positions")
        assert rel <= limit, f"{variant} {kind}: relative L2 {rel:.2e} > {limit}"
        assert flips == 0, f"{variant} {kind}: {flips} top-1 changes outside near-ties"
    ours = table(tmp_path / f"{variant}-f16.gguf")
    theirs = table(_reference(folder, tmp_path / f"{variant}-llama.cpp-f16.gguf", "f16", "unused", variant))
    assert ours[0] == theirs[0], {k: (ours[0].get(k), theirs[0].get(k)) for k in set(ours[0]) | set(theirs[0])
                                  if ours[0].get(k) != theirs[0].get(k)}
    # ctxq writes gemma4.vocab_size (the token count) for every family; Gemma4Model.set_vocab does not, and
    # llama.cpp reads it only for files without a vocabulary (llama_vocab::impl::load, tokenizer "none")
    assert ours[1].pop("gemma4.vocab_size") == len(_tokens(tmp_path / f"{variant}-f16.gguf"))
    assert not _same_meta(ours[1], theirs[1]), _same_meta(ours[1], theirs[1])
    assert _vocab_keys(tmp_path / f"{variant}-f16.gguf") == _vocab_keys(tmp_path / f"{variant}-llama.cpp-f16.gguf")


def reference_logits_f16(folder: Path, ids: list[int]) -> np.ndarray:
    """transformers' logits with every matrix rounded to f16, as an f16 GGUF holds them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.copy_(p.half().float())
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _tokens(path: Path) -> list[str]:
    import gguf

    return gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()


def _vocab_keys(path: Path) -> dict:
    """The tokenizer.ggml.* keys with their values (token lists, types, scores and merges in full)."""
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.ggml.")}


# What llama.cpp's graph would compute differently is refused in one line, before anything is written.
REFUSED = [
    (dict(layer_types=[_SWA, _FULL, _SWA, _SWA, _FULL]), "KV-shared layers"),
    (dict(attention_bias=True), "attention biases"),
    (dict(hidden_activation="silu"), "tanh-GELU"),
    (dict(vocab_size_per_layer_input=256), "one per-layer row per token"),
]


@pytest.mark.parametrize("overrides,fragment", REFUSED, ids=[next(iter(o)) for o, _ in REFUSED])
def test_what_llama_cpp_computes_differently_is_refused_in_one_line(overrides, fragment, tmp_path):
    folder = make(tmp_path / "m", "e2b", **overrides)
    out = tmp_path / "o.gguf"
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out))
    assert rc.returncode == 1 and rc.stderr.startswith("Error:") and fragment in rc.stderr, rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1 and "Traceback" not in rc.stderr
    assert not out.exists() and not list(tmp_path.glob(".o.gguf*"))


def test_rope_freqs_freeze_what_proportional_rope_leaves_unrotated(tmp_path):
    """A quarter of the full layers' 24-dim heads rotates: 3 of the 12 pairs, the other 9 frozen (1e30)."""
    import gguf

    r = convert(make(tmp_path / "m", "e2b"), "f32", tmp_path / "m.gguf")
    freqs = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(r.path).tensors}["rope_freqs.weight"]
    assert freqs.tolist() == [1.0] * 3 + [np.float32(1e30)] * 9


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["e2b", "moe"])
def test_gemma4_quantizes_to_q4_k_m_with_llama_cpp(variant, tmp_path, monkeypatch):
    """Through llama.cpp's quantizer with the quality gate, as the other 2026 families."""
    quantize_checked(make(tmp_path / variant, variant), tmp_path / f"{variant}-Q4_K_M.gguf", f"gemma4 {variant}",
                     monkeypatch, type_k=0, type_v=0)
