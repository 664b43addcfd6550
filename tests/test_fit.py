"""`ctxq convert MODEL fit`: a type per tensor group under a byte budget, written by llama.cpp's quantizer.

Real models: a random 4-layer SmolLM3 written by llama.cpp's own converter (the kl measurement end to end; the
error method's mixes at the sizes of llama.cpp's), and a 70B-shaped f16 header without weights (the budget a plan
leaves on 16,16,16,8,8 GiB at 65,536 tokens). SmolLM2-135M's real weights against llama.cpp's mixes on held-out
text is a measurement of minutes: scripts/bench_fit.py's first section (its figures in docs/quantize.md)."""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path

import pytest

from ctxq.conversion import fit as F
from ctxq.conversion.quantize import quantize_gguf
from ctxq.gguf.reader import read_gguf

from .conftest import run_ctxq


def _brute(costs, budget):
    best = None
    for pick in itertools.product(*[range(len(c)) for c in costs]):
        b = sum(costs[g][i][0] for g, i in enumerate(pick))
        loss = sum(costs[g][i][1] for g, i in enumerate(pick))
        if b <= budget and (best is None or loss < best):
            best = loss
    return best


def test_allocate_keeps_the_budget_and_comes_near_the_optimum():
    rng = random.Random(7)
    worst = 1.0
    for _ in range(60):
        costs = []
        for _ in range(rng.randint(2, 5)):
            size, sens = rng.randint(10, 100), rng.random() * 3
            bits = sorted(rng.sample([2, 3, 4, 5, 6, 8], 4))
            costs.append([(size * b, sens * size * 4.0 ** -b) for b in bits])
        smallest = sum(min(b for b, _ in c) for c in costs)
        largest = sum(max(b for b, _ in c) for c in costs)
        budget = rng.randint(smallest, largest)
        pick = F.allocate(costs, budget)
        used = sum(costs[g][i][0] for g, i in enumerate(pick))
        assert used <= budget
        loss = sum(costs[g][i][1] for g, i in enumerate(pick))
        worst = max(worst, loss / _brute(costs, budget))
    assert worst < 1 + 1e-9, worst  # exact: the exhaustive optimum
    assert F.allocate([[(10, 1.0), (20, 0.1)]], 9) is None


def test_parse_size():
    assert F.parse_size("80MiB") == 80 << 20
    assert F.parse_size("40GB") == 40 * 10**9
    assert F.parse_size("1.5 GiB") == int(1.5 * (1 << 30))
    with pytest.raises(Exception, match="80MiB"):
        F.parse_size("lots")


@pytest.fixture(scope="module")
def smollm3():
    from ctxq.testing import upstream_models

    return upstream_models.build("smollm3")


