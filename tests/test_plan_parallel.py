"""Issue 29 part 5: the planner knows parallel sequences (`parallel=P`, `--parallel P`).

A parallel plan is the engine's context: one unified KV cache of n_ctx cells (kv_unified), n_seq_max = P,
n_outputs_max = P. Each plan here is loaded for real (llama.cpp's own log, on the CPU and over loopback RPC
workers) and compared per device: within 3 % or 2 MiB (tiny models), none under beyond the printed rounding.
"""

from __future__ import annotations

import json

import pytest

from ctxq.errors import InvalidOption
from ctxq.llama.accounting import accounting
from ctxq.planning.devices import Device
from ctxq.planning.options import PlanOptions
from ctxq.planning.planner import plan
from ctxq.rpc import start_workers
from ctxq.testing.accuracy import PRINTED, CellResult, check_cell
from ctxq.testing.hybrid import MAKERS
from ctxq.units import GiB

from .conftest import run_ctxq


def _rpc(n: int) -> list[Device]:
    return [Device(name=f"RPC{i}", kind="rpc", total=2 * GiB, usable=2 * GiB) for i in range(n)]


def _assert_close(r: CellResult) -> None:
    assert r.layers_match, r.layer_mismatch
    for dev in r.devices:
        detail = f"{r.label} {dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
        assert not dev.under, "under llama.cpp: " + detail
        assert dev.ok_tiny, detail


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return str(MAKERS["qwen35"](tmp_path_factory.mktemp("parallel") / "qwen35.gguf"))


def test_parallel_is_checked():
    for bad in (0, 257):
        with pytest.raises(InvalidOption, match="parallel must be 1 to 256"):
            PlanOptions(parallel=bad).resolved()


def test_the_plan_carries_the_engines_context_settings(smollm2, monkeypatch):
    # the rules' own terms (the split referee would put llama.cpp's figures in their place: the host's compute
    # buffer itself 10 KB smaller with 8 output rows, checked against real loads in test_parallel_plan_matches_llama_cpp_on_two_rpc_devices)
    monkeypatch.setenv("CTXQ_SPLIT_CHECK", "0")
    one = plan(smollm2, 16384, devices=_rpc(2), kv="f16", split="1:1")
    par = plan(smollm2, 16384, devices=_rpc(2), kv="f16", split="1:1", parallel=8)
    assert (one.n_seq_max, one.kv_unified, one.n_outputs_max) == (1, False, 0)
    assert (par.n_seq_max, par.kv_unified, par.n_outputs_max) == (8, True, 8)
    assert "-np" not in one.llama_flags() and par.llama_flags().endswith(" -np 8 -kvu")
    assert par.context_settings() == dict(n_seq_max=8, kv_unified=True, n_outputs_max=8)
    # unified: the same n_ctx cells for all; 8 rows of logits on the host, not one
    assert [g.kv for g in par.gpus] == [g.kv for g in one.gpus]
    n_vocab = 49152
    assert par.host.compute - one.host.compute == 7 * n_vocab * 4
    # the output device's reserved graph outputs 8 rows, not n_ubatch (512): about 94 MiB less
    assert one.gpus[1].compute - par.gpus[1].compute > 80 * 2**20


def test_referee_accounts_the_parallel_context(smollm2):
    acc = accounting(smollm2, n_ctx=4096, n_seq_max=8, kv_unified=True, n_outputs_max=8)
    assert acc.output_bytes == 8 * 49152 * 4  # llama_context::output_reserve(n_seq_max)
    # the strict referee (the suite sets CTXQ_REFEREE=strict) passes the parallel plan
    assert plan(smollm2, 4096, devices=[], parallel=8).n_seq_max == 8


@pytest.mark.parametrize("parallel", [1, 8])
def test_parallel_plan_matches_llama_cpp_on_the_cpu(smollm2, parallel):
    _assert_close(check_cell(str(smollm2), 16384, "f16", None, label=f"smollm2 cpu P={parallel}", parallel=parallel))


@pytest.mark.parametrize("parallel", [1, 8])
def test_parallel_plan_matches_llama_cpp_on_two_rpc_devices(smollm2, parallel):
    with start_workers(2) as w:
        _assert_close(check_cell(str(smollm2), 16384, "f16", [1, 1], workers=w, label=f"smollm2 rpc2 P={parallel}",
                                 parallel=parallel))


def test_recurrent_state_scales_with_the_sequences(qwen35):
    """One recurrent state per sequence (llama_memory_recurrent holds max(1, n_seq_max) cells), real on RPC."""
    with start_workers(2) as w:
        one = check_cell(qwen35, 16384, "f16", [1, 1], workers=w, label="qwen35 rpc2 P=1", parallel=1)
        eight = check_cell(qwen35, 16384, "f16", [1, 1], workers=w, label="qwen35 rpc2 P=8", parallel=8)
    for r in (one, eight):
        _assert_close(r)
    for a, b in zip(one.devices[:2], eight.devices[:2]):
        assert a.real["state"] > 0  # printed in MiB with 2 decimals: each within PRINTED
        assert abs(b.real["state"] - 8 * a.real["state"]) <= 9 * PRINTED
        assert b.planned["state"] == 8 * a.planned["state"]


def test_ctxq_plan_parallel_flag(smollm2):
    r = run_ctxq("plan", str(smollm2), "--ctx", "8192", "--parallel", "4", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["n_seq_max"], d["kv_unified"], d["n_outputs_max"]) == (4, True, 4)
    assert d["llama_flags"].endswith("-np 4 -kvu")
    r = run_ctxq("plan", str(smollm2), "--ctx", "8192", "--parallel", "4")
    assert r.returncode == 0 and "context 8,192 tokens shared by 4 sequences," in r.stdout, r.stdout


def test_parallel_is_refused_where_one_sequence_runs(smollm2):
    import ctxq

    with pytest.raises(InvalidOption, match="one sequence"):
        ctxq.load(smollm2, 4096, parallel=4)
    r = run_ctxq("run", str(smollm2), "-c", "1024", "-p", "hi", "-n", "1", "--parallel", "4")
    assert r.returncode != 0 and "--parallel is for several questions" in r.stderr, r.stderr
