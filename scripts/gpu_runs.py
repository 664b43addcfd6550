"""The five stages of scripts/gpu_check.py. Each takes (Stage, out dir), fills a result dict as it goes
and, when cut or failed, hands what it has to the caller on the exception (`partial`)."""

from __future__ import annotations

import functools
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpu_nvml import Sampler
from gpu_stages import (PLACEMENTS, Stage, StageTimeout, cell_child, compare_cell, compare_workers, gpu_env,
                        nvml_or_fake, plain_child, rebuild_with_random_weights, rpc_run_child, supervised, write_log)

CTXQ = [sys.executable, "-c", "from ctxq.cli import main; main()"]  # the `ctxq` console script's entry


@dataclass(frozen=True)
class Matrix:
    """What the stages measure; the defaults are the GPU run's, tests shrink them to run on the CPU."""

    geometries: tuple[str, ...] = ("llama3-8b", "qwen2.5-7b", "gemma2-9b")  # three archs; gemma2 has SWA
    cell_ctx: tuple[int, ...] = (4096, 65536)
    cell_kv: tuple[str, ...] = ("f16", "q8_0")
    placements: tuple[str, ...] = PLACEMENTS
    n_prefill: int = 1024  # two ubatches of 512 (the planner's default n_ubatch): compute buffers in use
    worker_device: str = "CUDA0"
    worker_gib: tuple[float, ...] = (16, 16, 16, 8, 8)
    worker_ctx: int = 65536
    # The 8B prefills the whole context; the 70B (about 40 GiB of weights sent over loopback) gets a
    # shorter prefill so that it fits the stage: its buffers are all reserved at load.
    worker_models: tuple[tuple[str, int], ...] = (("llama3-8b", 65536 - 64), ("llama3-70b", 4096))
    speed_tokens: int = 60000
    speed_ctx: int = 65536
    speed_predict: int = 64
    # the split stage: both split modes on RPC workers serving one GPU (uneven declared sizes), each worker's peak
    # against its card in the plan, and the modes' measured speed beside the planner's estimate
    split_geometry: str = "llama3-8b"  # or "smollm2": its layout with random weights
    split_gib: tuple[float, ...] = (16, 8)
    split_ctx: int = 16384
    split_bench: tuple[int, int, int] = (512, 16, 2)  # ctxq bench -p, -n, -r
    smollm2_header: Path | None = None  # default: $GPU_DIR/smollm2-header.gguf
    # the spill stage (issue 53): a model one size too big for the card, both placements at 32k
    spill_geometry: str = "llama3-8b"
    spill_ctx: int = 32768
    spill_prompt: int = 32768 - 64
    spill_ubatches: tuple[int, ...] = (512, 2048)  # issue 61: the copies of host weights per micro-batch
    reader: Callable = nvml_or_fake  # () -> (read, why-not-NVML or None)


GPU_RUN = Matrix()


def keeps_partial(fn):
    def wrapper(stage: Stage, out: Path, m: Matrix = GPU_RUN):
        result: dict = {}
        try:
            return fn(stage, out, result, m)
        except Exception as e:
            e.partial = result
            raise
    return functools.wraps(fn)(wrapper)


def _models_dir() -> Path:
    d = Path(tempfile.gettempdir()) / "gpu-check-models"  # sparse files: never under $OUT
    d.mkdir(exist_ok=True)
    return d


def _synthetic(name: str) -> str:
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    path = _models_dir() / f"{name}.gguf"
    if not path.exists():  # written aside and renamed: a run cut mid-write leaves no broken model behind
        write_synthetic_gguf(path.with_suffix(".part"), GEOMETRIES[name]).rename(path)
    return str(path)


