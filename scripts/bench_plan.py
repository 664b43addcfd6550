"""Time the planner on an 80-layer 70B-shaped Q4_K_M file at 64k for 3x16 + 2x8 GiB (target: <= 0.2 s),
and the same plan from a 3-shard split of it on a stand-in Hub on 127.0.0.1 (target: <= 2 s, headers
read with range requests; tests/hubserver.py).

Prints the cold time (first plan in the process: llama.cpp import, derived-model files written,
dry runs), the warm time (the same plan again, as `ctxq run --split auto` does after `ctxq plan`) and
the Hub plan's time (empty caches, no interpreter start), side by side with the targets.

    .venv/bin/python scripts/bench_plan.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

TARGET = 0.2
HUB_TARGET = 2.0


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ctxq-bench-plan-"))
    model = write_synthetic_gguf(tmp / "llama3-70b-Q4_K_M.gguf", GEOMETRIES["llama3-70b"])
    import os
    os.environ["CTXQ_HOME"] = str(tmp / "home")  # a cold derived-model cache
    t = time.perf_counter()
    from ctxq.planning.planner import plan
    p = plan(model, 65536, gpus="16,16,16,8,8")
    cold = time.perf_counter() - t
    warm = []
    for _ in range(5):
        t = time.perf_counter()
        plan(model, 65536, gpus="16,16,16,8,8")
        warm.append(time.perf_counter() - t)
    print(f"plan: {p.llama_flags()}  ({p.reason})")
    print(f"{'':<28}{'seconds':>10}{'target':>10}{'ratio':>10}")
    print(f"{'cold (first plan, import)':<28}{cold:>10.3f}{TARGET:>10.2f}{cold / TARGET:>10.2f}")
    print(f"{'warm (median of 5)':<28}{statistics.median(warm):>10.3f}{TARGET:>10.2f}{statistics.median(warm) / TARGET:>10.2f}")
    hub = _hub_plan(model, tmp)
    print(f"{'Hub, 3 shards, cold caches':<28}{hub:>10.3f}{HUB_TARGET:>10.2f}{hub / HUB_TARGET:>10.2f}")


def _hub_plan(model: Path, tmp: Path) -> float:
    """Seconds for ctxq.plan() of the model split in 3 on a stand-in Hub, with empty caches."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
