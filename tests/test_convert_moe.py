"""Issue 21 part 5: mixture-of-experts checkpoints (Qwen3-MoE, Mixtral, gpt-oss) converted by ctxq,
run by the real llama.cpp, against transformers' logits on the same random weights. Widths are
multiples of 256 so that K-quants and MXFP4 apply to every expert tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers reference logits need torch (pip install ctxq[test])")
transformers = pytest.importorskip("transformers", reason="reference logits need transformers (ctxq[test])")

from ctxq import convert  # noqa: E402

from .conftest import run_ctxq  # noqa: E402
from .test_convert import (assert_4bit_close, compare, hf_ids, llama_logits, randomize, reference_logits,  # noqa: E402
                           write_bpe_tokenizer)

COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=512)
MOE = {
    "qwen3moe": ("Qwen3MoeConfig", dict(intermediate_size=512, moe_intermediate_size=256, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                        mlp_only_layers=[]), "qwen2"),
    "mixtral": ("MixtralConfig", dict(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None), "llama-bpe"),
    # sliding window (8 tokens) shorter than the prompt, on alternate layers as gpt-oss has it
    "gpt-oss": ("GptOssConfig", dict(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters=dict(rope_type="default", rope_theta=150000.0)), "gpt-2"),
}


def make_moe(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    cfg_name, extra, pre = MOE[family]
    folder.mkdir(parents=True, exist_ok=True)
    n_tok = write_bpe_tokenizer(folder, pre)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides, "vocab_size": n_tok + 7})
    torch.manual_seed(seed)
    model = getattr(transformers, cfg_name.replace("Config", "ForCausalLM"))(cfg).float().eval()
    randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def pack_experts(src: Path, dst: Path) -> Path:
    """The same checkpoint with its per-expert tensors packed as transformers 5 keeps them in memory
    (`mlp.experts.gate_up_proj` (E, 2*ff, hidden), gate rows first; `mlp.experts.down_proj`)."""
    import re

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(src / "model.safetensors")
    per: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for k, v in sd.items():
        m = re.match(r"(.*\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", k)
        if m:
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m[3], m[3])
            per.setdefault((m[1], proj), {})[int(m[2])] = v
        else:
            out[k.replace("block_sparse_moe.gate", "mlp.gate")] = v
    assert per, "no per-expert tensors to pack"
    for layer in {lay for lay, _ in per}:
        stack = {p: torch.stack([per[(layer, p)][e] for e in sorted(per[(layer, p)])]) for p in
                 ("gate_proj", "up_proj", "down_proj")}
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack["down_proj"].contiguous()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {f: make_moe(root / f, f) for f in MOE}


def _check(folder: Path, ref: np.ndarray, ids: list[int], out: Path, kind: str, limit: float,
           max_flips: int = 0) -> float:
    r = convert(folder, kind, out)
    got, toks = llama_logits(r.path, ids)
    assert toks == ids
    rel, flips, _ = compare(ref, got)
    print(f"{folder.name} {kind}: relative L2 {rel:.2e}, {flips} top-1 changes in {len(ids)} positions")
    assert rel <= limit, f"{folder.name} {kind}: relative L2 {rel:.2e} > {limit}"
    assert flips <= max_flips, f"{folder.name} {kind}: {flips} top-1 changes outside near-ties"
    return rel


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE))
def test_moe_family_matches_transformers(moe, family, tmp_path):
    from ctxq.gguf.reader import read_gguf

    folder = moe[family]
    ids = hf_ids(folder)
    assert len(ids) > 40  # longer than gpt-oss's 8-token window
    ref = reference_logits(folder, ids)
    # f16 weights may change which experts a token near a router tie picks: that position's logits
    # then differ as a whole, so f16 allows two top-1 changes in the ~130 positions (f32: none)
    for kind, limit, flips in (("f32", 1e-3, 0), ("f16", 1e-2, 2)):
        _check(folder, ref, ids, tmp_path / f"{family}-{kind}.gguf", kind, limit, flips)
    g = read_gguf(tmp_path / f"{family}-f32.gguf", skip_arrays=True)
    shapes = {t.name: t.shape for t in g.tensors}
    # stacked as llama.cpp reads them: {n_embd, n_ff_exp, n_expert} and {n_ff_exp, n_embd, n_expert}
    assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == (256, 256, 4)
    assert shapes["blk.1.ffn_down_exps.weight"] == (256, 256, 4) and shapes["blk.0.ffn_gate_inp.weight"] == (256, 4)
    arch = g.arch
    assert (g.get(f"{arch}.expert_count"), g.get(f"{arch}.expert_used_count")) == (4, 2)
    if family == "gpt-oss":
        assert g.get("gpt-oss.attention.sliding_window") == 8
        assert list(g.get("gpt-oss.attention.sliding_window_pattern")) == [True, False]
        assert shapes["blk.0.attn_sinks.weight"] == (4,) and shapes["blk.0.ffn_gate_exps.bias"] == (256, 4)
    if family in ("qwen3moe", "mixtral"):  # transformers 5's packed layout converts to the same logits
        packed = pack_experts(folder, tmp_path / f"{family}-packed")
        _check(packed, ref, ids, tmp_path / f"{family}-packed.gguf", "f32", 1e-3)


@pytest.mark.slow
def test_gpt_oss_yarn(tmp_path):
    """gpt-oss's YaRN RoPE (factor 32, beta 32/1), with a short original context so that it bites.
    transformers' truncate=false is not expressible in llama.cpp (a warning says so); truncated matches."""
    rp = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
              original_max_position_embeddings=64, truncate=True)
    folder = make_moe(tmp_path / "y", "gpt-oss", rope_parameters=rp)
    ids = hf_ids(folder)
    _check(folder, reference_logits(folder, ids), ids, tmp_path / "y.gguf", "f32", 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("family,qtype", [("qwen3moe", "Q4_K_M"), ("mixtral", "MXFP4_MOE"),
                                          ("gpt-oss", "MXFP4_MOE"), ("gpt-oss", "Q4_K_M")])
def test_moe_quantizes_with_llama_cpp(moe, family, qtype, tmp_path):
    from ctxq.gguf.info import model_info
    from ctxq.gguf.reader import read_gguf

    folder = moe[family]
    ids = hf_ids(folder)
    ref = reference_logits(folder, ids)
    r = convert(folder, qtype, tmp_path / f"{family}-{qtype}.gguf", check=False)
    assert model_info(r.path).file_type == qtype
    from gguf import GGMLQuantizationType as T

    types = {t.name: T(t.type).name for t in read_gguf(r.path, skip_arrays=True).tensors}
    want = "MXFP4" if qtype == "MXFP4_MOE" else None
    for proj in ("gate", "up", "down"):
        t = types[f"blk.0.ffn_{proj}_exps.weight"]
        assert (t == want) if want else t in ("Q4_K", "Q5_K", "Q6_K"), (proj, t)
    got, _ = llama_logits(r.path, ids)
    assert_4bit_close(f"{family} {qtype}", ref, got)


def test_dense_layers_in_a_qwen3_moe_are_refused_in_one_line(tmp_path):
    folder = make_moe(tmp_path / "m", "qwen3moe", decoder_sparse_step=2)
    out = tmp_path / "o.gguf"
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out))
    assert rc.returncode == 1 and rc.stderr.startswith("Error:") and "dense MLP" in rc.stderr, rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1 and "layers 0" in rc.stderr
    assert not out.exists() and not list(tmp_path.glob(".o.gguf*"))


