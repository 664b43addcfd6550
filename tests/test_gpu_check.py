"""The CPU-side parts of the prepared GPU check (scripts/gpu_check.sh, issue 14): argument handling, the
NVML sampler against a fake reading source, per-process peak bookkeeping, the stage budget, the table,
and the planned-vs-printed comparison end to end on llama.cpp's CPU backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_stages  # noqa: E402
from gpu_check import allot, main, run_stages, summary  # noqa: E402
from gpu_nvml import Reading, Sampler  # noqa: E402
from gpu_stages import Stage, StageTimeout, cell_child, compare_cell, compare_workers, supervised  # noqa: E402

MiB, GiB = 2**20, 2**30


# --- arguments ---------------------------------------------------------------------------------------

def test_checks_needs_an_out_folder(capsys):
    with pytest.raises(SystemExit) as e:
        main(["checks"])
    assert e.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_unknown_stage_is_refused_with_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["checks", "--out", str(tmp_path), "--stages", "doctor,warp"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "warp" in err and "doctor, cells, workers, split, speed, spill" in err
    assert not (tmp_path / "gpu_check.json").exists()


def test_negative_deadline_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["checks", "--out", str(tmp_path), "--deadline-s", "-1"])
    assert "--deadline-s" in capsys.readouterr().err


def test_failed_build_records_every_stage_as_skipped(tmp_path, capsys):
    (tmp_path / "build.json").write_text(json.dumps({"build_s": 361, "rc": 124}))
    assert main(["checks", "--out", str(tmp_path), "--failed-build", "--stages", "doctor,cells"]) == 0
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["build"]["rc"] == 124
    assert {n: s["status"] for n, s in res["stages"].items()} == {"doctor": "skipped", "cells": "skipped"}
    assert "build: 361 s (exit 124)" in capsys.readouterr().out


def test_shell_script_without_a_step_prints_its_usage():
    r = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 2
    assert "prepare|run" in r.stderr


# --- the NVML sampler ------------------------------------------------------------------------------

def _fake(readings):
    it = iter(readings)
    last = [readings[-1]]

    def read():
        r = next(it, last[0])
        if isinstance(r, Exception):
            raise r
        return r
    return read


def test_sampler_keeps_the_baseline_and_each_process_peak():
    s = Sampler(_fake([Reading(500, {7: 300}), Reading(900, {7: 700, 8: 100}), Reading(800, {7: 400, 8: 250})]))
    for _ in range(3):
        s.sample()
    assert s.baseline == 500 and s.first == {7: 300}
    assert s.peak_used == 900 and s.peak_delta == 400
    assert s.peaks == {7: 700, 8: 250}  # each process's own maximum, not the one at the device's peak
    assert s.peak_of(8) == 250 and s.peak_of(9) is None and s.peak_of(None) is None


def test_sampler_records_failed_reads_and_goes_on():
    s = Sampler(_fake([Reading(10, {}), RuntimeError("NVML_ERROR_GPU_IS_LOST"), Reading(30, {1: 5})]))
    for _ in range(3):
        s.sample()
    assert s.samples == 2 and s.peak_used == 30
    assert s.errors == ["RuntimeError: NVML_ERROR_GPU_IS_LOST"]
    assert s.to_dict()["peaks_by_pid"] == {"1": 5}


def test_sampler_thread_samples_until_stopped():
    calls = []

    def read():
        calls.append(1)
        return Reading(len(calls) * MiB, {42: len(calls)})

    with Sampler(read, interval_s=0.001) as s:
        while len(calls) < 20:
            pass
    n = len(calls)
    assert s.samples == n >= 20  # the start, the thread's readings and the last one at stop()
    assert s.peak_of(42) == n and s.baseline == MiB
    import time
    time.sleep(0.02)
    assert len(calls) == n  # stopped


def test_worker_headroom_against_declared_sizes():
    s = Sampler(_fake([Reading(0, {11: 500 * MiB, 12: 500 * MiB}), Reading(0, {11: 15 * GiB, 12: 8 * GiB + MiB})]))
    s.sample(), s.sample()
    ws = [{"pid": 11, "endpoint": "127.0.0.1:5001", "declared": 16 * GiB},
          {"pid": 12, "endpoint": "127.0.0.1:5002", "declared": 8 * GiB},
          {"pid": 13, "endpoint": "127.0.0.1:5003", "declared": 8 * GiB}]
    res = {"plan": {"gpus": [{"device": {"endpoint": e, "name": f"RPC{i}[{e}]"}, "total": t, "layers": list(range(k))}
                             for i, (e, t, k) in enumerate([("127.0.0.1:5001", 14 * GiB, 12),
                                                            ("127.0.0.1:5002", 7 * GiB, 6)])]},
           "memory": [{"name": "RPC0[127.0.0.1:5001]", "reported": 13 * GiB}]}
    rows = compare_workers(res, ws, s)
    assert [r["headroom"] for r in rows] == [GiB, -MiB, None]
    assert [r["exceeded"] for r in rows] == [False, True, None]
    assert rows[0]["printed"] == 13 * GiB and rows[0]["layers"] == 12 and rows[2]["planned_total"] is None


# --- budgets --------------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_allotment_holds_back_the_later_stages_minimum():
    names = ["doctor", "cells", "workers", "speed"]
    assert allot(names, 1000, 0) == 30  # its cap
    assert allot(names, 200, 1) == 200 - 60 - 40  # workers' and speed's minimums held back
    assert allot(names, 50, 3) == 50
    assert allot(names, 20, 1) == 0


def test_an_overrunning_stage_is_cut_and_the_next_still_runs(tmp_path):
    clock = Clock()

    def slow(stage: Stage, out):
        partial = {"rows": [1]}
        clock.t += stage.allotted_s + 1
        try:
            stage.check()
        except StageTimeout as e:
            e.partial = partial
            raise

    def boom(stage, out):
        raise ValueError("no GPU")

    def fine(stage, out):
        clock.t += 5
        return {"answer": 42}

    results = {"stages": {}}
    run_stages(["doctor", "cells", "speed"], {"doctor": boom, "cells": slow, "speed": fine}, 400, tmp_path, results,
               clock=clock)
    st = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert st["doctor"]["status"] == "error" and "no GPU" in st["doctor"]["why"]
    assert st["cells"]["status"] == "cut" and st["cells"]["result"] == {"rows": [1]}
    assert st["speed"]["status"] == "ok" and st["speed"]["result"] == {"answer": 42}


def test_a_stage_left_without_time_is_skipped(tmp_path):
    clock = Clock()

    def eat(stage, out):
        clock.t += 100
        return {}

    results = run_stages(["doctor", "speed"], {"doctor": eat, "speed": eat}, 105, tmp_path, {"stages": {}},
                         clock=clock)
    assert results["stages"]["speed"]["status"] == "skipped"


# --- the table --------------------------------------------------------------------------------------

def _cell(peak):
    return {"geometry": "llama3-8b", "kv": "q8_0", "n_ctx": 65536, "placement": "gpu",
            "gpu_planned": {"margin": 512 * MiB}, "gpu_planned_total": 9000 * MiB, "gpu_printed_total": 8400 * MiB,
            "nvml_peak": peak, "unaccounted": None if peak is None else peak - 8400 * MiB,
            "fits": None if peak is None else peak <= 9000 * MiB}


def test_summary_table_shows_cells_workers_and_speed():
    res = {"build": {"build_s": 251, "rc": 0}, "stages": {
        "doctor": {"status": "ok", "result": {"nvidia_gpus": [], "nvml_error": "none here", "cuda_comm": {
            "library": "/x/libggml-cuda.so", "nccl": True, "nccl_soname": "libnccl.so.2", "allreduce": "nccl",
            "peer_access": True}}},
        "cells": {"status": "cut", "result": {"rows": [_cell(8900 * MiB), _cell(9100 * MiB), _cell(None)]}},
        "workers": {"status": "ok", "result": {"runs": [
            {"geometry": "llama3-8b", "n_ctx": 65536, "n_prompt": 65472, "status": "ok", "workers": [
                {"endpoint": "127.0.0.1:1", "declared": 8 * GiB, "layers": 5, "planned_total": 7 * GiB,
                 "printed": 6 * GiB, "nvml_peak": 8 * GiB + MiB, "headroom": -MiB, "exceeded": True}]},
            {"geometry": "llama3-70b", "n_ctx": 65536, "status": "DoesNotFit: 65536 tokens do not fit"}]}},
        "speed": {"status": "ok", "result": {"n_ctx": 65536, "plain": {"prefill_tps": 20000.0, "decode_tps": 400.0},
                                             "ctxq": {"n_prompt": 60000, "prefill_tps": 19800.0, "decode_tps": 396.0,
                                                      "ttft_s": 3.14}}}}}
    text = summary(res)
    assert "build: 251 s (exit 0)" in text and "cells cut" in text
    assert "multi-GPU: NCCL linked (libnccl.so.2); all-reduce nccl; peer access True" in text
    lines = [l for l in text.splitlines() if l.startswith("llama3-8b  q8_0")]
    assert [l.split()[-1] for l in lines] == ["yes", "NO", "-"]
    assert "8900" in lines[0] and "500" in lines[0]  # NVML peak and what llama.cpp did not print
    assert "EXCEEDED" in text and "-1" in text
    assert "llama3-70b at 65536 ctx, ? tokens prefilled, workers: ?: DoesNotFit" in text
    assert "0.990" in text and "time to first token (ctxq run, 65536 ctx): 3.14 s" in text


def test_table_command_reads_a_results_file(tmp_path, capsys):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"build": None, "stages": {"doctor": {"status": "skipped"}}}))
    assert main(["table", str(f)]) == 0
    assert "stages: doctor skipped" in capsys.readouterr().out


# --- planned vs printed, end to end on the CPU -------------------------------------------------------------

def test_cell_list_runs_all_gpu_cells_first():
    from gpu_runs import cell_list

    cells = cell_list()
    assert len(cells) == 3 * 2 * 2 * 2
    assert [c[3] for c in cells[:12]] == ["gpu"] * 12 and cells[0][2] == 4096


def test_planned_vs_printed_on_llama_cpp_cpu_backend(tmp_path):
    """A real load and prefill through the same child as the GPU cells, with no GPU: the host's planned
    KV equals llama.cpp's printed KV, its weights agree within 1 %, every layer is on the CPU."""
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    model = str(write_synthetic_gguf(tmp_path / "tiny.gguf", GEOMETRIES["tiny"]))
    s = Sampler(lambda: Reading(123, {}))
    res, pid = supervised(cell_child, model, 4096, "q8_0", "cpu", 1024, sampler=s, timeout=120)
    assert isinstance(pid, int) and pid > 0 and s.samples >= 2
    assert res["n_prefill"] == 1024 and res["prefill_s"] > 0
    assert any("KV buffer size" in l for l in res["log"])
    row = compare_cell(res, s.peak_delta)
    hp, hr = row["host_planned"], row["host_printed"]
    assert hr["kv"] == hp["kv"] > 0
    assert abs(hr["weights"] - hp["weights"]) <= 0.01 * hp["weights"]
    assert row["layers_planned_gpu"] == row["layers_printed_gpu"] == 0
    assert len(res["printed"]["layers"]) == GEOMETRIES["tiny"].n_layer + 1
    assert row["nvml_peak"] == 0 and row["unaccounted"] == 0  # the fake device never changed


