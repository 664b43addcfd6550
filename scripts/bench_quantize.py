"""ctxq's quantize against a direct `llama_model_quantize` call: same input, same parameters.

    python scripts/bench_quantize.py [--type Q4_K_M] [--repeat 3] [--src model-F16.gguf | --size 1.7b]

The input defaults to SmolLM2-135M-Instruct dequantized to F16 (`ctxq.testing.models`); `--size 1.7b`
uses a SmolLM2-1.7B-shaped F16 model (SmolLM2's tokenizer, random weights, 3.4 GB, made once
under ctxq's models folder), the size people quantize. Runs
alternate (direct, ctxq, direct, ctxq, ...) so that load from other processes hits both alike.
ctxq runs with force (no cache) and without the quality gate: its time is the whole call
(child process, quantization, loading the result back, rename, cache record). Prints the median
wall times, their ratio (direct / ctxq; the target is >= 0.98), the same for the quantizer call
alone inside ctxq's worker, and whether the files are byte-identical.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path


def direct(lc, src: Path, dst: Path, ftype: int) -> float:
    """The plain llama-cpp-python call, as a user would write it (nthread 0: all hardware threads)."""
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    t0 = time.perf_counter()
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"llama_model_quantize failed with {rc}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--src", type=Path, help="an unquantized GGUF (default: SmolLM2-135M-Instruct F16)")
    ap.add_argument("--size", choices=["135m", "1.7b"], default="135m",
                    help="without --src: SmolLM2-135M-Instruct, or a SmolLM2-1.7B-shaped model")
    args = ap.parse_args()

    from ctxq import tempfiles
    from ctxq.llama.backend import llama_cpp
    from ctxq.models import models_dir
    from ctxq.conversion.quantize import file_digest, parse_type, quantize_gguf
    from ctxq.testing.models import dequantized_smollm2_gguf, smollm2_shaped_gguf

    lc = llama_cpp()  # ctxq's log callback: llama.cpp's per-tensor lines go to logging, not the terminal
    lc.llama_backend_init()
    if args.src:
        src = args.src
    elif args.size == "1.7b":
        src = smollm2_shaped_gguf(models_dir() / "SmolLM2-1.7B-shaped.F16.gguf")
    else:
        src = dequantized_smollm2_gguf(models_dir() / "SmolLM2-135M-Instruct.F16.gguf")
    name, ftype = parse_type(args.type)
    with tempfiles.folder(src, "bench") as tmp:  # beside the model; a killed run's goes by `ctxq cache clean`
        os.environ["CTXQ_HOME"] = str(Path(tmp) / "home")  # records go to a throwaway cache
        a, b = Path(tmp) / "direct.gguf", Path(tmp) / "ctxq.gguf"
        t_direct, t_ctxq, t_call = [], [], []
        for i in range(args.repeat):
            t_direct.append(direct(lc, src, a, ftype))
            t0 = time.perf_counter()
            r = quantize_gguf(src, b, name, check=False, force=True)
            t_ctxq.append(time.perf_counter() - t0)
            t_call.append(r.quantize_seconds)
            print(f"run {i + 1}: direct {t_direct[-1]:.2f} s, ctxq {t_ctxq[-1]:.2f} s "
                  f"(its llama_model_quantize call {t_call[-1]:.2f} s)", flush=True)
        same = file_digest(a) == file_digest(b)
        size = b.stat().st_size
    md, mc = statistics.median(t_direct), statistics.median(t_ctxq)
    print()
    print(f"input       {src} ({Path(src).stat().st_size / 2**20:.1f} MiB) -> {name} ({size / 2**20:.1f} MiB)")
    print(f"{'':12}{'direct':>10}{'ctxq':>10}{'ratio':>8}")
    print(f"{'median s':12}{md:>10.2f}{mc:>10.2f}{md / mc:>8.3f}   (direct / ctxq; target >= 0.98)")
    print(f"{'min s':12}{min(t_direct):>10.2f}{min(t_ctxq):>10.2f}{min(t_direct) / min(t_ctxq):>8.3f}")
    mq = statistics.median(t_call)
    print(f"{'call only':12}{md:>10.2f}{mq:>10.2f}{md / mq:>8.3f}   (the llama_model_quantize call inside ctxq's worker)")
    fixed = statistics.median(c - q for c, q in zip(t_ctxq, t_call))
    print(f"ctxq's fixed cost: {fixed:.2f} s median per run (worker start, header read, loading the result back, rename)")
    print(f"byte-identical: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