def test_fit_target_size_end_to_end(smollm3, tmp_path):
    """The kl method on a model llama.cpp's converter wrote: the file is no larger than the target, exactly the
    dry run's size, holds the types reported, loads and generates, and loses less than Q4_K_M of that size."""
    q4 = quantize_gguf(smollm3, tmp_path / "q4km.gguf", "Q4_K_M", check=False)
    out = tmp_path / "fit.gguf"
    r = run_ctxq("convert", str(smollm3), "fit", "--target-size", str(q4.size), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert out.stat().st_size == d["size"] <= q4.size
    assert d["method"] == "kl" and "licences" in d["measured_on"]
    from gguf import GGMLQuantizationType as T

    types = {t.name: T(t.type).name for t in read_gguf(out, skip_arrays=True).tensors}
    assert all(types[n] == t for n, t in d["tensors"].items())
    assert len(set(d["tensors"].values())) >= 2  # a mix, not one type
    ref = F.held_out_quality(q4.path, smollm3)
    assert d["quality"]["mean_kl"] < ref["mean_kl"]
    run = run_ctxq("run", str(out), "-p", "The licence", "-n", "4", "--ctx", "256")
    assert run.returncode == 0, run.stderr


def test_target_below_the_smallest_mix_is_one_line_and_writes_nothing(smollm3, tmp_path):
    out = tmp_path / "small.gguf"
    r = run_ctxq("convert", str(smollm3), "fit", "--target-size", "1MiB", "-o", str(out))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "below the smallest mix" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []


def test_a_budget_the_plan_cannot_meet_is_one_line(smollm3, tmp_path):
    out = tmp_path / "never.gguf"
    r = run_ctxq("convert", str(smollm3), "fit", "--ctx", "4096", "--gpus", "0.02", "-o", str(out))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "does not hold 4,096 tokens" in lines[0], r.stderr
    assert os.listdir(tmp_path) == []


def test_fit_ctx_writes_the_largest_mix_the_plan_holds(smollm3, tmp_path):
    out = tmp_path / "ctx.gguf"
    r = run_ctxq("convert", str(smollm3), "fit", "--ctx", "4096", "--gpus", "1", "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert out.stat().st_size == d["size"]
    assert d["plan"]["cpu_layers"] == 0 and d["plan"]["n_ctx"] == 4096
    assert (d["plan"]["type_k"], d["plan"]["type_v"]) == (d["type_k"], d["type_v"])
    pairs = {p["pair"] for p in d["pairs"]}  # described GPUs are CUDA cards: the pairs its default build runs
    assert pairs == {"f16/f16", "q8_0/q8_0", "q4_0/q4_0"}


def test_fit_fills_the_cards_of_a_70b_at_64k(tmp_path):
    """The issue's case, from a header without weights: 3x16 + 2x8 GiB at 65,536 tokens."""
    from ctxq.conversion.fit_budget import fit_to_plan
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    src = write_synthetic_gguf(tmp_path / "llama3-70b-F16.gguf", GEOMETRIES["llama3-70b"], mix="F16")
    table = F.table_for(src, measure=False)
    b = fit_to_plan(src, table, 65536, gpus="16,16,16,8,8", cpu_memory=64 << 30)
    assert b.kv == "q8_0/q8_0" and b.reference == "Q4_K_M"
    assert b.fill >= 0.97, b.lines()
    assert b.plan.cpu_layers == 0 and all(d.free >= 0 for d in b.plan.gpus)
    from ctxq.conversion.dryrun import dry_run
    from ctxq.gguf.writer import sparse_size

    q4_k_m = sparse_size(read_gguf(src, skip_arrays=True).data_offset, dry_run(src, "Q4_K_M"))
    assert b.mix.size > 1.1 * q4_k_m  # the space Q4_K_M leaves is spent
    assert b.mix.group_types()["token_embd"] == "Q8_0"  # host memory: the GPUs pay nothing for its bits


def test_the_error_mix_at_llama_cpp_sizes_is_the_file_the_dry_run_sized(smollm3, tmp_path):
    """The path of scripts/bench_fit.py's first section (`--methods error`), on the small model: the table by the
    weights' error, the mix at the size of llama.cpp's Q3_K_M and Q4_K_M of the same file, written and measured on
    the held-out half. The file is the dry run's bytes and within the budget, every tensor of the type the mix put
    it at, each group's tensors as the table measured them at the group's type, and the larger budget's mix no
    smaller and no worse by the table. Not held here: that the mix loses less than llama.cpp's (random weights
    give no such claim); SmolLM2's real weights, 0.85x at most: `scripts/bench_fit.py --sizes Q3_K_M,Q4_K_M
    --methods error --skip-70b --skip-joint` (minutes). The errors are the ones the kl table above measured
    (cached per file: alone, this test measures them, a minute or two)."""
    from gguf import GGMLQuantizationType as T

    table = F.table_for(smollm3, "error")
    assert table.method == "error"
    err = table.details["error"]
    mixes = []
    for qt in ("Q3_K_M", "Q4_K_M"):
        fixed = quantize_gguf(smollm3, tmp_path / f"{qt}.gguf", qt, check=False)
        r = F.fit(smollm3, fixed.size, tmp_path / f"fit-{qt}.gguf", table=table, check=False)
        assert Path(r.path).stat().st_size == r.size == r.mix.size <= fixed.size, (qt, r.size, fixed.size)
        written = {t.name: T(t.type).name for t in read_gguf(r.path, skip_arrays=True).tensors}
        assert written == {n: T(t).name for n, _, t in r.mix.tensors}
        for g, i in zip(table.groups, r.mix.choice):  # as the table's pure run at that type gave them (a
            # tensor whose rows a K type cannot hold falls back in both: token_embd at Q5_K is Q5_1 here)
            measured = {n: T(x).name for n, x in table.tensor_types[g.name][i].items()}
            assert {n: written[n] for n in g.tensors} == measured, (g.name, table.types[i])
            assert err[g.name][i] > 0 and table.loss[g.name][i] == err[g.name][i]
        assert r.quality["n_scored"] > 0 and r.quality["mean_kl"] > 0
        mixes.append(r.mix)
        Path(r.path).unlink()
    assert mixes[1].size >= mixes[0].size and mixes[1].predicted_loss <= mixes[0].predicted_loss
