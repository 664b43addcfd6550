"""`ctxq convert MODEL fit --ctx N`: the K/V cache pair and the mix chosen together (issue 45).

The chooser is a pure function over rows (exhaustive small cases); the search runs on real files: a random 4-layer
SmolLM3 written by llama.cpp's converter (cheap: the pair fixed by --kv, and the error method's planner's pair
without it). SmolLM2-135M by the error method, with and without --kv (minutes: a table, a bisection, a quantization
and a measurement each), is scripts/bench_fit.py's fifth section (`--kv-rows`; its figures in docs/quantize.md)."""

from __future__ import annotations

import itertools
import json
import math
import os
import random

import numpy as np
import pytest

from ctxq.conversion.joint import Row, dominated, least_total
from ctxq.conversion.joint_scale import SLOPE, fitted

from .conftest import run_ctxq


def _row(name: str, kv_bytes: int, kv_loss: float, weights_loss: float | None) -> Row:
    k, _, v = name.partition("/")
    return Row(k, v or k, kv_bytes, kv_loss, "test", weights_loss=weights_loss)


def test_the_joint_choice_is_the_least_predicted_total_exhaustively():
    """Every assignment of losses from a small grid to three or four pairs: the row chosen has the least total of the
    rows with a mix, ties to the smaller KV loss; none chosen when no row has a mix."""
    grid = [None, 0.0, 0.01, 0.02, 0.05]
    kv = [0.0, 0.0045, 0.0106, 0.0706]
    for n in (3, 4):
        for weights in itertools.product(grid, repeat=n):
            rows = [_row(f"p{i}", 100 - 10 * i, kv[i], w) for i, w in enumerate(weights)]
            got = least_total(rows)
            have = [r for r in rows if r.weights_loss is not None]
            if not have:
                assert got is None
                continue
            best = min(r.weights_loss + r.kv_loss for r in have)
            assert got.total == pytest.approx(best)
            assert got.kv_loss == min(r.kv_loss for r in have if r.total == pytest.approx(best))


