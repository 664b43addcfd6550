"""The micro-batch (`-ub`, tokens per graph evaluation) chosen by measurement (issue 44).

A micro-batch sizes every card's compute buffer, so each one is a plan of its own: a larger one can move layers
or not fit at all, and which is faster depends on the devices (on GPUs a larger one fills the card at prefill; on
the CPU workers tried here a smaller one was not slower: docs/planner.md). So the planner takes llama.cpp's default
(512) unless `ctxq bench -ub 128,256,…` measured several micro-batches of this model on these devices
(`speed_store.ubatches`): then each measured one is planned again (its compute buffers, its split, its mode under
`-sm auto`), and the plan with the least measured time for the workload (`--prompt-tokens` of prefill, then
`--gen-tokens` generated) among those that fit is taken. Never over a micro-batch or batch the user gave: the
caller does not ask when `-ub` was given, and no micro-batch above `-b` is tried.
"""

from __future__ import annotations

from typing import Callable

from ..errors import CtxqError
from .speed import store as speed_store
from .speed.reading import workload
from .options import DEFAULT_N_UBATCH, PlanOptions
from .plan import Plan



def estimated_s(p: Plan, info, g, opts: PlanOptions, shape=None) -> float | None:
    """The workload's estimated seconds on plan `p` (planning/speed/model.py; None where the devices say too little)."""
    from .speed import model as speed

    shape = shape or speed.model_shape(info, p.type_k, p.type_v, g)
    work = speed.Workload(*workload(opts), n_ubatch=opts.n_ubatch, n_batch=opts.n_batch)
    return speed.estimate(shape, speed.placement_from_plan(p), work).total_s


# Micro-batches searched by estimate where a plan keeps weights in host memory: each micro-batch of 32+ tokens copies
# them to the first card (ggml_backend_sched_compute_splits), so a larger one copies them fewer times, and its larger
# compute buffers may move more weights to the host. 4096: llama-bench's largest in published -ub sweeps.
SPILL_UBATCHES = (512, 1024, 2048, 4096)


def _holds_host_weights(p: Plan) -> bool:
    return bool(p.cpu_ffn_layers or p.cpu_expert_layers or p.cpu_layers) and any(g.device.kind == "gpu"
                                                                                  for g in p.gpus)


def _estimated_total(p: Plan) -> float | None:
    """The workload's estimated seconds the plan carries (`speed["read"]`, planning/speed/reading.py)."""
    r = p.speed.get("read") or {}
    if r.get("measured") or not r.get("prefill_s") or not r.get("decode_tps"):
        return None
    return r["prefill_s"] + r.get("gen_tokens", 0) / r["decode_tps"]


def by_estimate(base: Plan, opts: PlanOptions, replan: Callable[..., Plan], batch_given: bool) -> Plan:
    """A plan that keeps weights in host memory, at the micro-batch of SPILL_UBATCHES (with -b raised to it unless
    the user gave -b) the estimate times fastest for the workload among those that fit; stated once in the reason
    with the others' times, `speed["ubatch"]` carries them."""
    if not _holds_host_weights(base) or _estimated_total(base) is None:
        return base
    plans, refused = {base.n_ubatch: base}, {}
    pair = f"{base.type_k}/{base.type_v}"  # the pair the quality setting chose holds: a micro-batch never trades it
    for ub in SPILL_UBATCHES:
        if ub == base.n_ubatch or (batch_given and ub > opts.n_batch):
            continue
        try:
            plans[ub] = replan(ub, opts.n_batch if batch_given else max(opts.n_batch, ub), pair)
        except CtxqError as e:  # its compute buffers do not fit, or another reason of the planner's
            refused[ub] = str(e).split(":")[0]
    totals = {ub: t for ub, p in plans.items() if (t := _estimated_total(p)) is not None}
    best = min(totals, key=lambda ub: (totals[ub], ub != base.n_ubatch))
    p = plans[best]
    others = ", ".join(f"-ub {ub} {totals[ub]:.0f} s" for ub in sorted(totals) if ub != best)
    prompt, gen = workload(opts)
    said = (f"-ub {best} -b {p.n_batch} estimated fastest for {prompt:,} prompt and {gen} generated tokens: "
            f"{totals[best]:.0f} s" + (f" against {others}" if others else "")
            + " (each micro-batch copies the weights kept in host memory to the first card)")
    if refused:
        said += "; does not fit: " + ", ".join(f"-ub {ub}" for ub in sorted(refused))
    if p is not base:  # the pair was held fixed for the replan: the base's reasons for it stand
        p.reason, p.kv_quality = base.reason, base.kv_quality
        if "kv" in base.speed:
            p.speed = {**p.speed, "kv": base.speed["kv"]}
    p.reason += f"; {said}"
    p.speed = {**p.speed, "ubatch": {"n_ubatch": best, "n_batch": p.n_batch, "estimated": totals,
                                     "refused": refused, "basis": "estimated"}}
    return p


