"""Time the planner on an 80-layer 70B-shaped Q4_K_M file at 64k for 3x16 + 2x8 GiB (target: <= 0.2 s),
and the same plan from a 3-shard split of it on a stand-in Hub on 127.0.0.1 (target: <= 2 s, headers
read with range requests; tests/hubserver.py).

Prints, for this checkout and for a baseline revision (default `main`, its code taken with `git archive`
into a temporary folder and run the same way), three plans of the same file, each interpreter importing
nothing before the clock starts:

- first: a fresh interpreter and an empty CTXQ_HOME (derived models written, llama.cpp's dry runs and the
  referee's accounting asked for and cached on disk);
- cold: a fresh interpreter, those caches on disk (a user's second `ctxq plan`);
- warm: the same plan again in that interpreter (`ctxq run --split auto` after its plan; median of 5).

Each figure is the median of --repeat such runs.

Each as the import of ctxq.planning.planner (CPU s) and the plan itself (wall and CPU s; CPU time is the
steadier figure on a busy machine), against the target; then the Hub plan's time. `--patch FILE` adds
this checkout's committed code with FILE applied (`git apply`), for a change proposed to files another
branch owns.

    .venv/bin/python scripts/bench_plan.py [--baseline main] [--patch FILE] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lint_imports import assemble  # scripts/: the package as it installs, from a source tree

TARGET = 0.2
HUB_TARGET = 2.0
ROOT = Path(__file__).resolve().parent.parent
ARGS = dict(n_ctx=65536, gpus="16,16,16,8,8")


def measure(model: Path, home: Path) -> dict:
    """Import and plan times in this interpreter (a fresh one: nothing of ctxq, numpy or gguf imported yet)."""
    os.environ["CTXQ_HOME"] = str(home)
    c = time.process_time()
    from ctxq.planning.planner import plan
    out = {"import_cpu": time.process_time() - c}
    w, c = time.perf_counter(), time.process_time()
    p = plan(model, **ARGS)
    out.update(cold=time.perf_counter() - w, cold_cpu=time.process_time() - c, flags=p.llama_flags(), reason=p.reason)
    warm, warm_cpu = [], []
    for _ in range(5):
        w, c = time.perf_counter(), time.process_time()
        plan(model, **ARGS)
        warm.append(time.perf_counter() - w)
        warm_cpu.append(time.process_time() - c)
    out.update(warm=statistics.median(warm), warm_cpu=statistics.median(warm_cpu))
    return out


def _run(code_root: Path, model: Path, home: Path) -> dict:
    """measure() in a fresh interpreter importing ctxq from code_root (a folder holding ctxq/)."""
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", str(model), str(home)], env=env,
                       capture_output=True, text=True, cwd=home.parent, timeout=600)
    if r.returncode:
        raise SystemExit(f"bench failed for {code_root}: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _code(rev: str, tmp: Path, name: str, patch: Path | None = None) -> Path:
    """The code of `rev` (git archive, `patch` applied), its package put together as it installs (toolkit/,
    converters/ and profiles/ as ctxq/: scripts/lint_imports.py's `assemble`)."""
    root = tmp / f"src-{name}"
    root.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    if patch is not None:
        subprocess.run(["git", "apply", str(patch.resolve())], cwd=root, check=True)
    return assemble(root, tmp / f"code-{name}")


def _median(runs: list[dict]) -> dict:
    """Each figure's median over the runs (the flags and reason of the last)."""
    return {k: statistics.median(r[k] for r in runs) if isinstance(v, float) else v for k, v in runs[-1].items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="main", help="git revision to compare with (default: main)")
    ap.add_argument("--patch", type=Path, help="also time this checkout's committed code with this patch applied")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, their median shown (default: 3)")
    ap.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(Path(a.measure[0]), Path(a.measure[1]))))
        return
    tmp = Path(tempfile.mkdtemp(prefix="ctxq-bench-plan-"))
    try:
        _bench(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bench(a, tmp: Path) -> None:
    """The table, each code's runs in their own folders under tmp."""
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    model = write_synthetic_gguf(tmp / "llama3-70b-Q4_K_M.gguf", GEOMETRIES["llama3-70b"])
    here = assemble(ROOT, tmp / "code-here")
    codes = [(f"before ({a.baseline})", _code(a.baseline, tmp, "before")), ("after (this checkout)", here)]
    if a.patch:
        codes.append((f"after + {a.patch.name}", _code("HEAD", tmp, "patched", a.patch)))
    rows = []
    for i, (label, code) in enumerate(codes):
        firsts, agains = [], []
        for k in range(a.repeat):
            home = tmp / f"home-{i}-{k}"
            firsts.append(_run(code, model, home))  # an empty home
            agains.append(_run(code, model, home))  # the caches the first plan left
        rows.append((label, _median(firsts), _median(agains)))
    print(f"plan: {rows[-1][2]['flags']}  ({rows[-1][2]['reason']})")
    print(f"{'':<40}{'import cpu':>11}{'plan wall':>10}{'plan cpu':>9}{'both cpu':>9}{'target':>8}{'cpu/target':>11}")
    for label, first, again in rows:
        for kind, r, key in (("first", first, "cold"), ("cold", again, "cold"), ("warm", again, "warm")):
            imp = r["import_cpu"] if kind != "warm" else 0.0
            both = imp + r[key + "_cpu"]
            print(f"{label + ', ' + kind:<40}{(f'{imp:.3f}' if kind != 'warm' else '-'):>11}{r[key]:>10.3f}"
                  f"{r[key + '_cpu']:>9.3f}{both:>9.3f}{TARGET:>8.2f}{both / TARGET:>11.2f}")
    hub = _hub_plan(model, tmp)
    print(f"{'after, Hub, 3 shards, cold caches':<40}{'':>11}{hub:>10.3f}{'':>9}{'':>9}{HUB_TARGET:>8.2f}"
          f"{hub / HUB_TARGET:>11.2f}  (wall)")
    print(f"load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def _hub_plan(model: Path, tmp: Path) -> float:
    """Seconds for ctxq.plan() of the model split in 3 on a stand-in Hub, with empty caches."""
    sys.path.insert(0, str(ROOT))
    from tests.hubserver import HubServer, write_split

    shards = write_split(model, tmp / "split", "Llama-3-70B-Q4_K_M", 3)
    hub = HubServer(max_requests=100, lifetime=300).start()
    try:
        hub.add_repo("user/Llama-3-70B-GGUF", {f"Q4_K_M/{p.name}": p for p in shards})
        os.environ.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp / "hf"), HF_TOKEN="", HF_HUB_OFFLINE="0",
                          HF_HUB_DISABLE_TELEMETRY="1", CTXQ_HOME=str(tmp / "home-hub"))
        import ctxq

        t = time.perf_counter()
        ctxq.plan("user/Llama-3-70B-GGUF:Q4_K_M", n_ctx=65536, gpus="16,16,16,8,8", cpu_memory=64 << 30)
        return time.perf_counter() - t
    finally:
        hub.stop()


if __name__ == "__main__":
    main()
