"""`ctxq bench`: both split modes measured over real RPC workers, kept, and `plan -sm auto` choosing by them."""

from __future__ import annotations

import json

import pytest

import ctxq
from ctxq.planning.speed import store as speed_store

from .conftest import run_ctxq


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path))
    return tmp_path


def test_bench_measures_both_modes_and_auto_chooses_the_faster_measured(smollm2, home):
    env = {"CTXQ_HOME": str(home)}
    r = run_ctxq("bench", str(smollm2), "--ctx", "1024", "--simulate", "0.3,0.2", "-p", "32", "-n", "4", "-r", "2",
                 "--json", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["mode"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {"layer", "tensor"}
    for row in rows.values():
        assert row["measured"] and len(row["pp_tps"]) == 2 and len(row["tg_tps"]) == 2
        assert all(x > 0 for x in row["pp_tps"] + row["tg_tps"])
    assert "-sm tensor" in rows["tensor"]["plan"] and "-sm layer" in rows["layer"]["plan"]
    assert len(list((home / "bench").glob("*.json"))) == 2
    # the same devices planned again (simulated, not started): the kept measurements decide
    p = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="auto")
    total = {m: 1024 / row["pp_mean"] + 128 / row["tg_mean"] for m, row in rows.items()}
    faster = min(total, key=total.get)
    assert p.split_mode == faster
    assert any(n.startswith("split mode: measured on these devices") and f"{faster} mode chosen" in n for n in p.notes)
    assert set(p.speed["measured"]) == {"layer", "tensor"}


def test_auto_takes_tensor_mode_only_when_measured_faster(smollm2, home):
    """The choice follows the kept measurements, whichever they favour (rates given here, not measured: what is
    tested is the choice, not the rates)."""
    layer = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="layer")
    tensor = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="tensor")
    assert ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="auto").split_mode == "layer"  # nothing measured
    for plan, pp, tg in ((layer, [100.0], [10.0]), (tensor, [150.0], [15.0])):
        speed_store.save(plan, speed_store.Measured(plan.split_mode, plan.tensor_split, 32, 4, 0, pp, tg))
    p = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="auto")
    assert p.split_mode == "tensor" and p.tensor_split == tensor.tensor_split
    assert "chosen over layer mode by measurement" in p.reason
    speed_store.save(tensor, speed_store.Measured("tensor", tensor.tensor_split, 32, 4, 1, [150.0], [1.0]))
    assert ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="auto").split_mode == "layer"
    # other devices: the measurements do not apply
    assert ctxq.plan(smollm2, 1024, simulate="0.4,0.2", split_mode="auto").speed["measured"] == {}


@pytest.mark.parametrize("args,expect", [
    (["-r", "0"], "-r must be 1 or more"),
    (["-d", "4000", "-p", "200"], "-d 4000 + 200 tokens is beyond the context (1024)"),
    (["-p", "0", "-n", "0"], "nothing to measure"),
    (["-ub", "256,0"], "give micro-batch sizes of 1 token or more"),
    (["-ub", "big"], "give micro-batch sizes in tokens"),
])
def test_bench_bad_input_is_one_line(args, expect, smollm2, home):
    r = run_ctxq("bench", str(smollm2), "--ctx", "1024", "--simulate", "0.3,0.2", *args, env={"CTXQ_HOME": str(home)})
    assert r.returncode != 0 and expect in r.stderr and "Traceback" not in r.stderr
    assert not (home / "bench").exists() or not list((home / "bench").iterdir())


def test_bench_measures_each_micro_batch_as_a_plan_of_its_own(smollm2, home):
    """-ub takes llama-bench's list: one plan per micro-batch, each measured and kept under its own plan."""
    r = run_ctxq("bench", str(smollm2), "--ctx", "1024", "--simulate", "0.3,0.2", "-sm", "layer", "-ub", "64,256",
                 "-p", "64", "-n", "2", "-r", "1", "--json", env={"CTXQ_HOME": str(home)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert [(row["mode"], row["n_ubatch"]) for row in rows] == [("layer", 64), ("layer", 256)]
    assert [" -ub 64 " in row["plan"] for row in rows] == [True, False]
    assert all(row["measured"] and row["pp_mean"] > 0 and row["tg_mean"] > 0 for row in rows)
    assert len(list((home / "bench").glob("*.json"))) == 2
    # what each plan stands for: -sm auto at -ub 64 finds the -ub 64 measurement, not the other
    p = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="auto", n_ubatch=64)
    assert set(p.speed["measured"]) == {"layer"} and p.speed["measured"]["layer"]["pp_tps"] == rows[0]["pp_tps"]
    # no -ub given: the plan takes the micro-batch measured faster for the workload (1,024 + 128 tokens)
    total = {row["n_ubatch"]: 1024 / row["pp_mean"] + 128 / row["tg_mean"] for row in rows}
    chosen = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="layer")
    assert chosen.n_ubatch == min(total, key=total.get) and chosen.speed["ubatch"]["basis"] == "measured"
    assert any(n.startswith(f"micro-batch: -ub {chosen.n_ubatch}, measured") for n in chosen.notes)


