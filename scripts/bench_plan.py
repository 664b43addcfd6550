"""Time the planner on an 80-layer 70B-shaped Q4_K_M file at 64k for 3x16 + 2x8 GiB (target: <= 0.2 s),
and the same plan from a 3-shard split of it on a stand-in Hub on 127.0.0.1 (target: <= 2 s, headers
read with range requests; tests/hubserver.py).

Prints, for this checkout and for a baseline revision (default `main`, its code taken with `git archive`
into a temporary folder and run the same way), the cold time (a fresh interpreter's first plan: llama.cpp
import, derived-model files written, dry runs, the referee's accounting) and the warm time (the same plan
again, as `ctxq run --split auto` does after `ctxq plan`), each as wall-clock and CPU seconds (CPU time is
the steadier figure on a busy machine), against the target; then the Hub plan's time.

    .venv/bin/python scripts/bench_plan.py [--baseline main]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 0.2
HUB_TARGET = 2.0
ROOT = Path(__file__).resolve().parent.parent


def measure(tmp: Path) -> dict:
    """Cold and warm plan times in this interpreter (run in a fresh one: the cold time includes imports)."""
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    model = write_synthetic_gguf(tmp / "llama3-70b-Q4_K_M.gguf", GEOMETRIES["llama3-70b"])
    os.environ["CTXQ_HOME"] = str(tmp / "home")  # a cold derived-model and accounting cache
    w, c = time.perf_counter(), time.process_time()
    from ctxq.planning.planner import plan
    p = plan(model, 65536, gpus="16,16,16,8,8")
    out = {"cold": time.perf_counter() - w, "cold_cpu": time.process_time() - c, "flags": p.llama_flags(),
           "reason": p.reason}
    warm, warm_cpu = [], []
    for _ in range(5):
        w, c = time.perf_counter(), time.process_time()
        plan(model, 65536, gpus="16,16,16,8,8")
        warm.append(time.perf_counter() - w)
        warm_cpu.append(time.process_time() - c)
    out.update(warm=statistics.median(warm), warm_cpu=statistics.median(warm_cpu))
    return out


def _run(code_root: Path, tmp: Path) -> dict:
    """measure() in a fresh interpreter importing ctxq from code_root (a folder holding ctxq/)."""
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", str(tmp)], env=env,
                       capture_output=True, text=True, cwd=tmp, timeout=600)
    if r.returncode:
        raise SystemExit(f"bench failed for {code_root}: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _baseline(rev: str, tmp: Path) -> Path:
    """The code of `rev` (git archive), with a ctxq/ link to its toolkit/ as the package."""
    root = tmp / f"code-{rev}"
    root.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "ctxq").symlink_to("toolkit")
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="main", help="git revision to compare with (default: main)")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(Path(a.measure))))
        return
    tmp = Path(tempfile.mkdtemp(prefix="ctxq-bench-plan-"))
    here = tmp / "code-here"
    here.mkdir()
    (here / "ctxq").symlink_to(ROOT / "toolkit")
    rows = []
    for label, code in ((f"before ({a.baseline})", _baseline(a.baseline, tmp)), ("after (this checkout)", here)):
        (tmp / label.split()[0]).mkdir()
        rows.append((label, _run(code, tmp / label.split()[0])))
    print(f"plan: {rows[-1][1]['flags']}  ({rows[-1][1]['reason']})")
    print(f"{'':<34}{'wall s':>9}{'cpu s':>9}{'target':>9}{'wall/target':>13}")
    for label, r in rows:
        for kind in ("cold", "warm"):
            print(f"{label + ', ' + kind:<34}{r[kind]:>9.3f}{r[kind + '_cpu']:>9.3f}{TARGET:>9.2f}"
                  f"{r[kind] / TARGET:>13.2f}")
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    model = write_synthetic_gguf(tmp / "llama3-70b-Q4_K_M.gguf", GEOMETRIES["llama3-70b"])
    hub = _hub_plan(model, tmp)
    print(f"{'after, Hub, 3 shards, cold caches':<34}{hub:>9.3f}{'':>9}{HUB_TARGET:>9.2f}{hub / HUB_TARGET:>13.2f}")
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