def doctor(stage: Stage, out: Path) -> dict:
    r = subprocess.run([*CTXQ, "doctor", "--json"], capture_output=True, text=True, env=gpu_env(),
                       timeout=max(1.0, stage.left()))
    (out / "doctor.json").write_text(r.stdout)
    if r.returncode:
        raise RuntimeError(f"ctxq doctor exited {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def cell_list(m: Matrix = GPU_RUN) -> list[tuple[str, str, int, str]]:
    """All-GPU cells first, short contexts first: a cut run keeps the broadest picture."""
    return [(g, kv, ctx, pl) for pl in m.placements for ctx in m.cell_ctx for kv in m.cell_kv for g in m.geometries]


@keeps_partial
def cells(stage: Stage, out: Path, result: dict, m: Matrix) -> dict:
    read, why = m.reader()
    result.update(rows=[], errors=[], nvml=why or "ok")
    for geo, kv, ctx, placement in cell_list(m):
        stage.check(15)
        label = f"{geo} {kv} {ctx} {placement}"
        sampler = Sampler(read)
        try:
            res, pid = supervised(cell_child, _synthetic(geo), ctx, kv, placement, m.n_prefill, sampler=sampler,
                                  timeout=stage.left() - 5)
        except Exception as e:
            if "longer than" in str(e):
                raise StageTimeout(f"cells: cut during {label}") from None
            result["errors"].append(f"{label}: {e}")
            continue
        peak = sampler.peak_of(pid)
        row = {"geometry": geo, "kv": kv, "n_ctx": ctx, "placement": placement, "pid": pid,
               "nvml_source": "process" if peak is not None else "device delta",
               **compare_cell(res, peak if peak is not None else (sampler.peak_delta if not why else None)),
               "load_s": res["load_s"], "prefill_s": res["prefill_s"], "sampler": sampler.to_dict()}
        result["rows"].append(row)
        write_log(out / "llama.log", label, res["log"])
        print(f"  {label}: planned {row['gpu_planned_total'] / 2**20:.0f} MiB, printed "
              f"{row['gpu_printed_total'] / 2**20:.0f}, NVML {(row['nvml_peak'] or 0) / 2**20:.0f}", flush=True)
    if result["errors"] and not result["rows"]:
        raise RuntimeError(f"every cell failed; the first: {result['errors'][0]}")
    return result


def _endpoint(p: subprocess.Popen, announced: bool, end: float, said: list[str]) -> str | None:
    """The endpoint a worker listens on: from `ctxq worker`'s announcement line, or (for `python -m ctxq.rpc`,
    which prints nothing) from the socket it opened; None when it exits first or the time is up."""
    from ctxq.rpc import listening_port

    while time.monotonic() < end and p.poll() is None:
        if announced:
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, end - time.monotonic()))
            line = p.stdout.readline() if ready else ""
            said.append(line)
            m = re.search(r"listening on (\S+)", line)
            if m:
                return m.group(1)
        else:
            port = listening_port(p.pid, "127.0.0.1")
            if port:
                return f"127.0.0.1:{port}"
            time.sleep(0.05)
    return None


def start_ctxq_workers(n: int, timeout_s: float, device: str = "CUDA0") -> tuple[list[dict], str]:
    """n worker processes serving `device` on loopback, each its own process (and CUDA context):
    `ctxq worker`, or the same server as `python -m ctxq.rpc` (start_workers' child) when the command
    fails at start; (workers, the command used)."""
    args = ["--port", "0", "--device", device, "--threads", "1"]
    for name, cmd, announced in (("ctxq worker", [*CTXQ, "worker"], True),
                                 ("python -m ctxq.rpc", [sys.executable, "-m", "ctxq.rpc"], False)):
        procs = [subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=gpu_env(), start_new_session=True) for _ in range(n)]
        end = time.monotonic() + timeout_s
        said: list[str] = []
        ws = [{"proc": p, "pid": p.pid, "endpoint": _endpoint(p, announced, end, said)} for p in procs]
        if all(w["endpoint"] for w in ws):
            return ws, name
        stop_workers(ws)
        first = next(w["proc"] for w in ws if not w["endpoint"])
        why = ("".join(said) + (first.stdout.read() or "")).strip()[-300:] or "no output"
        print(f"gpu_check: {name} did not start ({why})", flush=True)
    raise RuntimeError(f"no RPC worker could start on {device}")


def _release(ws: list[dict], result: dict) -> None:
    """Stop the stage's workers and record them (without their process handles) in its result."""
    stop_workers(ws)
    for w in ws:
        w.pop("proc", None)
    result["workers"] = ws


def stop_workers(workers: list[dict]) -> None:
    for w in workers:
        if w["proc"].poll() is None:
            w["proc"].send_signal(signal.SIGTERM)  # ctxq worker stops on SIGTERM (cli/worker.py)
    for w in workers:
        try:
            w["proc"].wait(3)
        except subprocess.TimeoutExpired:
            w["proc"].kill()
            w["proc"].wait()


