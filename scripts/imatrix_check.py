"""Does ctxq's importance matrix agree with llama.cpp's `llama-imatrix` (issue 45, part 3)?

Builds llama-imatrix once from the vendored sources (scripts/llama_tools.py; nothing committed), runs it and ctxq's
collector (`ctxq.conversion.imatrix.make_imatrix`, fresh, not from the cache) on the same model and text with the
same chunks (512 tokens, one chunk per batch: `-c 512 -b 512`), and prints per tensor the relative difference of
`in_sum2` (|ctxq - llama| / llama per column: the max, the median) and whether the counts are equal, then the time
and peak memory of each.

    .venv/bin/python scripts/imatrix_check.py ~/.cache/ctxq/models/SmolLM2-135M-Instruct.F16.gguf --chunks 8 -j 2
    .venv/bin/python scripts/imatrix_check.py tiny-moe --chunks 8     # tests' qwen3moe (8 experts, 2 used)

`tiny-moe` stands for the tiny qwen3moe of tests/test_convert_moe.py (`ctxq.testing.moe.tiny_moe_gguf`, made in a
temporary folder): its experts' rows (MUL_MAT_ID) are summed per expert and counted per expert, and the counts are
compared too. The last line is the verdict: the worst relative difference over every tensor and whether every count
is equal.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_tools  # noqa: E402


def read(path: Path) -> tuple[dict, dict, dict]:
    """({tensor: in_sum2 (n_mat, n_cols)}, {tensor: counts (n_mat,)}, {key: value}) of a GGUF imatrix."""
    import gguf

    r = gguf.GGUFReader(str(path))
    sums, counts = {}, {}
    for t in r.tensors:
        base, _, kind = t.name.rpartition(".")
        arr = np.asarray(t.data, dtype=np.float64)
        (sums if kind == "in_sum2" else counts)[base] = arr.reshape(arr.shape[0] if arr.ndim > 1 else 1, -1) \
            if kind == "in_sum2" else arr.reshape(-1)
    keys = {k: f.contents() for k, f in r.fields.items() if k.startswith("imatrix.") or k == "general.type"}
    return sums, counts, keys


def run_measured(cmd: list[str], **kw) -> tuple[float, int]:
    """(seconds, peak resident bytes) of a program run to its end."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, **kw)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"{cmd[0]} failed with exit status {p.returncode}")
    return time.perf_counter() - t0, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF model, or `tiny-moe` for tests' tiny qwen3moe")
    ap.add_argument("-f", "--file", help="text (default: ctxq quality's built-in text)")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("-j", "--jobs", type=int, default=None, help="compile jobs for the first build")
    a = ap.parse_args()

    from ctxq.conversion.imatrix import make_imatrix
    from ctxq.quality import builtin_text

    bin_dir = llama_tools.build(jobs=a.jobs, targets=("llama-imatrix",))
    with tempfile.TemporaryDirectory(prefix="imatrix-check-") as tmp:
        if a.model == "tiny-moe":
            from ctxq.testing.moe import tiny_moe_gguf

            a.model = str(tiny_moe_gguf(Path(tmp) / "tiny-qwen3moe.gguf"))
        text = Path(a.file) if a.file else Path(tmp) / "licences.txt"
        if not a.file:
            text.write_bytes(builtin_text())
        ref = Path(tmp) / "llama.imatrix.gguf"
        cmd = [str(bin_dir / "llama-imatrix"), "-m", a.model, "-f", str(text), "-o", str(ref), "-c", "512",
               "-b", "512", "--chunks", str(a.chunks), "-t", str(a.threads), "--no-ppl", "-ngl", "0"]
        with open(Path(tmp) / "llama.log", "wb") as log:
            l_sec, l_rss = run_measured(cmd, stdout=log, stderr=log)
        t0 = time.perf_counter()
        r = make_imatrix(a.model, a.file, chunks=a.chunks, out=Path(tmp) / "ctxq.imatrix.gguf", force=True,
                         threads=a.threads)
        c_wall = time.perf_counter() - t0
        ls, lc, lkeys = read(ref)
        cs, cc, ckeys = read(r.path)
    print(f"$ {' '.join(cmd[:1] + [Path(c).name if '/' in c else c for c in cmd[1:]])}")
    print(f"llama-imatrix keys: {lkeys}\nctxq keys:          {ckeys}")
    if set(ls) != set(cs):
        print(f"tensors only in llama-imatrix: {sorted(set(ls) - set(cs))}; only in ctxq: {sorted(set(cs) - set(ls))}")
    maxes, medians, count_diffs = [], [], 0
    print(f"{'tensor':32} {'cols':>6} {'max rel':>10} {'median rel':>11} counts (llama, ctxq)")
    for name in sorted(set(ls) & set(cs)):
        a_, b_ = cs[name], ls[name]
        rel = np.abs(a_ - b_) / np.maximum(np.abs(b_), 1e-30)
        if (lc[name] == 0).any():  # an expert never routed to: both hold nothing there (llama.cpp writes zeros)
            rel = np.where(b_ == 0, np.abs(a_), rel)
        maxes.append(rel.max())
        medians.append(np.median(rel))
        same = np.array_equal(lc[name], cc[name])
        count_diffs += not same
        print(f"{name:32} {b_.shape[-1]:6d} {rel.max():10.2e} {np.median(rel):11.2e} "
              f"{lc[name].astype(int).tolist()} {cc[name].astype(int).tolist()}{'' if same else '  DIFFER'}")
    print(f"\n{len(maxes)} tensors ({len(ls)} in llama-imatrix, {len(cs)} in ctxq); in_sum2 relative difference: "
          f"max {max(maxes):.2e}, median of the per-tensor medians {np.median(medians):.2e}, largest per-tensor "
          f"median {max(medians):.2e}; counts differ in {count_diffs} tensors")
    experts = [n for n in lc if lc[n].size > 1]
    if experts:
        routed = sum(int(lc[n].sum()) for n in experts)
        print(f"experts: {len(experts)} tensors with per-expert counts, {routed:,} routed rows in llama-imatrix, "
              f"{sum(int(cc[n].sum()) for n in experts if n in cc):,} in ctxq")
    print(f"verdict: worst relative difference {max(maxes):.2e}; counts "
          f"{'equal in every tensor' if count_diffs == 0 and set(ls) == set(cs) else f'differ in {count_diffs}'}")
    print(f"llama-imatrix: {l_sec:.1f} s, peak {l_rss / 2**20:.0f} MiB; ctxq: {r.seconds:.1f} s evaluating "
          f"({c_wall:.1f} s with the child's start), peak {r.peak_rss_bytes / 2**20:.0f} MiB "
          f"({a.chunks} chunks of 512 tokens, {a.threads} threads)")


if __name__ == "__main__":
    main()