def chosen(base: Plan, opts: PlanOptions, replan: Callable[..., Plan], batch_given: bool = False) -> Plan:
    """`base` (planned at the options' micro-batch) or the plan at another measured micro-batch that is faster for
    the workload by `ctxq bench`'s measurements; the plan's note (and its reason, where the micro-batch changes)
    says which and why, `speed["ubatch"]` carries the figures. `replan(n_ubatch, n_batch, kv=None)` plans the same
    options at `-ub n_ubatch -b n_batch` (and that K/V pair). Unmeasured, a plan with weights in host memory is
    searched by estimate (`by_estimate`)."""
    prompt, gen = workload(opts)
    local = speed_store.key(base) is not None  # not a local file (a Hub plan): nothing can have been measured yet
    cands = sorted({u for u in (speed_store.ubatches(base) if local else []) if u <= opts.n_batch} | {base.n_ubatch})
    plans: dict[int, Plan] = {}
    refused: dict[int, str] = {}
    for ub in cands:
        try:
            plans[ub] = base if ub == base.n_ubatch else replan(ub, opts.n_batch)
        except CtxqError as e:  # the larger compute buffers do not fit, or another reason of the planner's
            refused[ub] = str(e)
    totals = {}
    for ub, p in plans.items():
        m = speed_store.lookup(p)
        t = m.total_s(prompt, gen) if m is not None else None
        if t is not None and not any(g.total > g.device.usable for g in p.gpus):
            totals[ub] = t
    if len(totals) < 2:
        searched = by_estimate(base, opts, replan, batch_given)  # the plan itself where it holds no host weights
        if searched is not base or "ubatch" in base.speed:
            return searched
        base.notes.append(_unmeasured_note(base, totals, cands))
        base.speed = {**base.speed, "ubatch": {"n_ubatch": base.n_ubatch, "measured": totals, "basis": "default"}}
        return base
    best = min(totals, key=lambda ub: (totals[ub], ub != base.n_ubatch))  # a tie keeps the default
    p = plans[best]
    others = ", ".join(f"-ub {ub} {totals[ub]:.1f} s" for ub in sorted(totals) if ub != best)
    left = "".join(f"; -ub {ub} does not fit: {why}" for ub, why in sorted(refused.items()))
    unmeasured = [ub for ub in sorted(plans) if ub not in totals]
    if unmeasured:
        left += "; not measured with these settings: " + ", ".join(f"-ub {ub}" for ub in unmeasured)
    p.notes.append(f"micro-batch: -ub {best}, measured: {totals[best]:.1f} s for {prompt:,} prompt and {gen} generated "
                   f"tokens by ctxq bench on these devices, against {others}{left}")
    if best != base.n_ubatch:
        p.reason += (f"; -ub {best} (measured {totals[best]:.1f} s for the workload against "
                     f"{totals.get(base.n_ubatch, float('nan')):.1f} s at -ub {base.n_ubatch})"
                     if base.n_ubatch in totals else f"; -ub {best} (measured fastest for the workload)")
    p.speed = {**p.speed, "ubatch": {"n_ubatch": best, "measured": totals, "refused": refused, "basis": "measured"}}
    return p


def _unmeasured_note(p: Plan, totals: dict, cands: list[int]) -> str:
    what = ("llama.cpp's default" if p.n_ubatch == DEFAULT_N_UBATCH else "as the options give it")
    measured = f" (only -ub {next(iter(totals))} is measured with these settings)" if totals else ""
    if _holds_host_weights(p):  # each micro-batch copies the host weights to the card: larger ones, fewer copies
        sizes = ",".join(str(u) for u in sorted({*SPILL_UBATCHES, *cands}))
        why = ("; each micro-batch copies the weights kept in host memory to the first card, so larger ones copy "
               "them fewer times (with -b at least as large)")
    else:
        sizes = ",".join(str(u) for u in sorted({128, 256, 512, 1024, *cands}) if u <= max(p.n_batch, 512))
        why = ""
    return (f"micro-batch: -ub {p.n_ubatch}, {what}, not chosen by measurement{measured}: `ctxq bench` with the same "
            f"options and -ub {sizes} measures each; the plan then takes the fastest that fits{why}")
