"""The faster of several speed estimates (planning/speed/model.py), and why in words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

SpeedEstimate = Any  # planning/speed/model.SpeedEstimate (model.py imports this module, not the other way)


@dataclass
class Choice:
    """The faster candidate for a workload (None when none can be estimated) and why, in words."""

    best: SpeedEstimate | None
    reason: str


def choose(candidates: Sequence[SpeedEstimate]) -> Choice:
    """The candidate with the least total time for its workload, and a sentence saying why (estimates)."""
    known = [c for c in candidates if c.total_s is not None]
    unknown = [c for c in candidates if c.total_s is None]
    why_not = "; ".join(dict.fromkeys(m.split(": ", 1)[-1] for c in unknown for m in c.missing))
    if not known:
        return Choice(None, f"cannot compare the candidates' speed: {why_not or 'none given'}")
    best = min(known, key=lambda c: c.total_s)
    w = best.workload
    text = (f"{best.mode} mode is estimated fastest for {w.prompt_tokens:,} prompt and {w.gen_tokens:,} generated "
            f"tokens: {best.total_s:.1f} s")
    for o in known:
        if o is not best:
            text += (f"; {o.mode} mode {o.total_s:.1f} s ({best.mode} mode's prefill "
                     f"{_ratio(o.prefill_s, best.prefill_s)} as fast, its decode "
                     f"{_ratio(best.decode_tps, o.decode_tps)}{_why(best, o)})")
    if unknown:
        text += f"; {', '.join(sorted({c.mode for c in unknown}))} mode not compared: {why_not}"
    return Choice(best, text + " (estimates, not measurements)")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "?"


def _why(best: SpeedEstimate, other: SpeedEstimate) -> str:
    """What tips it: tensor mode's all-reduces, or its cards working at once."""
    tensor = best if best.mode == "tensor" else other if other.mode == "tensor" else None
    if tensor is None or not tensor.prefill_s or tensor.prefill_links_s is None:
        return ""
    share = f"all-reduces take {tensor.prefill_links_s / tensor.prefill_s:.0%} of tensor mode's prefill"
    return f"; every card works on every layer at once, {share}" if tensor is best else f"; {share}"