def test_auto_times_the_modes_for_the_workload_given(smollm2, home):
    """--prompt-tokens / --gen-tokens: the workload the kept measurements are weighed for (rates given here, as
    above): a mode faster at prefill wins a prompt-heavy workload and loses a generation-heavy one."""
    layer = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="layer")
    tensor = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="tensor")
    for plan, pp, tg in ((layer, [100.0], [20.0]), (tensor, [200.0], [10.0])):
        speed_store.save(plan, speed_store.Measured(plan.split_mode, plan.tensor_split, 32, 4, 0, pp, tg))
    # the default, 1,024 + 128: layer 10.24 + 6.4 = 16.6 s, tensor 5.12 + 12.8 = 17.9 s
    assert ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="auto").split_mode == "layer"
    prompt_only = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="auto", gen_tokens=0)
    assert prompt_only.split_mode == "tensor"
    assert any("for 1,024 prompt and 0 generated tokens" in n for n in prompt_only.notes)
    chat = ctxq.plan(smollm2, 1024, simulate="0.3,0.2", split_mode="auto", prompt_tokens=64, gen_tokens=1000)
    assert chat.split_mode == "layer" and any("for 64 prompt and 1000 generated tokens" in n for n in chat.notes)
    r = run_ctxq("plan", str(smollm2), "--ctx", "1024", "--simulate", "0.3,0.2", "-sm", "auto", "--gen-tokens", "0",
                 "--json", env={"CTXQ_HOME": str(home)})
    assert r.returncode == 0 and json.loads(r.stdout)["split_mode"] == "tensor", r.stderr[-1000:]
    r = run_ctxq("plan", str(smollm2), "--ctx", "1024", "--simulate", "0.3,0.2", "-sm", "auto", "--prompt-tokens",
                 "2000", env={"CTXQ_HOME": str(home)})
    assert r.returncode != 0 and "--prompt-tokens 2,000 is beyond the context (1,024 tokens)" in r.stderr
    assert "Traceback" not in r.stderr


SIM3 = "0.3,0.3,0.2"  # three workers: tensor mode also tries the two larger (the smallest by memory left out)


def test_auto_weighs_every_tensor_candidate_by_measurement(smollm2, home):
    """Every card and the subset the planner considers are each a plan (`tensor_cards` pins one); -sm auto takes
    the one measured fastest, layer mode included (rates given here; the next test measures real ones)."""
    layer = ctxq.plan(smollm2, 1024, simulate=SIM3, split_mode="layer")
    every = ctxq.plan(smollm2, 1024, simulate=SIM3, split_mode="tensor", tensor_cards=[0, 1, 2])
    two = ctxq.plan(smollm2, 1024, simulate=SIM3, split_mode="tensor", tensor_cards=[0, 1])
    assert every.left_out is None and len(every.gpus) == 3
    assert len(two.gpus) == 2 and two.left_out[0]["why"].startswith("the smallest by memory")
    assert " -dev RPC0,RPC1 " in two.llama_flags()
    for plan, pp, tg in ((layer, [100.0], [10.0]), (every, [120.0], [10.0]), (two, [300.0], [20.0])):
        speed_store.save(plan, speed_store.Measured(plan.split_mode, plan.tensor_split, 32, 4, 0, pp, tg))
    p = ctxq.plan(smollm2, 1024, simulate=SIM3, split_mode="auto")
    assert p.split_mode == "tensor" and p.llama_devices == ["RPC0", "RPC1"] and p.tensor_split == two.tensor_split
    assert "chosen by measurement" in p.reason
    note = next(n for n in p.notes if n.startswith("split mode: measured"))
    assert note.endswith("chosen") and "not measured" not in note
    assert [c["measured_s"] is not None for c in p.speed["tensor_candidates"]] == [True, True]
    # layer mode measured faster than every candidate: layer mode
    speed_store.save(layer, speed_store.Measured("layer", layer.tensor_split, 32, 4, 1, [1000.0], [100.0]))
    assert ctxq.plan(smollm2, 1024, simulate=SIM3, split_mode="auto").split_mode == "layer"
    with pytest.raises(ctxq.CtxqError, match="give 2 or more of the cards 0 to 2"):
        ctxq.plan(smollm2, 1024, simulate=SIM3, split_mode="tensor", tensor_cards=[0, 5])
    with pytest.raises(ctxq.CtxqError, match="give it with split_mode=tensor"):
        ctxq.plan(smollm2, 1024, simulate=SIM3, tensor_cards=[0, 1])


@pytest.mark.slow
def test_bench_measures_every_tensor_candidate_over_three_workers(smollm2, home):
    """A real bench over three loopback workers: layer mode, tensor mode over every card and over the two larger,
    each measured; -sm auto then takes the least measured time among the three."""
    r = run_ctxq("bench", str(smollm2), "--ctx", "1024", "--simulate", SIM3, "-p", "32", "-n", "4", "-r", "1",
                 "--json", env={"CTXQ_HOME": str(home)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert [(row["mode"], bool(row["left_out"])) for row in rows] == [("layer", False), ("tensor", False),
                                                                      ("tensor", True)]
    assert all(row["measured"] and row["pp_mean"] > 0 and row["tg_mean"] > 0 for row in rows)
    assert "-dev RPC0,RPC1" in rows[2]["plan"]
    total = [1024 / row["pp_mean"] + 128 / row["tg_mean"] for row in rows]
    best = rows[total.index(min(total))]
    p = ctxq.plan(smollm2, 1024, simulate=SIM3, split_mode="auto")
    assert (p.split_mode, bool(p.left_out)) == (best["mode"], bool(best["left_out"])), (total, p.notes)
