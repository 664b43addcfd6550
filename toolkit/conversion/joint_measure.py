"""The combination `fit --ctx` writes, measured once: its weights with its K/V cache pair against the most precise
weights that run here with an f16 cache, on the held-out half of the built-in text (the mix was chosen on the
first half). The predicted total adds two losses measured apart; this says what they cost together.

It is `ctxq quality FILE --against REF --whole --kv PAIR` (the reference at f16/f16, the file at its pair: the
whole configuration's loss) on the held-out text.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ..errors import DoesNotFit
from . import sensitivity as S

log = logging.getLogger(__name__)

# The measurement's longest context: the held-out half of the built-in text holds about 17,000 SmolLM2 tokens, and
# a reference pass beyond 8,192 tokens takes minutes on a few CPU cores; a longer fit is measured at this context.
MAX_MEASURE_CTX = 8192
PRECISE = ("f32", "f16", "bf16", "q8_0")  # files whose `ctxq quality` measures this model's KV pairs


def precise_files(src: Path) -> list[Path]:
    """`src` and the files beside it of the same model at f32, f16, bf16 or Q8_0 (name: <stem>[-.]<TYPE>.gguf)."""
    def split(p: Path):
        m = re.match(r"(?i)^(.*)[-.]([a-z0-9_]+)\.gguf$", p.name)
        return (m.group(1).lower(), m.group(2).lower()) if m else (p.stem.lower(), "")

    stem, _ = split(src)
    others = [p for p in sorted(src.parent.glob("*.gguf")) if p != src and split(p)[0] == stem
              and split(p)[1] in PRECISE]
    return [src] + sorted(others, key=lambda p: PRECISE.index(split(p)[1]))


def reference_file(src: Path, n_ctx: int, plan_options: dict) -> tuple[Path, str]:
    """(the most precise file of this model that runs here with an f16 cache at n_ctx, why it is the reference):
    `src` where its plan holds, else f32/f16/bf16/Q8_0 files beside it (`precise_files`)."""
    from ..planning.planner import plan
    files = precise_files(src)
    for f in files:
        try:
            plan(str(f), n_ctx, type_k="f16", type_v="f16", **plan_options)
        except DoesNotFit as e:
            log.info("%s cannot be the reference here: %s", f.name, e)
            continue
        return f, ("the source" if f == src else f"{src.name} does not fit here with an f16 cache")
    from ..quality.measurement import QualityError

    raise QualityError(f"no file of this model runs here with an f16 cache at {n_ctx:,} tokens ({', '.join(f.name for f in files)}): "
                       "measure it on larger devices (ctxq quality --against)")


def measure_combined(path: str | Path, src: str | Path, type_k: str, type_v: str, n_ctx: int, *,
                     plan_options: dict | None = None, progress=None) -> dict:
    """Mean KL, p99, top-1 agreement and perplexity of `path` with a type_k/type_v cache against the reference
    (`reference_file`) with an f16 cache, on the held-out half of the built-in text at min(n_ctx, MAX_MEASURE_CTX)
    tokens (the second half of them scored): `ctxq quality PATH --against REF --whole --kv PAIR`; the reference's
    distributions are cached."""
    from ..quality.measurement import Measurement, measure

    ctx = min(n_ctx, MAX_MEASURE_CTX)
    opts = plan_options or {}
    ref, why = reference_file(Path(src), ctx, opts)
    m = Measurement(n_ctx=ctx, text=str(S.held_out_text()), plan_options=opts, progress=progress, keep_results=False)
    r = measure(path, m, [(type_k, type_v)], against=ref, whole=True)[0]
    return {"mean_kl": r.mean_kl, "p99_kl": r.p99_kl, "top1_agreement": r.top1_agreement, "ppl": r.ppl,
            "n_scored": r.n_scored, "type_k": type_k, "type_v": type_v, "n_ctx": ctx,
            "text": "licences (held-out half)", "reference": f"{ref.name} with an f16/f16 cache",
            "reference_why": why}
