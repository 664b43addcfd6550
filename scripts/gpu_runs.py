"""The four stages of scripts/gpu_check.py. Each takes (Stage, out dir), fills a result dict as it goes
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
from pathlib import Path

from gpu_check import Stage, StageTimeout
from gpu_nvml import Sampler
from gpu_stages import (PLACEMENTS, cell_child, compare_cell, compare_workers, gpu_env, nvml_or_fake, plain_child,
                        rpc_run_child, supervised, write_log)

CTXQ = [sys.executable, "-c", "from ctxq.cli import main; main()"]  # the `ctxq` console script's entry
CELL_GEOMETRIES = ("llama3-8b", "qwen2.5-7b", "gemma2-9b")  # three architectures; gemma2 has sliding windows
CELL_CTX = (4096, 65536)
CELL_KV = ("f16", "q8_0")
N_PREFILL = 1024  # two ubatches of 512 (the planner's default n_ubatch): the compute buffers are in use
WORKER_GIB = (16, 16, 16, 8, 8)
WORKER_CTX = 65536
SPEED_TOKENS, SPEED_CTX, SPEED_PREDICT = 60000, 65536, 64


def keeps_partial(fn):
    def wrapper(stage: Stage, out: Path):
        result: dict = {}
        try:
            return fn(stage, out, result)
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
    return str(path if path.exists() else write_synthetic_gguf(path, GEOMETRIES[name]))


def doctor(stage: Stage, out: Path) -> dict:
    r = subprocess.run([*CTXQ, "doctor", "--json"], capture_output=True, text=True, env=gpu_env(),
                       timeout=max(1.0, stage.left()))
    (out / "doctor.json").write_text(r.stdout)
    if r.returncode:
        raise RuntimeError(f"ctxq doctor exited {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def cell_list(geometries=CELL_GEOMETRIES) -> list[tuple[str, str, int, str]]:
    """All-GPU cells first, short contexts first: a cut run keeps the broadest picture."""
    return [(g, kv, ctx, pl) for pl in PLACEMENTS for ctx in CELL_CTX for kv in CELL_KV for g in geometries]


@keeps_partial
def cells(stage: Stage, out: Path, result: dict) -> dict:
    read, why = nvml_or_fake()
    result.update(rows=[], errors=[], nvml=why or "ok")
    for geo, kv, ctx, placement in cell_list():
        stage.check(15)
        label = f"{geo} {kv} {ctx} {placement}"
        sampler = Sampler(read)
        try:
            res, pid = supervised(cell_child, _synthetic(geo), ctx, kv, placement, N_PREFILL, sampler=sampler,
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


def start_ctxq_workers(n: int, timeout_s: float) -> list[dict]:
    """`ctxq worker --device CUDA0 --port 0` n times, each its own process and CUDA context."""
    procs = [subprocess.Popen([*CTXQ, "worker", "--port", "0", "--device", "CUDA0", "--threads", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=gpu_env(),
                              start_new_session=True) for _ in range(n)]
    workers, end = [], time.monotonic() + timeout_s
    for p in procs:
        line = ""
        while "listening on" not in line:
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, end - time.monotonic()))
            line = p.stdout.readline() if ready else ""
            if not ready or (not line and p.poll() is not None):
                stop_workers([{"proc": q} for q in procs])
                raise RuntimeError(f"ctxq worker {p.pid} did not start listening ({line.strip() or 'no output'})")
        workers.append({"proc": p, "pid": p.pid, "endpoint": re.search(r"listening on (\S+)", line).group(1)})
    return workers


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
def workers(stage: Stage, out: Path, result: dict) -> dict:
    read, why = nvml_or_fake()
    ws = start_ctxq_workers(len(WORKER_GIB), min(60.0, stage.left()))
    result.update(runs=[], nvml=why or "ok")
    try:
        for w, gib in zip(ws, WORKER_GIB):
            w["declared"] = gib * 2**30
        spec = ",".join(f"{w['endpoint']}={gib}" for w, gib in zip(ws, WORKER_GIB))
        # The 8B prefills the whole context; the 70B (about 40 GiB of weights sent over loopback)
        # gets a shorter prefill so that it fits the stage: its buffers are all reserved at load.
        for geo, n_prompt in (("llama3-8b", WORKER_CTX - 64), ("llama3-70b", 4096)):
            stage.check(20)
            run = {"geometry": geo, "n_ctx": WORKER_CTX, "n_prompt": n_prompt}
            result["runs"].append(run)
            sampler = Sampler(read)
            try:
                res, _ = supervised(rpc_run_child, _synthetic(geo), spec, WORKER_CTX, n_prompt, 4, sampler=sampler,
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
        stop_workers(ws)
        for w in ws:
            w.pop("proc", None)
        result["workers"] = ws
    return result


@keeps_partial
def speed(stage: Stage, out: Path, result: dict) -> dict:
    """SmolLM2's layout at ~60k tokens: the real `ctxq run` command against a plain `Llama` with the kwargs
    of the same plan (ctxq.rpc.generate_greedy), one run each, in fresh processes."""
    from bench_run import make_text
    from gpu_check import rebuild_with_random_weights

    header = Path(os.environ.get("GPU_DIR", ".gpu")) / "smollm2-header.gguf"
    if not header.is_file():
        raise RuntimeError(f"{header} missing: run scripts/gpu_check.sh prepare and carry .gpu")
    model = str(rebuild_with_random_weights(header, _models_dir() / "smollm2-random.gguf"))
    text, n = make_text(model, SPEED_TOKENS)
    text_file = _models_dir() / "speed-prompt.txt"
    text_file.write_text(text)
    result.update(model="SmolLM2-135M layout, random weights", n_ctx=SPEED_CTX, n_prompt=n)
    stage.check(20)
    result["plain"], _ = supervised(plain_child, model, text, SPEED_CTX, SPEED_PREDICT, sampler=None,
                                    timeout=stage.left() / 2)
    stage.check(10)
    r = subprocess.run([*CTXQ, "run", model, "-f", str(text_file), "-c", str(SPEED_CTX), "-n", str(SPEED_PREDICT),
                        "--temp", "0", "--json"], capture_output=True, text=True, env=gpu_env(),
                       timeout=max(1.0, stage.left()))
    if r.returncode:
        raise RuntimeError(f"ctxq run exited {r.returncode}: {r.stderr.strip()[-300:]}")
    d = json.loads(r.stdout)
    result["ctxq"] = {k: d[k] for k in ("n_prompt", "n_generated", "prefill_s", "decode_s", "ttft_s", "prefill_tps",
                                        "decode_tps", "stop")}
    return result


STAGE_FUNCS = {"doctor": doctor, "cells": cells, "workers": workers, "speed": speed}
