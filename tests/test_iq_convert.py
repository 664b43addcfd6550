"""`ctxq convert MODEL IQ2_XS` with no --imatrix (issue 45, part 3): ctxq makes the matrix of the GGUF, or of the f16
conversion of a Hugging Face folder, and quantizes with it; another model's matrix is refused before any work."""

from __future__ import annotations

import gguf
import pytest

from ctxq.conversion.imatrix import make_imatrix

from .conftest import run_ctxq


@pytest.fixture(scope="module")
def moes(tmp_path_factory):
    """Three tiny qwen3moe files: 4 layers 128 wide, 2 layers 128 wide, 4 layers 256 wide; the first one's matrix."""
    from ctxq.testing.moe import tiny_moe_gguf

    d = tmp_path_factory.mktemp("moes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CTXQ_HOME", str(d / "home"))
        a = tiny_moe_gguf(d / "a.gguf")
        matrix = make_imatrix(a, chunks=1, chunk=64, out=d / "a.imatrix.gguf").path
    return {"a": a, "fewer layers": tiny_moe_gguf(d / "b.gguf", n_layer=2),
            "wider": tiny_moe_gguf(d / "c.gguf", n_embd=256, n_ff_exp=256, head_dim=64), "matrix": matrix}


@pytest.mark.parametrize("other", ["fewer layers", "wider"])
def test_an_imatrix_of_another_model_is_one_line_and_writes_nothing(moes, other, tmp_path):
    out = tmp_path / "out.gguf"
    env = {"CTXQ_HOME": str(tmp_path / "home")}
    r = run_ctxq("convert", str(moes[other]), "iq2_xs", "--imatrix", str(moes["matrix"]), "-o", str(out), env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert "is not an importance matrix of" in lines[0]
    why = {"fewer layers": "entries name no tensor of it (blk.2.", "wider": "imatrix size 128 is different from tensor size 256 for blk.0.attn_k.weight"}
    assert why[other] in lines[0], lines[0]
    # no output, no temporary, no cache record (only ctxq's memo of the files' digests)
    assert not [f for f in tmp_path.rglob("*") if f.is_file() and "digests" not in f.parts]


def test_the_models_own_imatrix_passes_the_check(moes, tmp_path):
    from ctxq.conversion.imatrix import check_matches

    check_matches(moes["matrix"], moes["a"])  # (raises for a mismatch)
    with pytest.raises(Exception, match="not a GGUF importance matrix"):
        check_matches(moes["a"], moes["a"])


def _runs(path) -> str:
    r = run_ctxq("run", str(path), "-p", "The licence", "-n", "4", "--ctx", "256")
    assert r.returncode == 0, r.stderr
    return r.stdout


def _types(path) -> set[str]:
    return {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors}


def test_gguf_to_iq2_xs_without_imatrix_makes_one_and_runs(moes, tmp_path):
    """The 256-wide qwen3moe (its rows take IQ2_XS's 256-blocks): llama.cpp refuses IQ2_XS without a matrix; ctxq
    makes it (one chunk) over every layer's matrix weight, quantizes with it, and the file runs in llama.cpp (`ctxq
    run`, a child process) and generates. SmolLM2's real widths take the same path from a Hugging Face folder below
    (its f16 conversion is a GGUF given to this path; 41 s here on SmolLM2's own f16 until issue 64)."""
    src = moes["wider"]
    out = tmp_path / "iq2xs.gguf"
    env = {"CTXQ_HOME": str(tmp_path / "home"), "CTXQ_IMATRIX_CHUNKS": "1"}
    r = run_ctxq("convert", str(src), "IQ2_XS", "-o", str(out), "--no-check", env=env)
    assert r.returncode == 0, r.stderr
    assert "imatrix: IQ2_XS needs one; ctxq's own over 1 chunks" in r.stderr
    assert "IQ2_XS" in _types(out)
    layer_matrices = [t for t in gguf.GGUFReader(str(src)).tensors
                      if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) >= 2]
    assert gguf.GGUFReader(str(out)).fields["quantize.imatrix.entries_count"].contents() == len(layer_matrices)
    assert _runs(out).strip()


@pytest.mark.slow
def test_hf_folder_to_iq2_xs_without_imatrix_runs_and_is_up_to_date_again(tmp_path):
    """A Hugging Face folder: its f16 conversion, that file's matrix, then IQ2_XS; the same command again finds the
    file up to date (the key names ctxq's own matrix, not a file)."""
    from ctxq.testing.models import rebuild_smollm2_hf

    folder = rebuild_smollm2_hf()
    out = tmp_path / "hf-iq2xs.gguf"
    env = {"CTXQ_HOME": str(tmp_path / "home"), "CTXQ_IMATRIX_CHUNKS": "1"}
    r = run_ctxq("convert", str(folder), "iq2_xs", "-o", str(out), "--no-check", env=env)
    assert r.returncode == 0, r.stderr
    assert "imatrix: IQ2_XS needs one; ctxq's own over 1 chunks" in r.stderr
    assert "IQ2_XS" in _types(out)  # ffn_down's 1536-wide rows (the 576-wide ones fall back to IQ4_NL)
    assert gguf.GGUFReader(str(out)).fields["quantize.imatrix.entries_count"].contents() == 210  # 30 layers x 7
    assert _runs(out).strip()
    again = run_ctxq("convert", str(folder), "iq2_xs", "-o", str(out), "--no-check", env=env)
    assert again.returncode == 0 and "(up to date)" in again.stdout, again.stdout + again.stderr