def test_smollm2_rebuilt_from_its_header_loads_and_decodes(tmp_path, smollm2):
    """prepare carries only SmolLM2's header; the run rebuilds a full-size file that llama.cpp loads and
    whose greedy decode is not stuck on one token."""
    from ctxq.gguf.reader import read_gguf
    from ctxq.rpc import generate_greedy, run_supervised

    head = gpu_stages.smollm2_header(tmp_path / "h.gguf", smollm2)
    assert head.stat().st_size < 4 * MiB
    model = gpu_stages.rebuild_with_random_weights(head, tmp_path / "s.gguf")
    assert model.stat().st_size == smollm2.stat().st_size
    assert [t.name for t in read_gguf(model).tensors] == [t.name for t in read_gguf(smollm2).tensors]
    g = run_supervised(generate_greedy, str(model), "The capital of France is", 8, n_ctx=256, timeout=120)
    assert len(g.tokens) == 8 and len(set(g.tokens)) > 1


# --- the stages' own loops, dry-run on the CPU (RSS stands in for NVML's per-process bytes) -------------

def _rss_reader():
    import psutil

    def read():
        procs = {}
        for p in psutil.Process().children(recursive=True):
            try:
                procs[p.pid] = p.memory_info().rss
            except psutil.Error:  # ended between the listing and the reading
                pass
        return Reading(sum(procs.values()), procs)
    return read, None


