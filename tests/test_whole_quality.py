"""The whole plan's loss (issue 45): weights and KV cache measured together against a more precise file with an f16
cache, checked against an independent full-vocabulary computation; `ctxq plan` states it (measured, or the sum of
the measured parts, or what to run); `ctxq quality`'s bytes as a share of the f16 reference and its default pairs
on the loss-for-bytes front."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from ctxq import quality
from ctxq.quality import stats
from ctxq.quality.front import front
from ctxq.testing.full_vocab import full_logprobs

from .conftest import run_ctxq
from .test_quality import _builtin_tokens


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def f16_copy(tmp_path_factory, smollm2):
    from ctxq.testing.models import dequantized_smollm2_gguf

    return dequantized_smollm2_gguf(tmp_path_factory.mktemp("ref") / "smollm2-f16.gguf")


def test_front_keeps_exactly_the_undominated():
    """Against a brute-force definition on random small tables (ties included): a row stays unless another has
    bytes and loss both at most its own and one of them less."""
    rng = random.Random(0)
    for _ in range(300):
        rows = [(i, rng.randint(1, 6), rng.choice([0.0, 0.01, 0.02, 0.05])) for i in range(rng.randint(1, 7))]
        want = [n for n, b, lo in rows
                if not any((b2 <= b and l2 <= lo) and (b2, l2) != (b, lo) for _, b2, l2 in rows)]
        assert front(rows) == want
    # two equal rows both stay (neither beats the other); the cheapest and the most precise always stay
    assert front([("a", 2, 0.1), ("b", 2, 0.1), ("c", 4, 0.0), ("d", 3, 0.2)]) == ["a", "b", "c"]


def test_default_pairs_are_the_front_of_the_default_table(smollm2, home):
    """With nothing measured, `ctxq quality`'s default pairs are those of ctxq's default table that no other pair
    beats in loss and bytes: q4_1/q4_1 (0.061 KL at 2.5 bytes per element pair) loses to q5_1/q4_0 (0.020 KL at
    2.25 bytes) and is left out; f16/f16 and q8_0/q8_0 stay; `--kv all` keeps every pair."""
    from ctxq.cli.quality import _default_pairs

    chosen = _default_pairs(str(smollm2), {}, 256, every=False)
    every = _default_pairs(str(smollm2), {}, 256, every=True)
    assert ("f16", "f16") in chosen and ("q8_0", "q8_0") in chosen
    assert ("q4_1", "q4_1") in every and ("q4_1", "q4_1") not in chosen
    assert set(chosen) < set(every)


@pytest.mark.slow
def test_whole_matches_full_vocabulary(smollm2, f16_copy, home):
    """Q4_1 weights with a q8_0/q4_0 cache against the f16 copy with an f16 cache: mean KL within 5 % and top-1
    within half a point of plain llama-cpp-python and numpy over the whole vocabulary on the same tokens."""
    n = 512
    r, = quality.measure(smollm2, quality.Measurement(n_ctx=n), quality.parse_pairs("q8_0/q4_0"),
                         against=f16_copy, whole=True)
    assert r.mode == "whole" and r.reference == "smollm2-f16.gguf, f16/f16 cache"
    tokens = _builtin_tokens(smollm2, n)
    scored = slice(n // 2, n - 1)
    ref = full_logprobs(f16_copy, tokens, "f16", "f16")[scored]
    cand = full_logprobs(smollm2, tokens, "q8_0", "q4_0")[scored]
    kl = stats.full_kl(ref, cand)
    assert r.mean_kl == pytest.approx(kl.mean(), rel=0.05)
    assert abs(r.top1_agreement - (ref.argmax(1) == cand.argmax(1)).mean()) <= 0.005


@pytest.mark.slow
def test_plan_states_the_whole_cost(smollm2, f16_copy, home):
    """`ctxq plan --kv q8_0` of the Q4_1 file: first what to run; after the weights (against the f16 copy) and the
    pair are measured, their sum, predicted; after `quality --whole`, the measured figure, in the text and --json."""
    env = {"CTXQ_HOME": str(home)}
    args = ("plan", str(smollm2), "--ctx", "256", "--kv", "q8_0")
    r = run_ctxq(*args, env=env)
    assert r.returncode == 0, r.stderr
    assert f"measure them: ctxq quality {smollm2} --ctx 256 --against" in r.stdout
    m = quality.Measurement(n_ctx=256)
    kv, = quality.measure(smollm2, m, quality.parse_pairs("q8_0"))
    w, = quality.measure(smollm2, m, against=f16_copy)
    q = json.loads(run_ctxq(*args, "--json", env=env).stdout)["quality"]
    assert q["total"]["how"] == "sum of the measured parts" and not q["total"]["measured"]
    assert q["total"]["mean_kl"] == pytest.approx(kv.mean_kl + w.mean_kl)
    assert q["weights"]["reference"] == "smollm2-f16.gguf"
    assert f"whole plan: mean KL ~{kv.mean_kl + w.mean_kl:.4f}" in run_ctxq(*args, env=env).stdout
    r = run_ctxq("quality", str(smollm2), "--ctx", "256", "--against", str(f16_copy), "--whole", "--kv", "q8_0",
                 "--json", env=env)
    assert r.returncode == 0, r.stderr
    whole = json.loads(r.stdout)["results"][0]
    assert whole["mode"] == "whole" and whole["bytes"] == smollm2.stat().st_size
    q = json.loads(run_ctxq(*args, "--json", env=env).stdout)["quality"]
    assert q["total"]["how"] == "measured" and q["total"]["mean_kl"] == whole["mean_kl"]
    assert f"whole plan: mean KL {whole['mean_kl']:.4f}" in run_ctxq(*args, env=env).stdout


@pytest.mark.slow
def test_bytes_are_a_share_of_the_f16_cache(smollm2, home):
    """--kv q8_0,q8_0/q4_0,q4_0: q8_0/q8_0 takes 34 of an f16 cache's 64 bytes per 32 values (53 %), not 100 %
    of the largest pair listed; --whole without --against is one line."""
    env = {"CTXQ_HOME": str(home)}
    r = run_ctxq("quality", str(smollm2), "--ctx", "64", "--kv", "q8_0,q8_0/q4_0,q4_0", env=env)
    assert r.returncode == 0, r.stderr
    shares = {line.split()[0]: line.split()[3] for line in r.stdout.splitlines() if "/" in line.split()[0][:10]}
    assert shares["q8_0/q8_0"] == "53%" and shares["q4_0/q4_0"] == "28%" and shares["q8_0/q4_0"] == "41%"
    bad = run_ctxq("quality", str(smollm2), "--ctx", "64", "--whole", env=env)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "--against" in bad.stderr
