"""`ctxq convert MODEL fit`: a type per tensor group, the least predicted loss under a byte budget.

The budget is a file size (`target_size`) or what a plan leaves for weights on the devices at the context asked
(`ctxq.conversion.fit_budget`). `sensitivity` says what each group costs at each candidate type; `allocate` picks
one type per group with the least total predicted loss within the bytes (a multiple-choice knapsack, solved exactly
where ExLlamaV3 takes upgrades greedily by loss per byte: on few coarse groups the greedy order can leave twice the
optimum's loss). llama.cpp's quantizer writes the file with those types (`tensor_types`, its `--tensor-type`), its
dry run first: the size is exact before anything is written.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConversionError, CtxqError
from ..units import MiB
from . import sensitivity as S

log = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*([\d.]+)\s*([kmgt]?i?b?)\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """"80MiB", "40GB", "1.5 GiB", 123456 -> bytes (SI for kB/MB/GB, binary for KiB/MiB/GiB)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise CtxqError(f"cannot read the size {text!r}: give a number with a unit, such as 80MiB or 40GB")
    return int(float(m.group(1)) * unit)


def allocate(costs: list[list[tuple[int, float]]], budget: int, resolution: int = 100_000) -> list[int] | None:
    """One option per group (costs[g] = [(bytes, loss), ...]) with total bytes <= budget and the least total loss;
    None when even the smallest options exceed the budget. A multiple-choice knapsack solved exactly by dynamic
    programming over the bytes above the smallest choice in `resolution` steps (each option's extra bytes rounded up
    to a step, so the sum can only come out under the budget: at most one step per group is given away)."""
    import numpy as np

    floor = [min(b for b, _ in c) for c in costs]  # the knapsack runs over the bytes above each group's least
    spare = budget - sum(floor)
    if spare < 0:
        return None
    unit = max(1, -(-spare // resolution))
    cap = spare // unit
    best = np.zeros(cap + 1)  # least loss of the groups so far within u steps
    picks = np.zeros((len(costs), cap + 1), dtype=np.int16)
    steps = [[-(-(b - floor[g]) // unit) for b, _ in c] for g, c in enumerate(costs)]
    for g, options in enumerate(costs):
        new = np.full(cap + 1, np.inf)
        for i, (_, loss) in enumerate(options):
            w = steps[g][i]
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[:cap + 1 - w] + loss
            better = cand < new
            new[better] = cand[better]
            picks[g][better] = i
        best = new
    if not np.isfinite(best[cap]):
        return None
    choice, u = [0] * len(costs), cap
    for g in range(len(costs) - 1, -1, -1):
        i = int(picks[g][u])
        choice[g] = i
        u -= steps[g][i]
    return choice


@dataclass
class Mix:
    """A per-group choice: the types, the bytes and the predicted loss."""

    table: S.Table
    choice: list[int]
    tensors: list[tuple[str, tuple, int]] = field(default_factory=list)  # the dry run's (name, shape, type)
    size: int = 0  # the file's bytes (from the dry run)

    def group_types(self) -> dict[str, str]:
        return {g.name: self.table.types[i] for g, i in zip(self.table.groups, self.choice)}

    def tensor_types(self) -> dict[str, str]:
        return {n: self.table.types[i] for g, i in zip(self.table.groups, self.choice) for n in g.tensors}

    @property
    def predicted_loss(self) -> float:
        return sum(self.table.loss[g.name][i] for g, i in zip(self.table.groups, self.choice))

    def summary(self) -> list[str]:
        """A line per group kind: how many groups at each type, and their bytes."""
        from gguf import GGMLQuantizationType as T

        by_kind: dict[str, dict[str, int]] = {}
        nbytes: dict[str, int] = {}
        shapes = {n: (s, t) for n, s, t in self.tensors}
        for g, i in zip(self.table.groups, self.choice):
            got = sorted({T(shapes[n][1]).name for n in g.tensors} if shapes else {self.table.types[i]})
            key = "+".join(got)
            by_kind.setdefault(g.kind, {}).setdefault(key, 0)
            by_kind[g.kind][key] += 1
            nbytes[g.kind] = nbytes.get(g.kind, 0) + self.table.bytes[g.name][i]
        return [f"{kind}: " + ", ".join(f"{n} x {t}" for t, n in sorted(c.items(), key=lambda x: -x[1]))
                + f" ({nbytes[kind] / MiB:,.1f} MiB)" for kind, c in by_kind.items()]


def choose(table: S.Table, target: int, src: Path) -> Mix:
    """The least-loss mix whose file (llama.cpp's dry run, header included) is at most `target` bytes."""
    from ..gguf.writer import sparse_size
    from .dryrun import dry_run, written_header_bytes

    smallest = smallest_size(table, src)
    budget = target - table.fixed_bytes
    for _ in range(4):
        choice = allocate(table.option_costs(), budget)
        if choice is None:
            raise ConversionError(_below_smallest(target, smallest))
        mix = Mix(table, choice)
        mix.tensors = dry_run(src, _base_type(mix), tensor_types=mix.tensor_types(), pure=True)
        # the file `fit` writes holds the keys of the matrix it is quantized with. (The dry run needs no matrix: a
        # pure run's types never read it, llama-quant.cpp's llama_tensor_get_type, and a lean worker is 0.4 s faster)
        mix.size = sparse_size(written_header_bytes(src, mix_imatrix(mix)), mix.tensors)
        if mix.size <= target:
            return mix
        budget -= mix.size - target  # the header grew (the quantizer's keys): give those bytes back
    raise ConversionError(f"no mix of this model comes within {target:,} bytes: give a slightly larger target")


def check_target(src: Path, target: int) -> None:
    """`choose`'s refusal of a target below the smallest mix, before fit's table is measured (minutes): the layout
    alone gives the smallest mix, and a measured table's is no smaller (it may leave the IQ types out)."""
    table = S.layout(src)
    if target < table.fixed_bytes + sum(min(table.bytes[g.name]) for g in table.groups):
        raise ConversionError(_below_smallest(target, smallest_size(table, src)))


def _below_smallest(target: int, smallest: int) -> str:
    return (f"{target / MiB:,.1f} MiB is below the smallest mix of this model ({smallest / MiB:,.1f} MiB, every "
            "group at its smallest type): give a larger target, or more memory")


def smallest_size(table: S.Table, src: Path) -> int:
    """The bytes of `table`'s smallest mix at most: every group at its least bytes, and a header that holds the
    matrix's keys when the table has a matrix (its least types are then IQ types, written with it)."""
    from ..gguf.writer import DEFAULT_ALIGNMENT
    from .dryrun import written_header_bytes

    keys = 0
    if table.details.get("imatrix"):  # (+ one alignment: the header's padding may take a step more)
        keys = written_header_bytes(src, Path(table.details["imatrix"])) - written_header_bytes(src) + DEFAULT_ALIGNMENT
    return table.fixed_bytes + sum(min(table.bytes[g.name]) for g in table.groups) + keys


def mix_imatrix(mix: Mix) -> Path | None:
    """The importance matrix `fit` writes `mix` with: the table's (ctxq's own, which quantized its IQ types) when a
    tensor type takes one (`quantize.wants_imatrix`), else none (the K types as the table measured them)."""
    from .quantize import wants_imatrix

    path = mix.table.details.get("imatrix")
    return Path(path) if path and wants_imatrix(_base_type(mix), mix.tensor_types()) else None


def _base_type(mix: Mix) -> str:
    """The file type llama.cpp writes in the header (general.file_type): the type holding the most bytes."""
    held: dict[str, int] = {}
    for g, i in zip(mix.table.groups, mix.choice):
        held[mix.table.types[i]] = held.get(mix.table.types[i], 0) + mix.table.bytes[g.name][i]
    return max(held, key=held.get)


@dataclass
class FitResult:
    path: Path | None  # None for a header without weights: the mix is planned, not written
    size: int
    target: int
    mix: Mix
    method: str
    quality: dict | None = None  # mean_kl, top1_agreement, ... on held-out text against the source
    plan: object = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    joint: object = None  # fit --ctx: the pairs searched and the one chosen (`joint.Joint`)

    def to_dict(self) -> dict:
        from gguf import GGMLQuantizationType as T

        return {"path": str(self.path) if self.path else None, "size": self.size, "target": self.target,
                "method": self.method, "measured_on": self.mix.table.measured_on,
                "predicted_loss": self.mix.predicted_loss, "groups": self.mix.group_types(),
                "tensors": {n: T(t).name for n, _, t in self.mix.tensors}, "summary": self.mix.summary(),
                "quality": self.quality, "seconds": round(self.seconds, 2), "notes": self.notes,
                "plan": self.plan.to_dict() if self.plan is not None and hasattr(self.plan, "to_dict") else None,
                **(self.joint.to_dict() if self.joint is not None else {})}


def table_for(src: Path, method: str = "kl", *, measure: bool = True, progress=None, plan_options=None,
              imatrix: Path | bool = True) -> S.Table:
    """The layout and losses of `src` by `method` (kl, error; prior without weights). `imatrix` (`S.measure`): True,
    ctxq's own importance matrix (the IQ types among the candidates, the errors weighted by it); a path, that one;
    False, none (no IQ candidates, the errors unweighted, and so no matrix in the file written)."""
    table = S.layout(src)
    if not measure:
        return S.prior(table, src)
    return S.measure(table, src, method=method, progress=progress, plan_options=plan_options, imatrix=imatrix)


def fit(src: str | os.PathLike, target: int, output: str | os.PathLike | None = None, *, method: str = "kl",
        progress=None, check: bool = True, held_out: bool = True, force: bool = False,
        table: S.Table | None = None, mix: Mix | None = None) -> FitResult:
    """Quantize the GGUF `src` to the least-loss mix of at most `target` bytes (or `mix`, chosen already), written
    at `output` (default `<name>-fit-<size>.gguf` beside it); its KL against `src` on held-out text when `held_out`."""
    from .quantize import quantize_gguf

    t0 = time.perf_counter()
    src = Path(src)
    if not src.is_file():
        raise ConversionError(f"{src}: no such file; pass a GGUF model (or a Hugging Face model folder)")
    if mix is None:
        table = table or table_for(src, method, progress=progress)
        mix = choose(table, target, src)
    table = mix.table
    dst = Path(output) if output else src.with_name(f"{_stem(src)}-fit-{_size_label(target)}.gguf")
    res = quantize_gguf(src, dst, _base_type(mix), pure=True, tensor_types=mix.tensor_types(), check=check,
                        force=force, progress=progress, imatrix=mix_imatrix(mix))
    if res.size != mix.size:  # the dry run is the quantizer's own: a difference is a bug to hear about
        log.warning("the fitted file is %d bytes, its dry run said %d", res.size, mix.size)
    result = FitResult(res.path, res.size, target, mix, table.method, seconds=0.0)
    if held_out:
        result.quality = held_out_quality(res.path, src)
    result.seconds = time.perf_counter() - t0
    return result


def held_out_quality(path: Path, src: Path, n_ctx: int = 2048) -> dict:
    """Mean KL, p99, top-1 agreement against `src` on the held-out half of the built-in text."""
    from ..quality.measurement import Measurement, measure

    r = measure(path, Measurement(n_ctx=n_ctx, text=str(S.held_out_text())), against=src)[0]
    return {"mean_kl": r.mean_kl, "p99_kl": r.p99_kl, "top1_agreement": r.top1_agreement, "ppl": r.ppl,
            "n_scored": r.n_scored, "text": "licences (held-out half)", "n_ctx": n_ctx, "reference": Path(src).name}


def _stem(src: Path) -> str:
    from .quantize import default_output_name

    return default_output_name(src, "F16")[: -len("-F16.gguf")]


def _size_label(n: int) -> str:
    return f"{n / (1 << 30):.1f}GiB" if n >= 1 << 30 else f"{n / MiB:.0f}MiB"