@pytest.fixture
def cpu_matrix(tmp_path, smollm2):
    from gpu_runs import Matrix

    return Matrix(geometries=("tiny",), cell_ctx=(4096,), cell_kv=("q8_0",), placements=("cpu",), n_prefill=600,
                  worker_device="CPU", worker_gib=(1, 0.5), worker_ctx=4096, worker_models=(("tiny", 1000),),
                  speed_tokens=1500, speed_ctx=4096, speed_predict=8, split_geometry="smollm2", split_gib=(1, 0.5),
                  split_ctx=2048, split_bench=(64, 4, 1),
                  smollm2_header=gpu_stages.smollm2_header(tmp_path / "h.gguf", smollm2), reader=_rss_reader)


def test_doctor_stage_reads_ctxq_doctor_json(tmp_path):
    from gpu_runs import doctor

    d = doctor(Stage("doctor", 60), tmp_path)
    assert d["features"]["rpc"] is True and "ggml_devices" in d
    assert json.loads((tmp_path / "doctor.json").read_text()) == d


def test_cells_stage_on_cpu(tmp_path, cpu_matrix):
    from gpu_runs import cells

    r = cells(Stage("cells", 120), tmp_path, cpu_matrix)
    assert r["errors"] == [] and len(r["rows"]) == 1
    row = r["rows"][0]
    assert row["nvml_source"] == "process" and row["nvml_peak"] > 10 * MiB  # the child's RSS, by its pid
    assert row["host_printed"]["kv"] == row["host_planned"]["kv"] > 0
    assert "tiny q8_0 4096 cpu" in (tmp_path / "llama.log").read_text()


