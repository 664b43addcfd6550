"""Time the planner on an 80-layer 70B-shaped Q4_K_M file at 64k for 3x16 + 2x8 GiB (target: <= 0.2 s).

Prints the cold time (first plan in the process: llama.cpp import, derived-model files written,
dry runs) and the warm time (the same plan again, as `ctxq run --split auto` does after `ctxq plan`),
side by side with the target.

    .venv/bin/python scripts/bench_plan.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

TARGET = 0.2


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


if __name__ == "__main__":
    main()