@keeps_partial
def workers(stage: Stage, out: Path, result: dict, m: Matrix) -> dict:
    read, why = m.reader()
    ws, command = start_ctxq_workers(len(m.worker_gib), min(60.0, stage.left()), m.worker_device)
    result.update(runs=[], nvml=why or "ok", worker_command=command)
    try:
        for w, gib in zip(ws, m.worker_gib):
            w["declared"] = int(gib * 2**30)
        spec = ",".join(f"{w['endpoint']}={gib:g}" for w, gib in zip(ws, m.worker_gib))
        for geo, n_prompt in m.worker_models:
            stage.check(20)
            run = {"geometry": geo, "n_ctx": m.worker_ctx, "n_prompt": n_prompt}
            result["runs"].append(run)
            sampler = Sampler(read)
            try:
                # n_predict 0: sampling reads the vocabulary, which a synthetic GGUF lacks (llama.cpp
                # asserts type != LLAMA_VOCAB_TYPE_NONE); the prefill is what fills the buffers.
                res, _ = supervised(rpc_run_child, _synthetic(geo), spec, m.worker_ctx, n_prompt, 0, sampler=sampler,
                                    timeout=stage.left() - 5, gpu=False)
            except Exception as e:  # DoesNotFit (the plan says no), a cut, a lost worker: recorded
                run.update(status=f"{type(e).__name__}: {e}", sampler=sampler.to_dict())
                if "longer than" in str(e):
                    raise StageTimeout(f"workers: cut during {geo}") from None
                continue
            run.update(status="ok", workers=compare_workers(res, ws, sampler), sampler=sampler.to_dict(),
                       plan=res["plan"], timings={k: res[k] for k in ("load_s", "prefill_s", "ttft_s", "prefill_tps")})
            run["worker_baseline"] = {str(w["pid"]): sampler.first.get(w["pid"]) for w in ws}
    finally:
        _release(ws, result)
    return result


def _smollm2_random(m: Matrix) -> str:
    """SmolLM2's exact file with random weights, from the carried header."""
    header = m.smollm2_header or Path(os.environ.get("GPU_DIR", ".gpu")) / "smollm2-header.gguf"
    if not header.is_file():
        raise RuntimeError(f"{header} missing: run scripts/gpu_check.sh prepare and carry .gpu")
    return str(rebuild_with_random_weights(header, _models_dir() / "smollm2-random.gguf"))


@keeps_partial
def speed(stage: Stage, out: Path, result: dict, m: Matrix) -> dict:
    """SmolLM2's layout at ~60k tokens: the real `ctxq run` command against a plain `Llama` with the kwargs
    of the same plan (ctxq.rpc.generate_greedy), one run each, in fresh processes."""
    from bench_run import make_text

    model = _smollm2_random(m)
    text, n = make_text(model, m.speed_tokens)
    text_file = _models_dir() / "speed-prompt.txt"
    text_file.write_text(text)
    result.update(model="SmolLM2-135M layout, random weights", n_ctx=m.speed_ctx, n_prompt=n)
    stage.check(20)
    result["plain"], _ = supervised(plain_child, model, text, m.speed_ctx, m.speed_predict, sampler=None,
                                    timeout=stage.left() / 2)
    stage.check(10)
    r = subprocess.run([*CTXQ, "run", model, "-f", str(text_file), "-c", str(m.speed_ctx), "-n", str(m.speed_predict),
                        "--temp", "0", "--json"], capture_output=True, text=True, env=gpu_env(),
                       timeout=max(1.0, stage.left()))
    if r.returncode:
        raise RuntimeError(f"ctxq run exited {r.returncode}: {r.stderr.strip()[-300:]}")
    d = json.loads(r.stdout)
    result["ctxq"] = {k: d[k] for k in ("n_prompt", "n_generated", "prefill_s", "decode_s", "ttft_s", "prefill_tps",
                                        "decode_tps", "stop")}
    return result


