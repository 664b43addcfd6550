"""fit's table with the IQ types and the importance matrix (issue 45, part 3): what they cost and what they change.

On MODEL (a GGUF with weights) it makes fit's layout (the dry runs: which candidate types the model's rows take) and
the error table (`sensitivity.measure(method="error")`, the importance matrix ctxq's own, made as `ctxq convert`
makes it), and prints:

- the candidate types kept, and per type the seconds its pure quantization and error measurement took;
- the seconds of the importance matrix (0 when cached) and of the dry runs;
- how the matrix changes the criterion: per group kind the weighted error's share against the plain squared error's,
  and how many of the groups' ranks (by error at Q4_K) move, with the largest moves.

    .venv/bin/python scripts/iq_table.py ~/.cache/ctxq/models/SmolLM2-135M-Instruct.F16.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--at", default="Q4_K", help="the type whose errors rank the groups")
    a = ap.parse_args()

    from ctxq.conversion import sensitivity as S

    src = Path(a.model)
    t0 = time.perf_counter()
    table = S.layout(src)
    t_layout = time.perf_counter() - t0
    t0 = time.perf_counter()
    matrix = S.model_imatrix(src)
    t_matrix = time.perf_counter() - t0
    stamps: list[tuple[str, float]] = []

    def progress(done, total, what):
        if what.startswith("measure:error at "):
            stamps.append((what.split()[-1], time.perf_counter()))

    t0 = time.perf_counter()
    table = S.measure(table, src, method="error", progress=progress, imatrix=matrix)
    t_end = time.perf_counter()
    print(f"{src.name}: {len(table.groups)} groups; candidates kept: {', '.join(table.types)}")
    left = [t for t in S.CANDIDATES if t not in table.types]
    print(f"  left out (every row falls back): {', '.join(left) or 'none'}; excluded options: "
          f"{', '.join(f'{g} at {t}' for g, t in table.excluded) or 'none'}")
    print(f"  dry runs {t_layout:.1f} s; importance matrix {t_matrix:.1f} s"
          f"{' (from the cache)' if t_matrix < 5 else ''}; error table {t_end - t0:.1f} s"
          f"{' (from the cache)' if not stamps else ''}")
    for i, (qt, ts) in enumerate(stamps):
        nxt = stamps[i + 1][1] if i + 1 < len(stamps) else t_end
        print(f"    {qt:8} {nxt - ts:7.1f} s" + ("  (with the matrix)" if qt in S.IMATRIX_TYPES else ""))
    w, p = table.details["error"], table.details["error_unweighted"]
    j = table.types.index(a.at)
    kinds: dict[str, list[float]] = {}
    total_w, total_p = sum(w[g.name][j] for g in table.groups), sum(p[g.name][j] for g in table.groups)
    for g in table.groups:
        kinds.setdefault(g.kind, [0.0, 0.0])
        kinds[g.kind][0] += w[g.name][j] / total_w
        kinds[g.kind][1] += p[g.name][j] / total_p
    print(f"  share of the model's error at {a.at}, weighted by the matrix vs plain:")
    for kind, (sw, sp) in kinds.items():
        print(f"    {kind:10} {100 * sw:6.1f} % vs {100 * sp:6.1f} %")
    names = [g.name for g in table.groups]
    rank_w = {n: r for r, n in enumerate(sorted(names, key=lambda n: -w[n][j]))}
    rank_p = {n: r for r, n in enumerate(sorted(names, key=lambda n: -p[n][j]))}
    moved = sorted(names, key=lambda n: -abs(rank_w[n] - rank_p[n]))
    print(f"  ranks by error at {a.at} (0: the largest): {sum(rank_w[n] != rank_p[n] for n in names)} of "
          f"{len(names)} groups move; largest moves: " +
          ", ".join(f"{n} {rank_p[n]} -> {rank_w[n]}" for n in moved[:5]))


if __name__ == "__main__":
    sys.exit(main())
