"""`ctxq plan` of a checkpoint, both stages composed: the mix and the K/V pair `ctxq convert MODEL fit --ctx N` would
choose together on the devices (`joint.joint_fit`), from the header alone, with their predicted loss.

No weight is read, so the weights' side is `sensitivity.prior` (each group's bits, weighted by kind), which is not in
KL: it is put in KL per weight of the model (`calibrated`) by one factor, `PRIOR_TO_KL`, measured on SmolLM2-135M
(`scripts/hf_prior_calibration.py`: the prior of the mix at a size against the held-out mean KL of the mix that
`convert … fit` chooses with its measured table at that size). The KV side is ctxq's default table unless `ctxq
quality` measured this model. Both are predictions for this model; the command measures its own table and the
written combination, and may choose another mix or pair.

The search is the command's (the same devices, pairs and bisection), on the pairs the devices run at speed; on
devices that run every pair (CPU, RPC, `--simulate`), only `PLAN_PAIRS`, the ones CUDA's default build runs, so a
plan stays interactive (each pair searched costs a bisection of header-only plans).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConversionError
from . import sensitivity as S

# The prior per weight (sum of PRIOR_WEIGHT x weights x 2^(-2 bits) over the groups / their weights) to mean KL in
# nats: scripts/hf_prior_calibration.py on SmolLM2-135M-Instruct f16 (docs/planner.md, "A checkpoint's fitted mix").
PRIOR_TO_KL = 137.0
CALIBRATION = "SmolLM2-135M's measured fits (scripts/hf_prior_calibration.py)"
# CUDA's default build (GGML_CUDA_FA_QUANTS off): the pairs a plan searches on devices that run every pair
PLAN_PAIRS = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"))
# The bisection of each pair's mix stops within 1 % of its size (the command's within 0.2 %, fit_budget.TOLERANCE):
# each step is a header-only plan (~1.5-5 s for a 70B on 2 CPU cores), and a prediction needs no more.
TOLERANCE = 0.01


@dataclass
class Fitted:
    """The joint choice for a checkpoint: a mix and a K/V pair, and their predicted loss (mean KL, nats)."""

    mix_bytes: int  # the mix's file, by llama.cpp's dry run
    type_k: str
    type_v: str
    weights_loss: float  # the prior, calibrated to KL (`PRIOR_TO_KL`): a prediction, not a measurement
    kv_loss: float  # mean KL of the cache against f16 at the context
    kv_source: str  # where kv_loss comes from
    command: str  # the command that makes it (and measures it)
    searched: list[str] = field(default_factory=list)  # the pairs compared: "q8_0/q8_0 0.0123" or why skipped
    seconds: float = 0.0

    @property
    def total(self) -> float:
        return self.weights_loss + self.kv_loss

    @property
    def pair(self) -> str:
        return f"{self.type_k}/{self.type_v}"

    def basis(self) -> dict:
        return {"weights": f"predicted from the header (ctxq's prior, scaled to KL by {CALIBRATION}); not measured",
                "kv": self.kv_source}

    def to_dict(self) -> dict:
        return {"mix_bytes": self.mix_bytes, "type_k": self.type_k, "type_v": self.type_v,
                "weights_loss": self.weights_loss, "kv_loss": self.kv_loss, "total": self.total,
                "basis": self.basis(), "command": self.command, "pairs": self.searched,
                "seconds": round(self.seconds, 2)}


def calibrated(table: S.Table, src: Path) -> S.Table:
    """A copy of a `prior` table whose losses are mean KL: the prior per weight of the model times PRIOR_TO_KL."""
    from ..gguf.reader import read_gguf

    if table.method != "prior":
        return table
    shapes = {t.name: t.shape for t in read_gguf(src, skip_arrays=True).tensors}
    n = sum(math.prod(shapes[name]) for g in table.groups for name in g.tensors)
    t = copy.copy(table)
    t.loss = {g: [x * PRIOR_TO_KL / n for x in v] for g, v in table.loss.items()}
    return t


def device_flags(options) -> list[str]:
    """The `ctxq convert … fit` flags that describe these devices (and a pair given), from the plan's options."""
    o = options
    flags = []
    for name in ("gpus", "profile", "rpc", "simulate"):
        v = getattr(o, name, None)
        if v is not None:
            flags += [f"--{name}", v if isinstance(v, str) else ",".join(map(str, v))]
    kv = given_pair(o)
    if kv:
        flags += ["--kv", kv]
    return flags


def given_pair(options) -> str | None:
    """The K/V pair the plan's options fix (--kv, -ctk/-ctv; the side not given is f16), None for auto."""
    from ..planning.kvpairs import parse_kv

    pair = parse_kv(options.kv) if options.kv else None
    if pair is None and not (options.type_k or options.type_v):
        return None
    k, v = pair or ("f16", "f16")
    return f"{options.type_k or k}/{options.type_v or v}"


def command(model: str, n_ctx: int, options) -> str:
    import shlex

    return " ".join(["ctxq", "convert", shlex.quote(str(model)), "fit", "--ctx", str(n_ctx),
                     *map(shlex.quote, device_flags(options))])


