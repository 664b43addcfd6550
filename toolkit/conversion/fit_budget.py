"""The budget of `ctxq convert MODEL fit --ctx N` on devices: the largest mix whose plan holds N tokens with every
layer on a GPU.

1. The KV pair is the planner's for llama.cpp's Q4_K_M mix (else Q3_K_M, Q2_K: the first whose plan puts every
   layer on the GPUs): auto keeps the least measured loss that fits beside those weights, or the pair given. That
   plan says "what it leaves for weights": on each GPU, its weights plus what stays free. The fit spends that on
   weights and never buys weight bits with a cheaper cache (a plan of a larger fixed mix would: Q5_K_M holds 64k
   on 3x16 + 2x8 GiB for a 70B only beside a q4_0 cache, mean KL 0.07, ten times q8_0's).
2. With that pair fixed, the mix's target size is bisected (`largest_mix`, also the joint search's step per pair): each candidate mix (`fit.choose`: llama.cpp's dry run)
   is written header-only and planned (`planner.plan_for`, CUDA terms, compute buffers and margins included) until
   the largest that still fits every card is found to within `TOLERANCE`.
The token embeddings live in host memory (llama.cpp's input layer is the CPU's): a model with its own output head
gets them at the most precise candidate, at no cost to the GPUs (`host_embeddings`).
Nothing here reads weights: a Hub checkpoint's header plans the same way.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConversionError, DoesNotFit
from ..units import GiB
from . import sensitivity as S
from .fit import Mix, choose, smallest_size

log = logging.getLogger(__name__)

FIXED_MIXES = ("Q4_K_M", "Q3_K_M", "Q2_K")
TOLERANCE = 0.002  # of the target: the bisection stops within it
MAX_STEPS = 12


@dataclass
class Budget:
    mix: Mix
    plan: object  # the plan of the mix at the context: every layer on a GPU
    kv: str  # K/V as the planner chose it for the reference mix
    reference: str  # the fixed mix that chose the pair
    leaves: int  # what the reference plan leaves for weights on the GPUs (weights + free)
    gpu_weights: int  # the mix's weights on the GPUs

    @property
    def fill(self) -> float:
        return self.gpu_weights / self.leaves if self.leaves else 0.0

    def lines(self) -> list[str]:
        out = [f"budget: {self.leaves / GiB:.2f} GiB for weights on the GPUs (the plan of {self.reference} with KV "
               f"{self.kv}); the mix puts {self.gpu_weights / GiB:.2f} GiB there ({100 * self.fill:.1f} %)"]
        for d in self.plan.gpus:
            out.append(f"  {d.device.name}: weights {d.weights / GiB:.2f} GiB, KV {d.kv / GiB:.2f} GiB, compute "
                       f"{(d.compute + d.cuda_extra) / GiB:.2f} GiB, free {d.free / GiB:.2f} GiB of "
                       f"{d.device.usable / GiB:.2f}")
        return out


def _all_on_gpus(plan) -> bool:
    return bool(plan.gpus) and plan.on_cards


def _plan_tensors(src: Path, tensors, folder: Path, name: str, devices, cpu, opts):
    from ..gguf.reader import read_gguf
    from ..planning.derived import write_sparse
    from ..planning.planner import plan_for

    path = folder / f"{name}.gguf"
    write_sparse(read_gguf(src), path, tensors)
    try:
        return plan_for(str(path), devices, cpu, opts)
    except DoesNotFit:
        return None


def host_embeddings(table: S.Table) -> S.Table:
    """llama.cpp keeps the token embeddings in host memory (the input layer is the CPU's): they cost the GPUs
    nothing, so a model with its own output head gets them at the most precise candidate. A tied head reads
    token_embd on the last device too: there they compete like any group."""
    import copy

    names = {g.name for g in table.groups}
    if "token_embd" not in names or "output" not in names:
        return table
    t = copy.copy(table)
    t.bytes, t.loss = dict(table.bytes), dict(table.loss)
    top = max(range(len(table.types)), key=lambda i: (table.bytes["token_embd"][i], -table.loss["token_embd"][i]))
    t.bytes["token_embd"] = [table.bytes["token_embd"][top]] * len(table.types)
    t.loss["token_embd"] = [table.loss["token_embd"][top] if i == top else float("inf")
                            for i in range(len(table.types))]
    return t


def fit_to_plan(src: Path, table: S.Table, n_ctx: int, options=None, **settings) -> Budget:
    """The largest mix of `table` whose plan holds n_ctx tokens on the devices (`settings`: PlanOptions fields,
    over `options`)."""
    from ..planning.devices import resolve_devices
    from ..planning.options import PlanOptions

    opts = (options or PlanOptions()).updated(n_ctx=n_ctx, **settings).resolved()
    devices, cpu = resolve_devices(opts)
    table = host_embeddings(table)
    if not devices:
        raise ConversionError("fit --ctx needs GPUs to fill: --gpus 16,16,8, --profile, --rpc, or GPUs present; "
                              "or give --target-size")
    with tempfile.TemporaryDirectory(prefix="ctxq-fit-plan-") as tmp:
        folder = Path(tmp)
        ref, ref_plan = reference_plan(src, table, folder, devices, cpu, opts)
        kv = f"{ref_plan.type_k}/{ref_plan.type_v}"
        fixed = opts.updated(kv=kv).resolved()
        leaves = sum(d.weights + d.free for d in ref_plan.gpus)
        best = largest_mix(src, table, folder, devices, cpu, fixed)
        if best is None:
            raise ConversionError(f"no mix holds {n_ctx:,} tokens with every layer on these GPUs with KV {kv}")
    mix, plan = best
    return Budget(mix, plan, kv, ref, leaves, sum(d.weights for d in plan.gpus))


def reference_plan(src: Path, table: S.Table, folder: Path, devices, cpu, opts) -> tuple[str, object]:
    """(the fixed mix whose plan chose the pair, that plan): llama.cpp's Q4_K_M, else Q3_K_M, Q2_K, the first whose
    plan puts every layer on the GPUs, else the table's smallest mix."""
    from .dryrun import dry_run

    for qt in FIXED_MIXES:
        p = _plan_tensors(src, dry_run(src, qt), folder, qt, devices, cpu, opts)
        if p is not None and _all_on_gpus(p):
            return qt, p
    smallest = smallest_size(table, src)
    mix = choose(table, smallest, src)
    p = _plan_tensors(src, mix.tensors, folder, "smallest", devices, cpu, opts)
    if p is None or not _all_on_gpus(p):
        raise ConversionError(f"even the smallest mix ({smallest / GiB:.2f} GiB) does not hold {opts.n_ctx:,} "
                              "tokens with every layer on these GPUs: a shorter context, more GPUs, or "
                              "`ctxq plan` for what moves to the CPU")
    return "the smallest mix", p


def largest_mix(src: Path, table: S.Table, folder: Path, devices, cpu, opts, hint: int | None = None,
                tolerance: float = TOLERANCE, room: int | None = None):
    """(mix, plan): the largest mix of `table` whose plan under `opts` (its KV pair fixed) holds every layer on the
    GPUs, its target bisected to within `tolerance` of it; None when not even the smallest does. `hint`, a size
    expected near the answer (another pair's answer moved by the difference of their caches), brackets it in two
    plans. `room`: mix bytes known not to fit (the GPUs' memory less the cache, plus what stays in host memory); a
    larger mix is not planned."""
    smallest = smallest_size(table, src)
    largest = table.fixed_bytes + sum(max(table.bytes[g.name]) for g in table.groups)
    tag = (opts.kv or "kv").replace("/", "-")
    state = {"lo": smallest, "hi": largest, "best": None, "n": 0}

    def probe(target: int) -> bool:
        mix = choose(table, target, src)
        state["n"] += 1
        if room is not None and mix.size > room:
            p = None
        else:
            p = _plan_tensors(src, mix.tensors, folder, f"{tag}-{state['n']}", devices, cpu, opts)
        ok = p is not None and _all_on_gpus(p)
        log.info("fit (KV %s): %.4f GiB %s", opts.kv, mix.size / GiB, "fits" if ok else "does not fit")
        if ok:
            if state["best"] is None or mix.size >= state["best"][0].size:
                state["best"] = (mix, p)
            state["lo"] = max(state["lo"], target)  # the mix of any target up to this one fits
        else:
            state["hi"] = min(state["hi"], target)
        return ok

    if probe(largest):
        return state["best"]
    if hint is not None and smallest < hint < largest:  # a bracket around the hint: 2 % of it each side
        step = max(int(0.02 * hint), 1)
        if probe(hint):
            probe(min(hint + step, largest - 1))
        elif hint - step > smallest:
            probe(hint - step)
    for _ in range(MAX_STEPS):  # invariant: lo fits (or is the smallest), hi does not
        if state["hi"] - state["lo"] <= tolerance * state["lo"]:
            break
        probe((state["lo"] + state["hi"]) // 2)
    if state["best"] is None:
        if not probe(smallest):
            return None
    return state["best"]