def test_missing_expert_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_moe(tmp_path / "m", "mixtral")
    sd = load_file(folder / "model.safetensors")
    gone = [k for k in sd if ".experts.3." in k and ".layers.1." in k]
    assert gone, sorted(sd)[:20]
    save_file({k: v for k, v in sd.items() if k not in gone}, folder / "model.safetensors", metadata={"format": "pt"})
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(tmp_path / "o.gguf"))
    assert rc.returncode == 1 and "expert 3" in rc.stderr and "missing" in rc.stderr, rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]


def _hf_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., n) float weights as OpenAI's MXFP4 checkpoint bytes: blocks (..., n/32, 16) with element 2k
    in byte k's low nibble, and e8m0 scales (..., n/32). Written here from the format's definition;
    the reference dequantizes them with transformers' own convert_moe_packed_tensors."""
    fp4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    x = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(x).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0))  # the largest code, 6, covers the block
    codes = np.abs(x[..., None] / 2.0 ** exp[..., None] - fp4).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exp[..., 0] + 127, np.uint8)


@pytest.mark.slow
def test_gpt_oss_mxfp4_checkpoint_is_copied_as_mxfp4(moe, tmp_path):
    """gpt-oss as OpenAI releases it: expert weights as MXFP4 blocks and scales. ctxq copies them into
    ggml's MXFP4 tensors; transformers' dequantized weights give the reference."""
    from gguf import GGMLQuantizationType as T
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ctxq.gguf.reader import read_gguf

    src = moe["gpt-oss"]
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    sd = load_file(src / "model.safetensors")
    out, deq = {}, {}
    for k, v in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _hf_mxfp4(v.transpose(1, 2).numpy())  # stored (E, out, in) when quantized
            out[k + "_blocks"], out[k + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            deq[k] = convert_moe_packed_tensors(out[k + "_blocks"], out[k + "_scales"], dtype=torch.float32)
            assert deq[k].shape == v.shape
        else:
            out[k] = v
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (folder / "config.json").write_text(json.dumps(cfg))
    # the reference: the float model with transformers' dequantization of those bytes
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.load_state_dict({**model.state_dict(), **deq})
    ids = hf_ids(src)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    r = convert(folder, "f32", tmp_path / "g.gguf")
    types = {t.name: T(t.type).name for t in read_gguf(r.path, skip_arrays=True).tensors}
    assert {types[f"blk.{il}.ffn_{p}_exps.weight"] for il in (0, 1) for p in ("gate", "up", "down")} == {"MXFP4"}
    assert types["blk.0.attn_q.weight"] == "F32" and types["blk.0.ffn_gate_exps.bias"] == "F32"
    got, _ = llama_logits(r.path, ids)
    rel, flips, _ = compare(ref, got)
    print(f"gpt-oss MXFP4 checkpoint: relative L2 {rel:.2e}, {flips} top-1 changes in {len(ids)} positions")
    # llama.cpp multiplies MXFP4 weights with activations rounded to Q8_0 (ggml_vec_dot_mxfp4_q8_0)
    assert rel < 3e-2 and flips <= 2, (rel, flips)
    # MXFP4_MOE from it keeps the experts' bytes
    q = convert(folder, "MXFP4_MOE", tmp_path / "q.gguf", check=False)
    assert {T(t.type).name for t in read_gguf(q.path, skip_arrays=True).tensors if "_exps.weight" in t.name} == {"MXFP4"}