def fitted(model: str, src: Path, n_ctx: int, options, reference=None) -> Fitted:
    """The mix and pair `ctxq convert MODEL fit --ctx n_ctx` would choose on the options' devices, predicted from the
    header `src` (hfplan.header_gguf). `reference`: a fixed type's plan that holds every layer on the GPUs (its
    weights plus what it leaves free start the first bisection). ConversionError when no mix holds the context
    with every layer on a GPU."""
    from ..gguf.info import model_info
    from ..planning.devices import resolve_devices
    from ..planning.memory.costs import kv_by_layer
    from ..planning.options import PlanOptions
    from .fit import table_for
    from .fit_budget import host_embeddings
    from .joint import Row, candidate_pairs, least_total, pair_losses

    t0 = time.perf_counter()
    kv = given_pair(options)
    opts = PlanOptions(n_ctx=n_ctx, gpus=options.gpus, profile=options.profile, rpc=options.rpc,
                       simulate=options.simulate).resolved()  # what `convert … fit` plans with: the devices only
    devices, cpu = resolve_devices(opts)
    if not devices:
        raise ConversionError("no GPUs to fill (--gpus, --profile, --rpc, --simulate, or GPUs present)")
    info = model_info(str(src))
    pairs = candidate_pairs(info, devices, kv)
    if kv is None and not any(d.backend == "cuda" for d in devices):
        pairs = [p for p in pairs if p in PLAN_PAIRS] or pairs
    losses, _ = pair_losses(src, n_ctx, pairs)
    rows = [Row(k, v, sum(kv_by_layer(info, n_ctx, opts.n_ubatch, k, v)), *losses[(k, v)]) for k, v in pairs]
    table = host_embeddings(calibrated(table_for(src, measure=False), src))
    rows = _search(src, table, rows, devices, cpu, opts, _hint(table, reference, rows))
    best = least_total(rows)
    if best is None:
        raise ConversionError(f"no mix holds {n_ctx:,} tokens with every layer on these GPUs with KV "
                              f"{' or '.join(r.pair for r in rows)}")
    searched = [f"{r.pair} {r.total:.4f}" if r.total is not None else f"{r.pair}: {r.skipped}" for r in rows]
    return Fitted(best.mix.size, best.type_k, best.type_v, best.mix.predicted_loss, best.kv_loss, best.kv_source,
                  command(model, n_ctx, options), searched, time.perf_counter() - t0)


def _hint(table: S.Table, reference, rows) -> tuple[int, int] | None:
    """(a mix size expected to fit, with this cache's bytes) from a fixed type's plan: its weights and free memory
    on the GPUs, plus the token embeddings (host memory) and the header."""
    if reference is None or not reference.gpus or not reference.on_cards:
        return None
    emb = max(table.bytes["token_embd"]) if "token_embd" in table.bytes else 0
    ref = next((r for r in rows if (r.type_k, r.type_v) == (reference.type_k, reference.type_v)), None)
    kv = ref.kv_bytes if ref else sum(d.kv for d in reference.gpus)
    return sum(d.weights + d.free for d in reference.gpus) + emb + S.header_bytes(Path(table.source)), kv


def _least_loss(table: S.Table, size: int) -> float:
    """A lower bound of the loss of any mix of at most `size` bytes (the knapsack at 1 % more: its rounding is
    below that)."""
    from .fit import allocate

    choice = allocate(table.option_costs(), int(size * 1.01) - table.fixed_bytes)
    if choice is None:
        return math.inf
    return sum(table.loss[g.name][i] for g, i in zip(table.groups, choice))


def _search(src: Path, table: S.Table, rows, devices, cpu, opts, hint):
    """`joint.joint_fit`'s search with two more rules that change no answer, from the GPUs' memory alone (no plan): a
    pair whose cache and the smallest mix exceed it holds no mix, and a pair whose cache leaves less than the mix
    that would beat the best total needs (no mix within the rest loses less) cannot win."""
    import tempfile

    from .fit_budget import largest_mix
    from .joint import FIRST, dominated

    skip = {id(rows[i]): o for i, o in dominated(rows).items()} if len(rows) > 1 else {}
    # the largest file any cache leaves room for: the GPUs' memory, the token embeddings (host memory) and the header
    room = sum(d.usable for d in devices) + (max(table.bytes["token_embd"]) if "token_embd" in table.bytes else 0) \
        + S.header_bytes(src)
    smallest = table.fixed_bytes + sum(min(table.bytes[g.name]) for g in table.groups)
    best = prev = None
    with tempfile.TemporaryDirectory(prefix="ctxq-plan-fit-") as tmp:
        for r in sorted(rows, key=lambda r: (r.pair != "/".join(FIRST), r.kv_loss, r.kv_bytes)):
            if id(r) in skip:
                r.skipped = f"dominated by {skip[id(r)].pair}"
                continue
            if best is not None and r.kv_loss >= best.total:
                r.skipped = f"KV alone >= {best.pair}'s total"
                continue
            if smallest + r.kv_bytes > room:
                r.skipped = "no mix fits (the smallest and the cache exceed the GPUs' memory)"
                continue
            if best is not None and _least_loss(table, room - r.kv_bytes) + r.kv_loss >= best.total:
                r.skipped = f"no mix beside this cache can beat {best.pair}'s total"
                continue
            if prev is not None:
                guess = prev.mix.size + prev.kv_bytes - r.kv_bytes
            elif hint is not None:
                guess = hint[0] + hint[1] - r.kv_bytes
            else:
                guess = None
            found = largest_mix(src, table, Path(tmp), devices, cpu, opts.updated(kv=r.pair).resolved(), guess,
                                tolerance=TOLERANCE, room=room - r.kv_bytes)
            if found is None:
                r.skipped = "no mix fits"
                continue
            r.mix, r.plan = found
            r.weights_loss = r.mix.predicted_loss
            prev = r
            if best is None or r.total < best.total:
                best = r
    return rows