def _ctxq_json(args: list[str], timeout: float):
    r = subprocess.run([*CTXQ, *args, "--json"], capture_output=True, text=True, timeout=max(1.0, timeout))
    if r.returncode:
        raise RuntimeError(f"ctxq {args[0]} exited {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


@keeps_partial
def split(stage: Stage, out: Path, result: dict, m: Matrix) -> dict:
    """`ctxq bench -sm layer` and `-sm tensor` of the split geometry on RPC workers serving one device: per mode,
    each worker's peak (NVML, by its pid) against its card's total in `ctxq plan -sm MODE` and its declared size,
    the measured pp/tg beside the plan's estimate; then which mode `ctxq plan -sm auto` takes by the measurements.
    Both cards share one GPU and talk over loopback: the memory is each card's own, the speeds are not a real
    interconnect's."""
    read, why = m.reader()
    model = _smollm2_random(m) if m.split_geometry == "smollm2" else _synthetic(m.split_geometry)
    ws, command = start_ctxq_workers(len(m.split_gib), min(60.0, stage.left()), m.worker_device)
    result.update(geometry=m.split_geometry, n_ctx=m.split_ctx, nvml=why or "ok", worker_command=command, modes={})
    try:
        for w, gib in zip(ws, m.split_gib):
            w["declared"] = int(gib * 2**30)
        spec = ",".join(f"{w['endpoint']}={gib:g}" for w, gib in zip(ws, m.split_gib))
        base = [model, "-c", str(m.split_ctx), "--rpc", spec]
        n_p, n_g, reps = m.split_bench
        for mode in ("layer", "tensor"):
            stage.check(20)
            row = result["modes"][mode] = {}
            try:
                plan = _ctxq_json(["plan", *base, "-sm", mode], stage.left())
            except Exception as e:  # DoesNotFit, a refused mode: recorded, the other mode still runs
                row["status"] = f"{type(e).__name__}: {e}"
                continue
            row.update(tensor_split=plan["tensor_split"], llama_flags=plan["llama_flags"])
            sampler = Sampler(read)
            with sampler:
                got = _ctxq_json(["bench", *base, "-sm", mode, "-p", str(n_p), "-n", str(n_g), "-r", str(reps)],
                                 stage.left() - 5)
            by_ep = {g["device"].get("endpoint"): g for g in plan["gpus"]}
            row["workers"] = [{"endpoint": w["endpoint"], "declared": w["declared"],
                               "planned_total": by_ep.get(w["endpoint"], {}).get("total"),
                               "nvml_peak": sampler.peak_of(w["pid"]),
                               "baseline": sampler.first.get(w["pid"])} for w in ws]
            for r in row["workers"]:
                r["exceeded"] = None if r["nvml_peak"] is None else r["nvml_peak"] > r["declared"]
            row.update(status="ok", bench=got)
        stage.check(10)
        auto = _ctxq_json(["plan", *base, "-sm", "auto"], stage.left())
        result["auto"] = {"split_mode": auto["split_mode"], "reason": auto["reason"], "notes": auto["notes"]}
        for mode, row in result["modes"].items():  # the planner's estimate of each mode, beside its measurement
            row["estimate"] = (auto.get("speed") or {}).get(mode)
    finally:
        _release(ws, result)
    return result


@keeps_partial
def spill(stage: Stage, out: Path, result: dict, m: Matrix) -> dict:
    """Issues 53 and 61 on a real card declared smaller than the model (`--reserve`: the card's free memory less
    four fifths of the weights): for each placement (FFN weights in host memory; whole layers on the CPU), the
    prefill of spill_prompt tokens at each of spill_ubatches (`ctxq bench -ub 512,2048`: the copies of host weights
    per micro-batch), then decoding at a short and at a spill_prompt-token depth; each measurement beside the plan's
    own estimate for the same workload (`ctxq plan --prompt-tokens --gen-tokens`). mmap'd (pageable) weights: ctxq
    plans load with mmap, as llama.cpp's tools do by default."""
    from ctxq.gguf.info import model_info
    from ctxq.units import GiB

    model = _synthetic(m.spill_geometry)
    info = model_info(model)
    gpus = [d for d in _ctxq_json(["doctor"], stage.left())["ggml_devices"] if d.get("type") in ("gpu", "igpu")]
    if not gpus:
        raise RuntimeError("no GPU among ggml's devices")
    free = float(gpus[0]["free"])
    room = sum(la.weight_bytes for la in info.layers) * 0.8  # a fifth of the weights does not fit
    reserve = max(0.0, (free - room) / GiB)
    common = [model, "-c", str(m.spill_ctx), "--reserve", f"{reserve:.2f}"]
    ubs = ",".join(str(u) for u in m.spill_ubatches)
    result.update(model=m.spill_geometry, n_ctx=m.spill_ctx, reserve_gib=round(reserve, 2), ubatches=ubs)
    for how in ("weights", "layers"):
        row = result[how] = {"estimate": {}, "bench": {}}
        for ub in m.spill_ubatches:  # the plan's own estimate of each measured setting
            stage.check(10)
            p = _ctxq_json(["plan", *common, "--offload", how, "-ub", str(ub), "-b", str(max(ub, 2048)),
                            "--prompt-tokens", str(m.spill_prompt), "--gen-tokens", "32"], stage.left())
            row["estimate"][ub] = {"cpu_layers": p["cpu_layers"], "cpu_ffn_layers": len(p["cpu_ffn_layers"]),
                                   **{k: p["speed"]["read"].get(k) for k in ("prefill_s", "decode_tps")}}
        stage.check(15)
        row["bench"]["prefill"] = _ctxq_json(["bench", *common, "--offload", how, "-ub", ubs, "-b", "2048",
                                              "-p", str(m.spill_prompt), "-n", "0", "-r", "1"], stage.left())
        for depth in (0, m.spill_prompt):  # decoding: at a short and at a long depth
            stage.check(10)
            row["bench"][f"decode_d{depth}"] = _ctxq_json(["bench", *common, "--offload", how, "-p", "0", "-n",
                                                           "32", "-d", str(depth), "-r", "1"], stage.left())
    return result


STAGE_FUNCS = {"doctor": doctor, "cells": cells, "workers": workers, "speed": speed, "split": split, "spill": spill}