def test_workers_stage_with_ctxq_worker_processes_on_cpu(tmp_path, cpu_matrix):
    import os

    from gpu_runs import workers

    r = workers(Stage("workers", 150), tmp_path, cpu_matrix)
    (run,) = r["runs"]
    assert run["status"] == "ok", run["status"]
    assert r["worker_command"] in ("ctxq worker", "python -m ctxq.rpc")
    rows = run["workers"]
    assert [w["declared"] for w in rows] == [GiB, GiB // 2]
    assert sum(w["layers"] for w in rows) == 5  # the tiny model's 4 layers and its output head
    assert all(w["printed"] and w["nvml_peak"] and w["headroom"] == w["declared"] - w["nvml_peak"] for w in rows)
    assert not any(w["exceeded"] for w in rows)
    assert run["timings"]["prefill_s"] > 0
    for w in r["workers"]:  # stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(w["pid"], 0)


@pytest.mark.slow
def test_speed_stage_ctxq_run_against_plain_llama_on_cpu(tmp_path, cpu_matrix):
    from gpu_runs import speed

    r = speed(Stage("speed", 300), tmp_path, cpu_matrix)
    assert 1000 < r["n_prompt"] <= 1500
    assert r["ctxq"]["n_prompt"] == r["plain"]["n_prompt"] or abs(r["ctxq"]["n_prompt"] - r["plain"]["n_prompt"]) <= 1
    assert r["ctxq"]["prefill_tps"] > 0 and r["plain"]["prefill_tps"] > 0 and r["ctxq"]["ttft_s"] > 0
    assert "ratio" in summary({"stages": {"speed": {"status": "ok", "result": r}}})


def test_split_stage_both_modes_on_cpu_workers(tmp_path, cpu_matrix):
    """Both split modes benched on two `ctxq worker` processes (SmolLM2's layout: ctxq's tiny geometry, 256-wide
    Q4_K rows, aborts in llama.cpp's tensor mode load with "tensor write out of bounds" even at 1:1): each worker's
    peak (its RSS here) within its declared size and its card listed in each mode's plan; tensor mode's proportions uneven as the sizes are; the
    measured rates in the summary; the auto plan's choice recorded; the workers stopped."""
    import os

    from gpu_runs import split

    r = split(Stage("split", 300), tmp_path, cpu_matrix)
    assert set(r["modes"]) == {"layer", "tensor"}
    for mode, row in r["modes"].items():
        assert row["status"] == "ok", (mode, row["status"])
        bench = {b["mode"]: b for b in row["bench"]}[mode]
        assert bench["pp_mean"] > 0 and bench["tg_mean"] > 0
        assert [w["declared"] for w in row["workers"]] == [GiB, GiB // 2]
        assert all(w["planned_total"] and w["nvml_peak"] and not w["exceeded"] for w in row["workers"])
    ts = r["modes"]["tensor"]["tensor_split"]
    assert len(ts) == 2 and ts[0] > ts[1] > 0
    assert r["auto"]["split_mode"] in ("layer", "tensor")
    text = summary({"stages": {"split": {"status": "ok", "result": r}}})
    assert "split modes, smollm2 at 2048 ctx" in text and "-sm auto takes:" in text
    for w in r["workers"]:
        with pytest.raises(ProcessLookupError):
            os.kill(w["pid"], 0)
