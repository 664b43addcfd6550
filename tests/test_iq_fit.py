"""IQ types in fit's table, measured with ctxq's importance matrix, and the weights' error weighted by it (issue 45,
part 3).

A tiny qwen3moe 256 wide (`ctxq.testing.moe`: its rows take 256-blocks, so the IQ types are its own and not the
IQ4_NL fallback SmolLM2's 576-wide rows get), its importance matrix over one chunk of 64 tokens. The table of four candidates (TYPES: one IQ type, the K types
around it, the base) is measured once and cached in the module's home: the weighting test measures it, the fit
reuses it (fit's default table, all twelve candidates, took 143 s of the suite on a loaded machine; the same fit
on SmolLM2 with the whole table, beside llama.cpp's Q2_K: `scripts/bench_fit.py --imatrix-rows`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ctxq.conversion import sensitivity as S

from .conftest import run_ctxq

WIDE = dict(n_embd=256, n_ff_exp=256, head_dim=64, n_layer=2)
TYPES = ("IQ2_XXS", "Q2_K", "Q3_K", "Q8_0")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        h = tmp_path_factory.mktemp("home")
        mp.setenv("CTXQ_HOME", str(h))
        mp.setenv("CTXQ_IMATRIX_CHUNKS", "1")
        yield h


@pytest.fixture(scope="module")
def wide(home, tmp_path_factory):
    from ctxq.testing.moe import tiny_moe_gguf

    return tiny_moe_gguf(tmp_path_factory.mktemp("m") / "moe256.gguf", **WIDE)


def test_weighting_by_the_matrix_changes_which_quantization_is_worse():
    """Two quantizations of one weight: A errs in the column whose input is large, B (more) in the column whose
    input is small. Unweighted B is worse; weighted by the inputs' mean squares A is, as ||(W - Q) x||^2 says."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 2))  # numpy order: 8 rows (outputs) x 2 columns (inputs)
    a = np.array([[4.0, 0.01]])  # mean squared input per column (one matrix)
    qa, qb = w.copy(), w.copy()
    qa[:, 0] += 0.1
    qb[:, 1] += 0.3
    assert S.weighted_error(w, qb, 1.0) > S.weighted_error(w, qa, 1.0)
    assert S.weighted_error(w, qa, a) > S.weighted_error(w, qb, a)
    x = rng.standard_normal((20000, 2)) * np.sqrt(a[0])  # the expectation it stands for, sampled
    assert S.weighted_error(w, qa, a) == pytest.approx(np.mean(np.sum(((w - qa) @ x.T) ** 2, axis=0)), rel=0.05)


def test_iq_types_enter_the_table_only_where_rows_take_them(wide, tmp_path):
    from ctxq.testing.moe import tiny_moe_gguf

    assert set(S.IMATRIX_TYPES) <= set(S.layout(wide).types)
    narrow = tiny_moe_gguf(tmp_path / "moe128.gguf", n_layer=2)  # 128-wide rows: every IQ type falls back
    types = S.layout(narrow).types
    assert not set(S.IMATRIX_TYPES) & set(types) and {"Q2_K", "Q8_0"} <= set(types)


@pytest.mark.slow
def test_errors_are_weighted_by_the_models_own_matrix(wide, home, tmp_path):
    """The table's error at Q3_K of one tensor equals its independent computation from the matrix file's in_sum2
    and counts; the weighting reorders the groups; the IQ2_XXS file the table measured took the matrix."""
    from gguf.quants import dequantize

    table = S.measure(S.layout(wide, types=TYPES), wide, method="error")
    m = table.details["imatrix"]
    assert m and table.measured_on == "the weights, by the importance matrix"
    t = {x.name: x for x in gguf.GGUFReader(m).tensors}
    S._quantize(wide, tmp_path / "q3.gguf", "Q3_K")
    src = {x.name: x for x in gguf.GGUFReader(str(wide)).tensors}
    q3 = {x.name: x for x in gguf.GGUFReader(str(tmp_path / "q3.gguf")).tensors}
    expected = 0.0
    for w in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):  # the group blk.1.experts
        name = f"blk.1.{w}.weight"
        sums = np.asarray(t[f"{name}.in_sum2"].data, np.float64).reshape(8, 256)
        counts = np.asarray(t[f"{name}.counts"].data, np.float64).reshape(8)
        a = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], 1.0)  # llama.cpp: 1 if unrouted
        wf = dequantize(src[name].data, src[name].tensor_type)  # (8 experts, 256 out, 256 in)
        wq = dequantize(q3[name].data, q3[name].tensor_type)
        expected += float(np.sum((wf - wq) ** 2 * a[:, None, :]))
    group = table.details["error"]["blk.1.experts"][table.types.index("Q3_K")]
    assert group == pytest.approx(expected, rel=1e-6)
    plain = table.details["error_unweighted"]
    weighted = table.details["error"]
    j = table.types.index("Q3_K")
    names = [g.name for g in table.groups]
    assert sorted(names, key=lambda g: plain[g][j]) != sorted(names, key=lambda g: weighted[g][j])
    # the IQ type was measured (not a fallback) and is the least precise candidate; the embeddings and the output
    # head (no matrix entry: ggml cannot quantize them to IQ2_XXS) never take it
    k = table.types.index("IQ2_XXS")
    assert sorted(table.excluded) == [["output", "IQ2_XXS"], ["token_embd", "IQ2_XXS"]]
    assert table.loss["output"][k] == table.loss["token_embd"][k] == float("inf")
    layers = [g for g in names if g.startswith("blk.")]
    assert all(weighted[g][k] > weighted[g][j] > weighted[g][table.types.index("Q8_0")] for g in layers)
    # a table of the same file and types without the matrix is another cache entry, and has no IQ type
    bare = S.measure(S.layout(wide, types=TYPES), wide, method="error", imatrix=False)
    assert bare.types == ["Q2_K", "Q3_K", "Q8_0"] and bare.details["imatrix"] is None
    assert bare.details["error"]["blk.1.experts"][1] == pytest.approx(plain["blk.1.experts"][j], rel=1e-9)


@pytest.mark.slow
def test_fit_below_q2_k_writes_iq_types_with_the_matrix_and_runs(wide, home, tmp_path):
    """fit.py unchanged: below Q2_K its mix names the IQ2 type, and the quantize path makes and passes the matrix.
    The table is the weighting test's (TYPES, cached): fit's default candidates enter it as the test above says."""
    from ctxq.conversion import fit as F
    from ctxq.conversion.quantize import quantize_gguf

    q2 = quantize_gguf(wide, tmp_path / "q2.gguf", "Q2_K", pure=True, check=False)
    table = S.measure(S.layout(wide, types=TYPES), wide, method="error")
    r = F.fit(wide, q2.size - (64 << 10), tmp_path / "fit.gguf", table=table, check=False, held_out=False)
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(r.path)).tensors}
    assert "IQ2_XXS" in types, types
    fields = gguf.GGUFReader(str(r.path)).fields
    assert fields["quantize.imatrix.file"].contents() == table.details["imatrix"]
    run = run_ctxq("run", str(r.path), "-p", "The licence", "-n", "4", "--ctx", "256")
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
