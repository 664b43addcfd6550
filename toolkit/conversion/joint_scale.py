"""The mix's predicted loss put on the scale of the measurement that judges it (`fit --ctx`).

Fit's table predicts a mix's loss as the sum of each group's measured cost (`sensitivity.py`: one group at a time,
1,024 tokens of the calibration half). The written combination is measured on the held-out half at the context
(`joint_measure`). The two differ by more than noise, and not by one factor: on SmolLM2-135M at 4,096 tokens the
held-out measurement of a mix was 1.7x the table's sum for a mix the table put at 0.19 nats and 2.2x for one at
0.022 (the groups' costs add up to less than the whole, more so where each is small; and the held-out half's
positions 2,048-4,095 are harder text than the calibration half's). So before the pairs are weighed, a few anchor
mixes (the table's own choice at the sizes of llama.cpp's pure ANCHOR_TYPES files) are written and measured exactly
as the result will be, and the table's sums are mapped through the line ln(measured) = a + b ln(table) fitted to
them (least squares). A monotone map: each pair's mix is the same, only its loss, and so the pair weighed against
the cache's loss, changes. Cached per model file, table and context.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import sensitivity as S

log = logging.getLogger(__name__)

ANCHOR_TYPES = ("Q3_K", "Q4_K", "Q5_K", "Q6_K")  # the anchors' sizes: these pure files' bytes in the table
SLOPE = (0.5, 1.5)  # b is held within this: a wider one says the anchors disagree more than they measure
VERSION = 1


@dataclass
class Scale:
    """ln(measured) = a + b ln(table's sum), from `anchors` ({size, table, measured} each)."""

    a: float = 0.0
    b: float = 1.0
    anchors: list = field(default_factory=list)
    n_ctx: int = 0
    text: str = "licences (held-out half)"

    def __call__(self, table_loss: float) -> float:
        return math.exp(self.a) * table_loss ** self.b if table_loss > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        pts = ", ".join(f"{x['table']:.4f} -> {x['measured']:.4f}" for x in self.anchors)
        return (f"weights' losses on the measurement's scale: {math.exp(self.a):.3f} x table^{self.b:.3f}, from "
                f"{len(self.anchors)} anchor mixes measured on the {self.text} at {self.n_ctx:,} tokens ({pts})")


def fitted(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line through (ln x, ln y); b = 1 with one point; b held within SLOPE."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if not pts:
        return 0.0, 1.0
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if len(pts) > 1 and sxx > 0 else 1.0
    b = min(max(b, SLOPE[0]), SLOPE[1])
    return my - b * mx, b


def anchor_mixes(table: S.Table, src: Path) -> list:
    """The table's least-loss mixes at the sizes of the pure ANCHOR_TYPES files (distinct mixes only)."""
    from .fit import choose

    out, seen = [], set()
    for t in ANCHOR_TYPES:
        if t not in table.types:
            continue
        i = table.types.index(t)
        size = table.fixed_bytes + sum(table.bytes[g.name][i] for g in table.groups)
        mix = choose(table, size, src)
        if tuple(mix.choice) not in seen and mix.predicted_loss > 0:
            seen.add(tuple(mix.choice))
            out.append(mix)
    return out


def weights_scale(src: Path, table: S.Table, n_ctx: int, *, plan_options: dict | None = None,
                  progress=None) -> Scale:
    """The Scale of this table at the measurement's context (joint_measure: held-out half, min(n_ctx, 8,192)),
    its anchors written and measured once (cached)."""
    from ..planning.quality_store import file_id
    from ..quality.measurement import Measurement, measure
    from .fit import _base_type
    from .joint_measure import MAX_MEASURE_CTX, reference_file
    from .weight_errors import quantize_pure

    ctx = min(n_ctx, MAX_MEASURE_CTX)
    opts = plan_options or {}
    mixes = anchor_mixes(table, src)
    stamp = [VERSION, file_id(str(src)), ctx, [list(m.choice) for m in mixes], table.types, table.measured_on]
    cached = S._cache_dir() / f"scale-{hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24]}.json"
    if cached.exists():
        return Scale(**json.loads(cached.read_text()))
    ref, _ = reference_file(src, ctx, opts)
    m = Measurement(n_ctx=ctx, text=str(S.held_out_text()), plan_options=opts, keep_results=False,
                    progress=progress)
    imatrix = table.details.get("imatrix")
    anchors = []
    with S._work() as tmp:
        for mix in mixes:
            out = Path(tmp) / "anchor.gguf"
            quantize_pure(src, out, _base_type(mix), mix.tensor_types(), Path(imatrix) if imatrix else None)
            kl = measure(out, m, [("f16", "f16")], against=ref)[0].mean_kl
            out.unlink()
            anchors.append({"size": mix.size, "table": mix.predicted_loss, "measured": kl})
            log.info("anchor %d bytes: table %.5f, measured %.5f", mix.size, mix.predicted_loss, kl)
    a, b = fitted([(x["table"], x["measured"]) for x in anchors])
    scale = Scale(a, b, anchors, ctx)
    S._write(cached, scale.to_dict())
    return scale
