"""`ctxq convert MODEL fit --ctx N`: the K/V cache pair and the per-tensor mix chosen together.

For each pair the devices run at speed (the planner's candidates, `planning.kvpairs`), the mix that fills what that
pair leaves on the cards with every layer on a GPU (`fit_budget.largest_mix`); its predicted total is the mix's
predicted loss (fit's table: mean KL in nats against the source) plus the pair's loss at the context (mean KL
against an f16 cache: `ctxq quality` of this model's f16 or Q8_0 file where cached, else `kvpairs.DEFAULT_KL`).
The least total wins (`least_total`, a pure function over the rows). The two are not exactly additive: the
written combination is measured once (`joint_measure`).

Two rules keep the search short and change no answer: a pair whose cache alone loses at least the best total found
cannot win (a mix loses >= 0), and a pair with a larger cache and no less loss than another is dominated (it leaves
no more room for weights; the plan's memory grows with the cache's bytes). Their rows say why they were skipped.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConversionError
from ..units import GiB, MiB
from . import sensitivity as S
from .fit import Mix

log = logging.getLogger(__name__)

DEFAULT_SOURCE = "ctxq's default table (SmolLM2-135M Q4_1, 2,048 tokens)"  # kvpairs.DEFAULT_KL
FIRST = ("q8_0", "q8_0")  # searched first: the pair llama.cpp's Q4_K_M plan keeps on most cards (a good bound)


@dataclass
class Row:
    """One K/V pair: its cache, its loss, and the mix that fills what it leaves."""

    type_k: str
    type_v: str
    kv_bytes: int  # the cache at the context, every layer
    kv_loss: float  # mean KL against an f16 cache (nats)
    kv_source: str  # where kv_loss comes from
    weights_loss: float | None = None  # the mix's predicted loss on the measurement's scale; None: no mix
    table_loss: float | None = None  # the same from fit's table alone (joint_scale maps one to the other)
    mix: Mix | None = None
    plan: object = None
    skipped: str = ""  # why no mix was searched or none holds the context

    @property
    def pair(self) -> str:
        return f"{self.type_k}/{self.type_v}"

    @property
    def total(self) -> float | None:
        return None if self.weights_loss is None else self.weights_loss + self.kv_loss

    def to_dict(self) -> dict:
        return {"pair": self.pair, "type_k": self.type_k, "type_v": self.type_v, "kv_bytes": self.kv_bytes,
                "mix_bytes": self.mix.size if self.mix else None, "weights_loss": self.weights_loss,
                "table_loss": self.table_loss,
                "kv_loss": self.kv_loss, "kv_source": self.kv_source, "total": self.total,
                "skipped": self.skipped or None}


def least_total(rows: list[Row]) -> Row | None:
    """The row with the least predicted total (weights + KV); rows without a mix are out. Ties: the smaller KV loss
    (the cache's loss is measured on the model, the weights' predicted), then the first."""
    have = [r for r in rows if r.total is not None]
    return min(have, key=lambda r: (r.total, r.kv_loss)) if have else None


def dominated(rows: list[Row]) -> dict[int, Row]:
    """Index of each row -> a row with no larger cache and no more loss, better in one of them."""
    out = {}
    for i, r in enumerate(rows):
        for o in rows:
            if o is not r and o.kv_bytes <= r.kv_bytes and o.kv_loss <= r.kv_loss and \
                    (o.kv_bytes < r.kv_bytes or o.kv_loss < r.kv_loss):
                out[i] = o
                break
    return out


@dataclass
class Joint:
    rows: list[Row]
    chosen: Row
    n_ctx: int
    fixed: bool  # the pair was given (--kv)
    kv_measured_on: str | None  # the file whose `ctxq quality` measurements were used, if any
    notes: list[str] = field(default_factory=list)
    scale: object = None  # joint_scale.Scale: the table's losses on the measurement's scale (None: not mapped)

    def to_dict(self) -> dict:
        c = self.chosen
        return {"type_k": c.type_k, "type_v": c.type_v, "fixed": self.fixed,
                "predicted": {"weights": c.weights_loss, "kv": c.kv_loss, "total": c.total,
                              "weights_table": c.table_loss},
                "kv_measured_on": self.kv_measured_on, "pairs": [r.to_dict() for r in self.rows],
                "scale": self.scale.to_dict() if self.scale else None, "notes": self.notes}

    def table(self) -> list[list[str]]:
        """The rows side by side, as text cells (CLI)."""
        out = []
        for r in self.rows:
            mark = "*" if r is self.chosen else ""
            out.append([mark + r.pair, f"{r.kv_bytes / MiB:,.1f}", f"{r.mix.size / MiB:,.1f}" if r.mix else "-",
                        f"{r.weights_loss:.5f}" if r.weights_loss is not None else "-", f"{r.kv_loss:.5f}",
                        f"{r.total:.5f}" if r.total is not None else r.skipped, _short(r.kv_source)])
        return out


def _short(source: str) -> str:
    return "default table" if source == DEFAULT_SOURCE else source


def candidate_pairs(info, devices, kv: str | None) -> list[tuple[str, str]]:
    """The pairs the devices run at speed for this model (the planner's candidates), or the one `kv` gives:
    ConversionError when the devices cannot run it at speed."""
    from ..planning import kvpairs

    cuda = any(d.backend == "cuda" for d in devices)
    usable = kvpairs.usable_types(info)
    speed = [(k, v) for k, v in kvpairs.at_speed(cuda) if k in usable and v in usable]
    pair = kvpairs.parse_kv(kv) if kv else None  # InvalidOption for what is not a type or K/V
    if pair is None:
        return speed
    bad = next((t for t in pair if t not in usable), None)
    if bad:
        raise ConversionError(f"KV {pair[0]}/{pair[1]}: a {bad} block does not divide this model's heads "
                              f"({info.head_dim_k}-wide K, {info.head_dim_v}-wide V); use one of {', '.join(usable)}")
    if cuda and pair not in kvpairs.cuda_compiled_pairs():
        names = ", ".join(f"{k}/{v}" for k, v in speed)
        raise ConversionError(f"KV {pair[0]}/{pair[1]}: CUDA's flash attention runs only {names} at speed "
                              "(GGML_CUDA_FA_QUANTS; set CTXQ_CUDA_FA_QUANTS for a build with more): choose one of "
                              "them, or drop --kv to let fit choose")
    return [pair]


def check_before_measuring(src: Path, n_ctx: int, kv: str | None, options=None, **settings) -> None:
    """What `joint_fit` refuses after fit's table is measured (minutes), refused before anything is measured: a pair
    the devices cannot run (`candidate_pairs`), and a context that even the smallest mix with the smallest cache of
    those pairs does not hold with every layer on a GPU. The layout alone gives both sizes, and a measured table's
    smallest mix is no smaller (it may leave the IQ types out), so what this refuses could never fit."""
    from ..gguf.info import model_info
    from ..planning.devices import resolve_devices
    from ..planning.memory.costs import kv_by_layer
    from ..planning.options import PlanOptions
    from .fit import choose
    from .fit_budget import _all_on_gpus, _plan_tensors, host_embeddings, smallest_size

    opts = (options or PlanOptions()).updated(n_ctx=n_ctx, **settings).resolved()
    devices, cpu = resolve_devices(opts)
    if not devices:
        return  # joint_fit says what to give
    info = model_info(str(src))
    pairs = candidate_pairs(info, devices, kv)
    k, v = min(pairs, key=lambda p: sum(kv_by_layer(info, opts.n_ctx, opts.n_ubatch, *p)))
    table = host_embeddings(S.prior(S.layout(src), src))
    smallest = smallest_size(table, src)
    with tempfile.TemporaryDirectory(prefix="ctxq-fit-check-") as tmp:
        p = _plan_tensors(src, choose(table, smallest, src).tensors, Path(tmp), "smallest", devices, cpu,
                          opts.updated(kv=f"{k}/{v}").resolved())
    if p is None or not _all_on_gpus(p):
        raise ConversionError(_holds_not(smallest, f"KV {k}/{v}" if kv else f"the smallest cache ({k}/{v})", n_ctx))


def _holds_not(smallest: int, with_kv: str, n_ctx: int) -> str:
    return (f"even the smallest mix ({smallest / GiB:.2f} GiB) with {with_kv} does not hold {n_ctx:,} tokens with "
            "every layer on these GPUs: a shorter context, more GPUs, or `ctxq plan` for what moves to the CPU")


def pair_losses(src: Path, n_ctx: int, pairs: list[tuple[str, str]]):
    """({pair: (mean KL, where it comes from)}, the file measured or None): this model's `ctxq quality`
    measurements at the context (else the longest measured), else ctxq's default table."""
    from ..planning import kvpairs
    from ..planning.quality_store import results
    from .joint_measure import MAX_MEASURE_CTX, precise_files

    found, where, on = {}, None, ""
    held, ctx = S.held_out_text().name, min(n_ctx, MAX_MEASURE_CTX)
    for f in precise_files(src):  # first: the text and context the written combination is measured on
        found = {(r.type_k, r.type_v): r for r in results(str(f)) if r.text == held and r.n_ctx == ctx}
        if found:
            where, on = f, ", the held-out half"
            break
    for f in precise_files(src) if not found else ():
        found = kvpairs.measurements(str(f), n_ctx)
        if found:
            where = f
            break
    out = {}
    for k, v in pairs:
        r = found.get((k, v))
        if (k, v) in (("f16", "f16"), ("bf16", "bf16"), ("f32", "f32")):
            out[(k, v)] = (0.0, "the reference")
        elif r is not None:
            out[(k, v)] = (r.mean_kl, f"measured on {where.name} at {r.n_ctx:,} tokens{on}")
        else:
            key = tuple("f16" if t in ("bf16", "f32") else t for t in (k, v))
            out[(k, v)] = (kvpairs.DEFAULT_KL.get(key, float("inf")), DEFAULT_SOURCE)
    return out, where


def joint_fit(src: Path, table: S.Table, n_ctx: int, *, kv: str | None = None, also=(), options=None,
              progress=None, only=None, **settings) -> Joint:
    """The pair and the mix with the least predicted total loss that hold n_ctx tokens with every layer on the
    devices' GPUs (`settings`: PlanOptions fields, over `options`). `kv` fixes the pair; `also`: pairs whose mix is
    searched even where the rules above would skip them (a benchmark's fixed rows); `only`: the candidates limited
    to these pairs (a benchmark's measured pairs)."""
    from ..gguf.info import model_info
    from ..planning.devices import resolve_devices
    from ..planning.memory.costs import kv_by_layer
    from ..planning.options import PlanOptions
    from .fit_budget import host_embeddings, largest_mix, reference_plan
    from .joint_measure import MAX_MEASURE_CTX

    opts = (options or PlanOptions()).updated(n_ctx=n_ctx, **settings).resolved()
    devices, cpu = resolve_devices(opts)
    if not devices:
        raise ConversionError("fit --ctx needs GPUs to fill: --gpus 16,16,8, --profile, --rpc, --simulate, or GPUs "
                              "present; or give --target-size")
    info = model_info(str(src))
    notes, given = [], kv is not None
    if table.method != "kl" and kv is None:  # the weights' error is not KL: it cannot be weighed against a cache's
        with tempfile.TemporaryDirectory(prefix="ctxq-fit-ref-") as tmp:
            ref, p = reference_plan(src, table, Path(tmp), devices, cpu, opts)
        kv = f"{p.type_k}/{p.type_v}"
        notes.append(f"the {table.method} method ranks the weights by their error, not KL, so the pair is not chosen "
                     f"with the mix: KV {kv}, the planner's for {ref} (--method kl chooses both; --kv fixes it)")
    pairs = candidate_pairs(info, devices, kv)
    if only is not None:
        pairs = [p for p in pairs if p in set(map(tuple, only))]
    also = [tuple(p) for p in also]
    losses, where = pair_losses(src, n_ctx, pairs + [p for p in also if p not in pairs])
    rows = [Row(k, v, sum(kv_by_layer(info, opts.n_ctx, opts.n_ubatch, k, v)), *losses[(k, v)])
            for k, v in dict.fromkeys(pairs + [p for p in also if p not in pairs])]
    table = host_embeddings(table)
    scale = None  # the table's sums on the measurement's scale (joint_scale): measured once a mix fits
    skip = {} if kv else {id(rows[i]): o for i, o in dominated(rows).items()}
    order = sorted(rows, key=lambda r: (r.pair != "/".join(FIRST), r.kv_loss, r.kv_bytes))
    best, prev = None, None
    with tempfile.TemporaryDirectory(prefix="ctxq-fit-joint-") as tmp:
        for r in order:
            forced = (r.type_k, r.type_v) in also
            if id(r) in skip and not forced:
                r.skipped = f"dominated by {skip[id(r)].pair}"
                continue
            if best is not None and r.kv_loss >= best.total and not forced:
                r.skipped = f"KV alone >= {best.pair}'s total"
                continue
            hint = prev.mix.size + prev.kv_bytes - r.kv_bytes if prev is not None else None
            found = largest_mix(src, table, Path(tmp), devices, cpu, opts.updated(kv=r.pair).resolved(), hint)
            if found is None:
                r.skipped = "no mix fits"
                continue
            r.mix, r.plan = found
            if scale is None and table.method == "kl":
                from .joint_scale import weights_scale

                scale = weights_scale(src, table, n_ctx, progress=progress)
            r.table_loss = r.mix.predicted_loss
            r.weights_loss = scale(r.table_loss) if scale else r.table_loss
            prev = r
            if best is None or r.total < best.total:
                best = r
    chosen = least_total([r for r in rows if (r.type_k, r.type_v) in pairs])
    if chosen is None:
        smallest = table.fixed_bytes + sum(min(table.bytes[g.name]) for g in table.groups)
        with_kv = f"KV {rows[0].pair}" if kv else f"the smallest cache ({min(rows, key=lambda r: r.kv_bytes).pair})"
        raise ConversionError(_holds_not(smallest, with_kv, n_ctx))
    if any(r.kv_source == DEFAULT_SOURCE for r in rows):
        notes.append(f"KV losses not measured on this model come from {DEFAULT_SOURCE}; measure them where the "
                     f"result is measured: ctxq quality {src} --ctx {min(n_ctx, MAX_MEASURE_CTX)} -f "
                     f"{S.held_out_text()} --kv all")
    return Joint(rows, chosen, n_ctx, given, str(where) if where else None, notes, scale)
