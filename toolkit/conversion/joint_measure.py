"""The combination `fit --ctx` writes, measured once: its weights with its K/V cache pair against the most precise
weights that run here with an f16 cache, on the held-out half of the built-in text (the mix was chosen on the
first half). The predicted total adds two losses measured apart; this says what they cost together.

`ctxq quality --against` holds the cache equal on both sides (each pair against the reference at the same pair);
this runs the reference at f16/f16 and the candidate at its pair, through the same worker, cache of reference
distributions and scores.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from pathlib import Path

import numpy as np

from ..errors import DoesNotFit
from . import sensitivity as S

log = logging.getLogger(__name__)

# The measurement's longest context: the held-out half of the built-in text holds about 17,000 SmolLM2 tokens, and
# a reference pass beyond 8,192 tokens takes minutes on a few CPU cores; a longer fit is measured at this context.
MAX_MEASURE_CTX = 8192


def reference_file(src: Path, n_ctx: int, plan_options: dict) -> tuple[Path, str]:
    """(the most precise file of this model that runs here with an f16 cache at n_ctx, why it is the reference):
    `src` where its plan holds, else f32/f16/bf16/Q8_0 files beside it (`joint.precise_files`)."""
    from ..planning.planner import plan
    from .joint import precise_files

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
    tokens (the second half of them scored); the reference's distributions are cached."""
    from ..quality import measurement as Q
    from ..quality import stats

    ctx = min(n_ctx, MAX_MEASURE_CTX)
    opts = plan_options or {}
    ref, why = reference_file(Path(src), ctx, opts)
    m = Q.Measurement(n_ctx=ctx, text=str(S.held_out_text()), plan_options=opts, progress=progress,
                      keep_results=False)
    data = m.text_bytes()
    sha = hashlib.sha256(data).hexdigest()
    with tempfile.TemporaryDirectory(prefix="ctxq-joint-") as tmp:
        text_file = Path(tmp) / "text"
        text_file.write_bytes(data)
        refs = Q._reference(str(ref), m, "f16", "f16", text_file, sha)
        scored = Path(tmp) / "scored.npz"
        Q._run(str(path), m, type_k, type_v, f"{Path(path).name} {type_k}/{type_v}",
               {"text": str(text_file), "tokens": str(Q._tokens(refs, tmp)), "reference": str(refs)}, scored)
        with np.load(scored) as z:
            scores = stats.Scores(z["kl"], z["same_top"], z["nll"])
    return {**scores.summary(), "type_k": type_k, "type_v": type_v, "n_ctx": ctx, "text": "licences (held-out half)",
            "reference": f"{ref.name} with an f16/f16 cache", "reference_why": why}
