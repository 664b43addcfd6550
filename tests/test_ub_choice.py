"""The micro-batch chosen by measurement (planning/ubatch.py): the plan takes the -ub `ctxq bench` measured fastest
for the workload among those that fit, never over a -ub or -b given, and says so; without measurements it keeps
llama.cpp's 512 and says how to measure. Rates are given here (what is tested is the choice; tests/test_bench.py
measures real ones and checks the plan takes the faster)."""

from __future__ import annotations

import pytest

import ctxq
from ctxq.planning.speed import store as speed_store

from .conftest import run_ctxq

SIM = "0.3,0.2"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path))
    return tmp_path


def _keep(model, rates: dict, mode: str = "layer", **opts):
    """A measurement of the plan at each micro-batch: {ub: (pp t/s, tg t/s)}; the plans, by micro-batch."""
    plans = {}
    for ub, (pp, tg) in rates.items():
        p = ctxq.plan(model, 1024, simulate=SIM, split_mode=mode, n_ubatch=ub, **opts)
        assert p.n_ubatch == ub
        speed_store.save(p, speed_store.Measured(mode, p.tensor_split, 32, 4, 0, [pp], [tg]))
        plans[ub] = p
    return plans


def test_without_measurements_the_default_stays_and_the_note_says_how_to_measure(smollm2, home):
    p = ctxq.plan(smollm2, 1024, simulate=SIM)
    assert p.n_ubatch == 512 and " -ub 512 " in p.llama_flags()
    note = next(n for n in p.notes if n.startswith("micro-batch:"))
    assert "llama.cpp's default, not chosen by measurement" in note and "`ctxq bench`" in note and "-ub 128,256" in note
    assert p.speed["ubatch"]["basis"] == "default"


def test_the_fastest_measured_micro_batch_is_taken_and_said(smollm2, home):
    # 1,024 + 128 tokens: -ub 128 1024/100 + 128/40 = 13.4 s, -ub 256 1024/200 + 128/40 = 8.3 s, -ub 512 10.0 s
    plans = _keep(smollm2, {128: (100.0, 40.0), 256: (200.0, 40.0), 512: (150.0, 40.0)})
    p = ctxq.plan(smollm2, 1024, simulate=SIM)
    assert p.n_ubatch == 256 and " -ub 256 " in p.llama_flags()
    assert p.tensor_split == plans[256].tensor_split  # the plan made at that micro-batch, its compute buffers
    assert "-ub 256 (measured 8.3 s for the workload against 10.0 s at -ub 512)" in p.reason
    note = next(n for n in p.notes if n.startswith("micro-batch:"))
    assert note.startswith("micro-batch: -ub 256, measured: 8.3 s for 1,024 prompt and 128 generated tokens")
    assert "-ub 128 13.4 s" in note and "-ub 512 10.0 s" in note
    assert p.speed["ubatch"]["basis"] == "measured" and set(p.speed["ubatch"]["measured"]) == {128, 256, 512}
    # the workload decides: a long answer after a short prompt favours the better generation rate
    _keep(smollm2, {128: (100.0, 80.0)})
    assert ctxq.plan(smollm2, 1024, simulate=SIM, prompt_tokens=32, gen_tokens=1000).n_ubatch == 128
    # the printed plan and the flags say it
    r = run_ctxq("plan", str(smollm2), "--ctx", "1024", "--simulate", SIM, env={"CTXQ_HOME": str(home)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "-ub 256 " in r.stdout and "note: micro-batch: -ub 256, measured" in r.stdout


def test_never_over_a_micro_batch_or_batch_given(smollm2, home):
    _keep(smollm2, {128: (100.0, 40.0), 256: (400.0, 40.0), 512: (150.0, 40.0)})
    given = ctxq.plan(smollm2, 1024, simulate=SIM, n_ubatch=512)
    assert given.n_ubatch == 512 and "ubatch" not in given.speed
    assert not any(n.startswith("micro-batch:") for n in given.notes)
    # -b 128: llama.cpp clamps the micro-batch to it, and no larger one is tried
    small = ctxq.plan(smollm2, 1024, simulate=SIM, n_batch=128)
    assert small.n_ubatch == 128 and small.n_batch == 128


def test_auto_takes_the_fastest_mode_and_micro_batch_together(smollm2, home):
    """-sm auto at each measured micro-batch weighs the modes measured there; the fastest pair is taken."""
    _keep(smollm2, {256: (100.0, 20.0), 512: (120.0, 20.0)}, mode="layer")
    tensor = _keep(smollm2, {256: (400.0, 20.0), 512: (110.0, 20.0)}, mode="tensor")
    p = ctxq.plan(smollm2, 1024, simulate=SIM, split_mode="auto")
    assert p.split_mode == "tensor" and p.n_ubatch == 256 and p.tensor_split == tensor[256].tensor_split
    assert "-sm tensor" in p.llama_flags() and " -ub 256 " in p.llama_flags()
    assert any(n.startswith("split mode: measured") for n in p.notes)
    assert any(n.startswith("micro-batch: -ub 256, measured") for n in p.notes)
