"""ctxq's own importance matrix (issue 45, part 3): llama.cpp's imatrix GGUF format, values, use by convert, bad input.

The matrices here use chunks of 64 tokens (llama-imatrix's default is 512) to stay fast; scripts/imatrix_check.py
compares the default with llama-imatrix itself (docs/quantize.md)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ctxq.conversion.imatrix import make_imatrix
from ctxq.errors import ConversionError, CtxqError
from ctxq.models import models_dir
from ctxq.testing.models import dequantized_smollm2_gguf

from .conftest import run_ctxq

CHUNK = 64


@pytest.fixture(scope="module")
def f16(smollm2):
    return dequantized_smollm2_gguf(models_dir() / "SmolLM2-135M-Instruct.F16.gguf")


@pytest.fixture(scope="module")
def home(tmp_path_factory, f16):
    with pytest.MonkeyPatch.context() as mp:
        h = tmp_path_factory.mktemp("home")
        mp.setenv("CTXQ_HOME", str(h))
        yield h


@pytest.fixture(scope="module")
def made(f16, home):
    return make_imatrix(f16, chunks=2, chunk=CHUNK)


def _tensors(path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {t.name: t for t in r.tensors}, r.fields


def test_file_reads_back_with_one_entry_per_layer_weight(made, f16):
    tensors, fields = _tensors(made.path)
    assert fields["general.type"].contents() == "imatrix" and "general.architecture" not in fields
    assert fields["imatrix.chunk_count"].contents() == 2 and fields["imatrix.chunk_size"].contents() == CHUNK
    assert fields["imatrix.datasets"].contents() == ["licences"]
    model = gguf.GGUFReader(str(f16))
    weights = {t.name: int(t.shape[0]) for t in model.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    assert len(weights) == 210 and made.tensors == 210  # 30 layers x (q, k, v, o, gate, up, down)
    sums = {n[: -len(".in_sum2")]: t for n, t in tensors.items() if n.endswith(".in_sum2")}
    assert set(sums) == set(weights)
    for name, cols in weights.items():
        assert tuple(sums[name].shape) == (cols, 1)  # ggml ne: columns (the weight's input width) x matrices
        assert np.all(np.asarray(sums[name].data) > 0)
        assert np.asarray(tensors[f"{name}.counts"].data).reshape(-1).tolist() == [2 * CHUNK]


def test_first_layer_equals_numpy_over_the_embeddings(made, f16):
    """blk.0's q/k/v input is RMSNorm(token embedding) * attn_norm: computed here from the GGUF's own tensors."""
    from llama_cpp import Llama

    from ctxq.quality import builtin_text

    llm = Llama(str(f16), vocab_only=True, verbose=False)
    toks = np.asarray(llm.tokenize(builtin_text(), add_bos=True, special=False)[: 2 * CHUNK])
    bos = llm.token_bos()
    llm.close()
    model = gguf.GGUFReader(str(f16))
    if model.fields["tokenizer.ggml.add_bos_token"].contents():  # (SmolLM2's is false)
        toks[::CHUNK] = bos  # each chunk then starts with BOS, as llama-imatrix does
    t = {x.name: x for x in model.tensors}
    emb = np.asarray(t["token_embd.weight"].data, dtype=np.float32)[toks]
    eps = float(model.fields["llama.attention.layer_norm_rms_epsilon"].contents())
    x = emb / np.sqrt(np.mean(emb.astype(np.float64) ** 2, axis=1, keepdims=True) + eps)
    x = x * np.asarray(t["blk.0.attn_norm.weight"].data, dtype=np.float64)
    expected = np.sum(x ** 2, axis=0)
    tensors, _ = _tensors(made.path)
    for w in ("attn_q", "attn_k", "attn_v"):
        got = np.asarray(tensors[f"blk.0.{w}.weight.in_sum2"].data, dtype=np.float64).reshape(-1)
        np.testing.assert_allclose(got, expected, rtol=2e-3, err_msg=w)


def test_two_chunks_are_one_chunk_plus_the_next(made, f16, home, tmp_path):
    one = make_imatrix(f16, chunks=1, chunk=CHUNK)
    again = make_imatrix(f16, chunks=2, chunk=CHUNK)
    assert again.cached and again.path == made.path and not one.cached
    two, _ = _tensors(made.path)
    first, _ = _tensors(one.path)
    name = "blk.7.ffn_down.weight.in_sum2"
    a, b = np.asarray(two[name].data, np.float64), np.asarray(first[name].data, np.float64)
    assert np.all(a > b)  # the second chunk adds a positive amount to every column
    assert np.asarray(first["blk.7.ffn_down.weight.counts"].data).tolist() == [[CHUNK]]


@pytest.mark.slow
def test_convert_to_iq3_xxs_without_imatrix_makes_one_and_loads(f16, tmp_path):
    from llama_cpp import Llama

    out = tmp_path / "iq3.gguf"
    env = {"CTXQ_HOME": str(tmp_path / "home"), "CTXQ_IMATRIX_CHUNKS": "1"}
    r = run_ctxq("convert", str(f16), "iq3_xxs", "-o", str(out), "--no-check", env=env)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("imatrix:") and "needs one" in ln]
    assert len(lines) == 1 and "1 chunks of 512 tokens" in lines[0], r.stderr
    meta = gguf.GGUFReader(str(out)).fields
    assert meta["quantize.imatrix.entries_count"].contents() == 210
    llm = Llama(str(out), n_ctx=64, n_threads=2, verbose=False)
    assert llm("The capital of France is", max_tokens=2, temperature=0.0)["choices"][0]["text"]
    llm.close()


@pytest.mark.parametrize("case", ["model not a gguf", "binary text"])
def test_bad_input_is_one_line_and_writes_nothing(case, f16, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Some text. " * 200)
    args = [str(text), "-f", str(text)] if case == "model not a gguf" else [str(f16), "-f", str(f16)]
    out = tmp_path / "out.imatrix.gguf"
    r = run_ctxq("imatrix", *args, "-o", str(out), env={"CTXQ_HOME": str(tmp_path / "home")})
    assert r.returncode == 1 and r.stderr.startswith("Error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ("not a GGUF" in r.stderr) if case == "model not a gguf" else ("is not text" in r.stderr)
    assert not out.exists() and not list((tmp_path / "home").rglob("*imatrix*"))
    assert [p.name for p in tmp_path.iterdir()] == ["t.txt"] or sorted(p.name for p in tmp_path.iterdir()) == \
        ["home", "t.txt"]


def test_short_text_and_bad_chunks_are_refused(f16, tmp_path, monkeypatch):
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    with pytest.raises(ConversionError, match="shorter than one chunk"):
        make_imatrix(f16, short)
    with pytest.raises(CtxqError, match="--chunks"):
        make_imatrix(f16, chunks=0)
    assert not list((tmp_path / "home").rglob("*.gguf")) and not list((tmp_path / "home").rglob("*.part"))


def test_moe_experts_counted_separately(tmp_path, monkeypatch):
    """MUL_MAT_ID: one row of sums and one count per expert; the counts add up to tokens x experts used."""
    from ctxq.testing.moe import tiny_moe_gguf

    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))
    model = tiny_moe_gguf(tmp_path / "moe.gguf")  # 8 experts, 2 used, n_embd 128, n_ff_exp 128, 4 layers
    r = make_imatrix(model, chunks=2, chunk=CHUNK)
    tensors, _ = _tensors(r.path)
    for w in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        counts = np.asarray(tensors[f"blk.0.{w}.weight.counts"].data).reshape(-1)
        assert counts.shape == (8,) and counts.sum() == 2 * CHUNK * 2, (w, counts)
        assert tuple(tensors[f"blk.0.{w}.weight.in_sum2"].shape) == (128, 8)
        sums = np.asarray(tensors[f"blk.0.{w}.weight.in_sum2"].data).reshape(8, 128)
        assert np.all((sums.sum(axis=1) > 0) == (counts > 0))  # an expert never routed to has nothing
    assert np.asarray(tensors["blk.0.attn_q.weight.counts"].data).reshape(-1).tolist() == [2 * CHUNK]
