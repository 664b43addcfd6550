"""Are the weights' loss and the cache's loss additive? One run, SmolLM2: for each KV pair, KL of the cache alone
(Q4_1 weights, pair against f16 cache), of the weights alone (Q4_1 against an f16 copy, both with an f16 cache),
their sum (what `ctxq plan` predicts when only the parts are measured), and the whole (Q4_1 with the pair against
the f16 copy with an f16 cache: `ctxq quality --against REF --whole`), with the whole's ratio to the sum.

    .venv/bin/python scripts/whole_quality.py [--ctx 1024] [--kv q8_0,q8_0/q4_0,q4_0]

Results are cached under ctxq's home (quality/); the f16 copy is dequantized from the Q4_1 file (tests do the same).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--kv", default="q8_0,q8_0/q4_0,q4_0")
    a = ap.parse_args()
    from ctxq import quality
    from ctxq.models import fetch_default_model
    from ctxq.testing.models import dequantized_smollm2_gguf

    model = fetch_default_model()
    pairs = quality.parse_pairs(a.kv)
    m = quality.Measurement(n_ctx=a.ctx)
    with tempfile.TemporaryDirectory(prefix="ctxq-whole-") as tmp:
        ref = dequantized_smollm2_gguf(Path(tmp) / "smollm2-f16.gguf")
        kv = {r.pair: r for r in quality.measure(model, m, pairs)}
        weights, = quality.measure(model, m, against=ref)
        whole = {r.pair: r for r in quality.measure(model, m, pairs, against=ref, whole=True)}
    print(f"SmolLM2-135M-Instruct Q4_1 against a dequantized f16 copy, built-in text, {a.ctx:,} tokens, positions "
          f"{a.ctx // 2:,}-{a.ctx - 2:,} scored; mean KL in nats\n")
    print("| K/V | cache alone | weights alone | sum (predicted) | whole (measured) | whole / sum | top-1 whole |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k, v in pairs:
        p = f"{k}/{v}"
        s = kv[p].mean_kl + weights.mean_kl
        w = whole[p]
        print(f"| {p} | {kv[p].mean_kl:.5f} | {weights.mean_kl:.5f} | {s:.5f} | {w.mean_kl:.5f} | "
              f"{w.mean_kl / s:.2f} | {100 * w.top1_agreement:.1f} % |")


if __name__ == "__main__":
    main()
