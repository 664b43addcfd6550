"""The measuring half of scripts/gpu_check.sh (issue 14; docs/gpu.md): planner vs CUDA, in one timed run.

    python3 scripts/gpu_check.py checks --out DIR [--deadline-s 480] [--stages doctor,cells,workers,split,speed]
    python3 scripts/gpu_check.py table DIR/gpu_check.json       # the summary table again
    python3 scripts/gpu_check.py smollm2-header OUT.gguf         # (prepare) SmolLM2's header + its size

Stages, each with its own time budget (a stage that overruns is cut and recorded; the next still runs):
doctor (`ctxq doctor --json`), cells (planned vs printed vs NVML, synthetic geometries), workers (five
`ctxq worker` processes declared 16,16,16,8,8 GiB on one GPU), split (`ctxq bench -sm layer` and `-sm tensor`
on two workers declared 16 and 8 GiB: each worker's peak against its card in the plan, speeds beside the
estimate), speed (SmolLM2 layout at ~60k tokens,
`ctxq run` vs a plain `Llama`). Results go to DIR/gpu_check.json after every stage; a table prints last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_nvml, gpu_stages, gpu_runs

# Imports among scripts/ go one way (tests/test_layout.py): gpu_runs and gpu_stages never import this module.
from gpu_stages import Stage, StageTimeout, hide_gpu, smollm2_header  # noqa: E402

# name -> (cap, minimum) in seconds. The minimum of every later stage is held back for it, so an
# early stage never eats a later one's time; the caps sum to what the checks take on an H100/H200
# (estimates until the first run: docs/gpu.md).
STAGES = {"doctor": (30, 10), "cells": (130, 60), "workers": (150, 60), "split": (110, 45), "speed": (90, 40),
          "spill": (200, 60)}
MIN_RUN_S = 10  # a stage allotted less than this is skipped, not started


def allot(names: list[str], left_s: float, index: int, stages: dict = STAGES) -> float:
    """Seconds for stage names[index]: its cap, less what later stages need at least."""
    cap, _ = stages[names[index]]
    reserve = sum(stages[n][1] for n in names[index + 1:])
    return max(0.0, min(cap, left_s - reserve))


def run_stages(names: list[str], funcs: dict, total_s: float, out: Path, results: dict,
               clock: Callable[[], float] = time.monotonic) -> dict:
    """Run each stage with its allotment; record status ok / cut / error / skipped and its seconds."""
    end = clock() + total_s
    for i, name in enumerate(names):
        s = allot(names, end - clock(), i)
        rec = {"allotted_s": round(s, 1)}
        if s < MIN_RUN_S:
            rec.update(status="skipped", why=f"{end - clock():.0f} s left for this and later stages")
        else:
            st = Stage(name, s, clock)
            try:
                rec.update(status="ok", result=funcs[name](st, out))
            except StageTimeout as e:
                rec.update(status="cut", why=str(e), result=getattr(e, "partial", None))
            except Exception as e:  # recorded; the next stage still runs
                rec.update(status="cut" if "longer than" in str(e) else "error", why=f"{type(e).__name__}: {e}",
                           result=getattr(e, "partial", None))
            rec["took_s"] = round(clock() - st.started, 1)
        results["stages"][name] = rec
        write_json(out / "gpu_check.json", results)
        print(f"gpu_check: stage {name}: {rec['status']} ({rec.get('took_s', 0)} of {rec['allotted_s']} s)"
              + (f": {rec['why']}" if "why" in rec else ""), flush=True)
    return results


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)  # a run killed mid-write leaves the previous complete file


def _split_lines(res: dict, mib, table) -> list[str]:
    """The split stage's table: per mode and worker, declared / planned / NVML peak, and the mode's speeds."""
    rows = []
    for mode, row in (res.get("modes") or {}).items():
        b = {r["mode"]: r for r in row.get("bench", []) if isinstance(r, dict)}.get(mode, {})
        est = row.get("estimate") or {}
        speed = (f"pp {_mean(b.get('pp_tps'))} tg {_mean(b.get('tg_tps'))} (est. pp "
                 f"{_num(est.get('prefill_tps'))} tg {_num(est.get('decode_tps'))})" if b else row.get("status", "-"))
        for w in row.get("workers", []) or [{}]:
            rows.append([mode, w.get("endpoint", "-"), mib(w.get("declared")), mib(w.get("planned_total")),
                         mib(w.get("nvml_peak")), {True: "EXCEEDED", False: "ok", None: "-"}[w.get("exceeded")],
                         speed])
    if not rows:
        return []
    auto = res.get("auto") or {}
    return [f"split modes, {res.get('geometry')} at {res.get('n_ctx')} ctx on one GPU's workers:\n" + table(
        rows, ["mode", "worker", "declared", "planned", "NVML peak", "size", "t/s measured"])
        + f"\n-sm auto takes: {auto.get('split_mode', '-')}"]


def _mean(values) -> str:
    return f"{sum(values) / len(values):.1f}" if values else "-"


def _num(x) -> str:
    return "-" if x is None else f"{x:.1f}"


# --- the summary table -------------------------------------------------------------------------

def summary(results: dict) -> str:
    """The short table printed last: one block per stage that produced figures."""
    from ctxq.cli.common import table

    def mib(n):
        return "-" if n is None else f"{n / 2**20:.0f}"

    st = results.get("stages", {})
    b = results.get("build") or {}
    built = "reused from an earlier run" if b.get("reused") else f"{b.get('build_s', '?')} s (exit {b.get('rc', '?')})"
    parts = [f"build: {built}" if b else "build: not recorded",
             "stages: " + ", ".join(f"{k} {v['status']}" for k, v in st.items())]
    doc = (st.get("doctor") or {}).get("result") or {}
    if doc and not doc.get("nvidia_gpus"):
        parts.append(f"GPU: none ({doc.get('nvml_error')})")
    for g in doc.get("nvidia_gpus", []):
        parts.append(f"GPU {g['index']}: {g['name']}, {g['free'] / 2**30:.1f} GiB free of {g['total'] / 2**30:.1f}"
                     f"; llama.cpp CUDA {'yes' if doc.get('features', {}).get('cuda') else 'NO'}")
    comm = doc.get("cuda_comm") or {}
    if comm.get("library"):
        parts.append(f"multi-GPU: NCCL {'linked (' + str(comm.get('nccl_soname')) + ')' if comm.get('nccl') else 'not linked'}"
                     f"; all-reduce {comm.get('allreduce')}; peer access {comm.get('peer_access')}")
    cell_res = (st.get("cells") or {}).get("result") or {}
    cells = cell_res.get("rows", [])
    if cell_res.get("errors"):
        parts.append(f"{len(cell_res['errors'])} cells failed; the first: {cell_res['errors'][0]}")
    if cells:
        parts.append("planned vs printed vs NVML on CUDA0 (MiB; planned without / with the margin):\n" + table(
            [[c["geometry"], c["kv"], c["n_ctx"], c["placement"], mib(c["gpu_planned_total"] - c["gpu_planned"]["margin"]),
              mib(c["gpu_printed_total"]), mib(c["nvml_peak"]), mib(c["unaccounted"]), mib(c["gpu_planned_total"]),
              {True: "yes", False: "NO", None: "-"}[c["fits"]]] for c in cells],
            ["model", "KV", "n_ctx", "layers", "planned", "printed", "NVML peak", "unacct.", "plan+margin", "fits"]))
    wres = (st.get("workers") or {}).get("result") or {}
    for run in wres.get("runs", []):
        rows = [[w["endpoint"], mib(w["declared"]), w["layers"], mib(w["planned_total"]), mib(w["printed"]),
                 mib(w["nvml_peak"]), mib(w["headroom"]), {True: "EXCEEDED", False: "ok", None: "-"}[w["exceeded"]]]
                for w in run.get("workers", [])]
        head = (f"{run['geometry']} at {run['n_ctx']} ctx, {run.get('n_prompt', '?')} tokens prefilled, "
                f"workers: {wres.get('worker_command', '?')}")
        parts.append(f"{head}: {run.get('status', 'ok')}" + ("\n" + table(rows, [
            "worker", "declared", "layers", "planned", "printed", "NVML peak", "headroom", "size"]) if rows else ""))
    parts += _split_lines((st.get("split") or {}).get("result") or {}, mib, table)
    sp = (st.get("speed") or {}).get("result") or {}
    if sp.get("ctxq") and sp.get("plain"):
        c, p = sp["ctxq"], sp["plain"]
        parts.append(table([[k, f"{c[k + '_tps']:.1f}", f"{p[k + '_tps']:.1f}",
                             f"{c[k + '_tps'] / p[k + '_tps']:.3f}" if p[k + "_tps"] else "-"]
                            for k in ("prefill", "decode")], [f"SmolLM2 layout, {c['n_prompt']} tokens", "ctxq run",
                                                              "plain Llama", "ratio"])
                     + f"\ntime to first token (ctxq run, {sp.get('n_ctx')} ctx): {c['ttft_s']:.2f} s")
    return "\n\n".join(parts)


# --- command line --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("checks", help="run the stages (on the CUDA machine)")
    c.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and the logs")
    c.add_argument("--deadline-s", type=float, default=480, help="seconds for all stages together")
    c.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {','.join(STAGES)}")
    c.add_argument("--failed-build", action="store_true", help="record that the build failed; run nothing")
    t = sub.add_parser("table", help="print the summary table of a gpu_check.json")
    t.add_argument("json", type=Path)
    h = sub.add_parser("smollm2-header", help="write SmolLM2's GGUF header (prepare step)")
    h.add_argument("dest", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "table":
        print(summary(json.loads(a.json.read_text())))
        return 0
    if a.cmd == "smollm2-header":
        print(f"wrote {smollm2_header(a.dest)}")
        return 0
    names = [s.strip() for s in a.stages.split(",") if s.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    if a.deadline_s < 0:
        ap.error("--deadline-s must be 0 or more")
    a.out.mkdir(parents=True, exist_ok=True)
    build = a.out / "build.json"
    results = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "deadline_s": a.deadline_s,
               "build": json.loads(build.read_text()) if build.is_file() else None, "stages": {}}
    if a.failed_build:
        results["stages"] = {n: {"status": "skipped", "why": "the llama-cpp-python build failed"} for n in names}
        write_json(a.out / "gpu_check.json", results)
    else:
        import gpu_runs

        hide_gpu()
        run_stages(names, gpu_runs.STAGE_FUNCS, a.deadline_s, a.out, results)
    print("\n" + summary(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