def test_a_dominated_pair_never_wins_when_the_weights_lose_less_with_more_room():
    """The search skips a pair with a larger cache and no less loss than another: on random cards where the mix's
    loss falls with the room the cache leaves, the least total over the undominated rows is the least over all."""
    rng = random.Random(45)
    for _ in range(300):
        cap = rng.randint(200, 400)
        pairs = [(rng.randint(10, 150), rng.choice([0.0, 0.004, 0.006, 0.01, 0.02, 0.07])) for _ in range(rng.randint(2, 7))]
        curve = sorted((rng.random() for _ in range(5)), reverse=True)

        def weights(room):  # a non-increasing loss of the room left: a step function of it
            return None if room < 50 else curve[min(4, (room - 50) // 60)]

        rows = [_row(f"p{i}", b, loss, weights(cap - b)) for i, (b, loss) in enumerate(pairs)]
        skip = dominated(rows)
        for i, o in skip.items():
            assert o.kv_bytes <= rows[i].kv_bytes and o.kv_loss <= rows[i].kv_loss
        everyone, kept = least_total(rows), least_total([r for i, r in enumerate(rows) if i not in skip])
        assert (everyone is None) == (kept is None)
        if everyone is not None:
            assert kept.total == pytest.approx(everyone.total)


@pytest.fixture(scope="module")
def smollm3():
    from ctxq.testing import upstream_models

    return upstream_models.build("smollm3")


def test_a_pair_the_devices_cannot_run_is_one_line_and_writes_nothing(smollm3, tmp_path):
    """Described GPUs are CUDA cards: llama.cpp's default build runs q8_0/q4_0 only by converting at every step."""
    out = tmp_path / "never.gguf"
    r = run_ctxq("convert", str(smollm3), "fit", "--ctx", "1024", "--gpus", "1", "--kv", "q8_0/q4_0", "-o", str(out))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "q8_0/q4_0" in lines[0] and "at speed" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and os.listdir(tmp_path) == []


def test_a_budget_no_pair_fits_is_one_line_and_writes_nothing(smollm3, tmp_path):
    out = tmp_path / "never.gguf"
    r = run_ctxq("convert", str(smollm3), "fit", "--ctx", "4096", "--simulate", "0.01", "-o", str(out))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "does not hold 4,096 tokens" in lines[0], r.stderr
    assert os.listdir(tmp_path) == []


def test_joint_fit_on_a_simulated_card_takes_the_least_total(smollm3, tmp_path):
    """Every pair runs at speed on an RPC card: the pair written is the row of least predicted total, the plan of
    the file holds every layer with it, and the combination is measured against the source with an f16 cache."""
    out = tmp_path / "joint.gguf"
    r = run_ctxq("convert", str(smollm3), "fit", "--ctx", "1024", "--simulate", "0.2", "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert out.stat().st_size == d["size"]
    totals = [p["total"] for p in d["pairs"] if p["total"] is not None]
    chosen = next(p for p in d["pairs"] if (p["type_k"], p["type_v"]) == (d["type_k"], d["type_v"]))
    assert chosen["total"] == min(totals) and chosen["mix_bytes"] == d["size"]
    assert d["predicted"]["total"] == pytest.approx(chosen["weights_loss"] + chosen["kv_loss"])
    assert (d["plan"]["type_k"], d["plan"]["type_v"], d["plan"]["cpu_layers"]) == (d["type_k"], d["type_v"], 0)
    q = d["quality"]
    assert (q["type_k"], q["type_v"]) == (d["type_k"], d["type_v"]) and q["mean_kl"] > 0
    assert q["reference"].startswith(smollm3.name) and "f16/f16" in q["reference"]
    assert any(p["skipped"] for p in d["pairs"])  # pruned rows say why
    # the table's losses put on the measurement's scale by anchor mixes measured as the result is (joint_scale)
    sc = d["scale"]
    assert len(sc["anchors"]) >= 2 and sc["n_ctx"] == 1024
    sizes = [x["size"] for x in sc["anchors"]]
    assert sizes == sorted(sizes) and all(x["measured"] > 0 and x["table"] > 0 for x in sc["anchors"])
    b, a = np.polyfit(np.log([x["table"] for x in sc["anchors"]]), np.log([x["measured"] for x in sc["anchors"]]), 1)
    if SLOPE[0] < b < SLOPE[1]:
        assert (sc["a"], sc["b"]) == pytest.approx((a, b), rel=1e-6, abs=1e-9)
    for p in d["pairs"]:
        if p["table_loss"] is not None:
            assert p["weights_loss"] == pytest.approx(math.exp(sc["a"]) * p["table_loss"] ** sc["b"])
    assert d["predicted"]["weights_table"] == chosen["table_loss"]


def test_the_scale_is_the_least_squares_line_in_logs():
    """joint_scale.fitted: an exact power law comes back; one anchor keeps the slope 1; a slope beyond SLOPE is
    held at its edge."""
    pts = [(x, 0.7 * x ** 0.8) for x in (0.3, 0.05, 0.004)]
    a, b = fitted(pts)
    assert (math.exp(a), b) == pytest.approx((0.7, 0.8))
    assert fitted([(0.02, 0.05)]) == pytest.approx((math.log(2.5), 1.0))
    assert fitted([(0.1, 0.1), (0.01, 0.0001)])[1] == SLOPE[1]
    assert fitted([]) == (0.0, 1.0)


def test_kv_fixes_the_pair_and_a_smaller_cache_leaves_the_mix_no_less_room(smollm3, tmp_path):
    """`fit --ctx 512 --simulate G --method error --kv q8_0`, then `--kv q4_0`, on the same card (what
    scripts/bench_fit.py --kv-rows runs on SmolLM2, minutes): each keeps one row with its pair, writes the mix's
    bytes to the byte (a matrix's quantize.imatrix.* header keys included: dryrun.written_header_bytes), plans every
    layer on the card with that cache and measures with it; the q4_0 cache is the smaller and its mix no smaller.
    The card, calibrated on this model: at 0.13 GiB no mix holds 512 tokens; at 0.131 the q8_0 mix was 12,626,848
    bytes and the q4_0 mix 13,080,480 (the card, not the search's ceiling, bounds both: at 0.132-0.133 both were
    13,806,240, from 0.134 both 15,764,384, as at 0.2). The errors are the kl table's above (cached per file)."""
    rows = {}
    for kv in ("q8_0", "q4_0"):
        out = tmp_path / f"kv-{kv}.gguf"
        r = run_ctxq("convert", str(smollm3), "fit", "--ctx", "512", "--simulate", "0.131", "--kv", kv, "--method",
                     "error", "--no-check", "-o", str(out), "--json")
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert (d["type_k"], d["type_v"], d["fixed"]) == (kv, kv, True)
        assert [p["pair"] for p in d["pairs"]] == [f"{kv}/{kv}"]
        assert d["size"] == d["pairs"][0]["mix_bytes"] == out.stat().st_size
        assert (d["plan"]["type_k"], d["plan"]["type_v"], d["plan"]["cpu_layers"]) == (kv, kv, 0)
        q = d["quality"]
        assert (q["type_k"], q["type_v"], q["n_ctx"]) == (kv, kv, 512) and 0 < q["mean_kl"] < 1
        rows[kv] = d["pairs"][0]
    assert rows["q4_0"]["kv_bytes"] < rows["q8_0"]["kv_bytes"]
    assert rows["q4_0"]["mix_bytes"] >= rows["q8_0"]["mix_bytes"], rows


def test_error_method_keeps_the_planners_pair(smollm3, tmp_path):
    """The error method's losses are not KL, so they are never added to a cache's KL: without --kv the pair is the
    planner's for llama.cpp's Q4_K_M on those devices, one row, and the output says why. On the random SmolLM3 (its
    error table is the one the --kv runs above made, cached per file); SmolLM2's real weights on a 0.25 GiB card,
    the same claims: `scripts/bench_fit.py --kv-rows` (its planner's row; minutes, issue 64)."""
    out = tmp_path / "err.gguf"
    r = run_ctxq("convert", str(smollm3), "fit", "--ctx", "512", "--simulate", "0.2", "--method", "error",
                 "--no-check", "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["fixed"] is False and len(d["pairs"]) == 1 and d["pairs"][0]["pair"] == f"{d['type_k']}/{d['type_v']}"
    assert d["size"] == d["pairs"][0]["mix_bytes"] == out.stat().st_size
    note = next(n for n in d["notes"] if "not chosen with the mix" in n)
    assert f"KV {d['type_k']}/{d['type_v']}, the planner's for Q4_K_M" in note
    ref = tmp_path / "q4km.gguf"
    q = run_ctxq("convert", str(smollm3), "q4_k_m", "--no-check", "-o", str(ref))
    assert q.returncode == 0, q.stderr
    p = run_ctxq("plan", str(ref), "--ctx", "512", "--simulate", "0.2", "--json")
    assert p.returncode == 0, p.stderr
    assert (json.loads(p.stdout)["type_k"], json.loads(p.stdout)["type_v"]) == (d["type_k"], d["type_v"])
