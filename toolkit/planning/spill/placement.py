"""Weights in host memory, never the cache: the placement for a model one size too big for the cards at the context.

When the cards cannot hold every layer, llama.cpp's `-ngl` leaves whole layers on the CPU, their KV cache with them:
attention over that cache then runs on the CPU (op offload copies a CPU layer's *weights* to the first card for
batches of 32+ tokens; the cache is no weight), quadratic work in the context on the slowest device. Here the dense
FFN weights of chosen layers go to host memory instead (`tensor_buft_overrides`, llama.cpp's `-ot
blk\\.N\\.ffn_(up|down|gate|gate_up)\\.=CPU`) and every layer's attention, norms and KV cache stay on its card. A
mixture of experts keeps its routed experts there first (planner._search_experts), then its shared experts
and dense layers' FFN (`ffn_*_shexp`, gguf.info.FFN_RE).

`search` finds that placement, a mixture-of-experts model's routed experts and the dense FFN by one mechanism: first
every such weight in host memory and the rest of each layer split over the cards (whole layers go to the CPU only for
what even that does not hold, as few as possible: a mixed placement, the cache leaving the cards last), then each card
takes back the FFN, then the experts, of as many of its layers as it holds, its first layers keeping theirs on the host. `chosen` takes it or the whole-layer plan by `PlanOptions.offload`; "auto" by the
workload's estimated seconds (planning/speed/reading.timed), the weights when the devices say too little to estimate.
"""

from __future__ import annotations

from ..devices import Device
from ..layers.search import best_split, layout, least_held, take_back
from ..memory.costs import Costs, host_cost
from ..options import PlanOptions
from ..speed.reading import timed, workload


def spillable(c: Costs) -> list[int]:
    """The layers with dense FFN weights a plan may keep in host memory."""
    return [il for il, b in enumerate(c.layer_ffn) if b and il not in c.mtp_layers]


EXPERTS, FFN = "experts", "ffn"  # what a plan may keep in host memory, in the order it leaves the cards


def search(c: Costs, devices: list[Device], cpu: Device, opts: PlanOptions, make_plan, kinds: tuple[str, ...]):
    """(plan or None, host): the weights of `kinds` leave the cards before any layer does, the cache last.

    `kinds` in the order they leave: a mixture's routed experts (EXPERTS: every expert layer's), then its shared
    experts' or the dense FFN (FFN: `spillable`); `c.cpu_experts` holds the user's experts when EXPERTS is not asked.
    With all of them in host memory the cards take as many layer slots as they can (`best_split`); the slots left over
    go to the CPU as whole layers with their cache: only what no spill holds, as few as possible. Then each card takes
    back what it has room for, FFN first (every token reads it; a routed expert only n_expert_used of n_expert), its
    last layers first, so the host keeps a prefix of each card's layers (`take_back`). As llama.cpp's --fit does for a
    MoE (common/fit.cpp), but each card chooses among its own layers, so none is over its capacity. None where the host
    cannot hold its part, or `kinds` leaves nothing to move. `make_plan(costs, slots, order, counts, gplans, host)`."""
    n = c.info.n_layer
    bare = c
    if EXPERTS in kinds:
        bare = bare.with_cpu_experts(c.info.expert_layers)
    if FFN in kinds:
        bare = bare.with_cpu_ffn(spillable(c))
    if not devices or (bare.cpu_experts == c.cpu_experts and bare.cpu_ffn == c.cpu_ffn):
        return None, None
    found = best_split(bare, devices, opts.reorder)
    if found is None:
        return None, host_cost(bare, n + 1, 0, cpu)
    slots, order, counts = found
    ds = [devices[i] for i in order]

    def restore(cand: list[int]) -> Costs:
        got = bare
        for kind in reversed(kinds):
            held, place = (got.cpu_ffn, got.with_cpu_ffn) if kind == FFN else (got.cpu_experts, got.with_cpu_experts)
            got = take_back(got, ds, cand, held, place)
        return got

    best = least_held(bare, ds, slots, counts, restore, lambda got: (len(got.cpu_ffn), len(got.cpu_experts)))
    if best is None:  # the split found does not hold once costed exactly
        return None, host_cost(bare, n + 1 - slots, sum(1 for k in counts if k), cpu)
    cf, cand = best
    n_cpu = n + 1 - slots  # whole layers on the CPU: their FFN is there with them, no override needed
    cf = cf.with_cpu_ffn(il for il in cf.cpu_ffn if il >= n_cpu)
    host = host_cost(cf, n_cpu, sum(1 for k in cand if k), cpu, cand)
    if host.total > host.device.usable:
        return None, host
    return make_plan(cf, slots, order, cand, layout(cf, ds, cand), host), host


def chosen(layers_plan, weights_plan, info, g, opts: PlanOptions):
    """The whole-layer plan or the one with FFN weights in host memory, by `opts.offload`; the other's estimate is kept
    in the chosen plan's `speed["offload"]`, which `reading` prints beside its own."""
    if layers_plan is not None and layers_plan.cpu_layers == 0:
        return layers_plan  # every layer on the cards: nothing to spill
    if opts.offload == "weights" or layers_plan is None:
        pick, other = weights_plan, layers_plan
    elif opts.offload == "layers" or weights_plan is None:
        pick, other = layers_plan, weights_plan
    else:  # by `ctxq bench`'s measurements of both on these devices, else by estimate
        mw, ml = _measured_s(weights_plan, opts), _measured_s(layers_plan, opts)
        if mw is not None and ml is not None:
            faster_layers = ml < mw
        else:
            tw, tl = timed(weights_plan, info, g, opts), timed(layers_plan, info, g, opts)
            faster_layers = tw.total_s is not None and tl.total_s is not None and tl.total_s < tw.total_s
        pick, other = (layers_plan, weights_plan) if faster_layers else (weights_plan, layers_plan)
    if pick is None:
        return None
    if other is not None:
        t = timed(other, info, g, opts)
        pick.speed = {**pick.speed, "offload": {"other": "layers" if other is layers_plan else "weights",
                                                "other_prefill_s": t.prefill_s, "other_total_s": t.total_s,
                                                "other_cpu_layers": other.cpu_layers,
                                                "other_cpu_ffn_layers": len(other.cpu_ffn_layers)}}
    return pick


def _measured_s(p, opts: PlanOptions) -> float | None:
    """The workload's seconds at `ctxq bench`'s measured rates of this plan on these devices, or None."""
    from ..speed import store as speed_store

    m = speed_store.lookup(p)
    return m.total_s(*workload(opts)) if m is not None else None


def describe(p) -> str | None:
    """What the plan keeps in host memory, in one line, where it spills weights."""
    if not p.cpu_ffn_layers:
        return None
    nbytes = p.host.cpu_ffn_bytes
    what = "the shared-expert or dense FFN" if p.expert_layers else "the FFN"
    line = f"weights in host memory: {what} of {len(p.cpu_ffn_layers)} of {p.n_layer} layers ({nbytes / 2**30:.2f} GiB)"
    if not p.cpu_layers:
        return line + "; every layer's attention and KV cache stay on the cards"
    return (line + f", and {p.cpu_layers} whole layers on the CPU with their KV cache "
            f"({p.host.kv / 2**30:.2f} GiB): the weights left the cards first, and no spill holds those layers' cache")


def check(opts: PlanOptions, info, tensor: bool, moe: bool, devices: list[Device]) -> None:
    """`offload="weights"` where this planner cannot spill weights: one line each (InvalidOption)."""
    from ...errors import InvalidOption

    if opts.offload != "weights":
        return
    why = ("tensor mode (-sm tensor) cuts every layer across the cards; ctxq keeps weights in host memory in layer "
           "mode only: use split_mode=layer" if tensor else
           "a `split` you gave is evaluated as given: drop it or offload=weights" if opts.split is not None else
           "there are no GPUs to keep anything on: give gpus, profile or rpc, or drop offload=weights"
           if not devices else
           ("this mixture of experts has no shared experts or dense layers: its routed experts go to host memory "
            "by themselves (n_cpu_moe, or the planner's choice): drop offload=weights" if moe else
            "this model has no dense FFN weights to keep in host memory: drop offload=weights")
           if not any(la.ffn_bytes for la in info.layers) else None)
    if why:
        raise InvalidOption(f"offload=weights: {why}", option="offload", value="weights")


def nothing_to_spill(p) -> None:
    """`offload="weights"` and every layer fits on the cards: one line (InvalidOption)."""
    from ...errors import InvalidOption

    if not p.cpu_ffn_layers and p.cpu_layers == 0:
        raise InvalidOption(f"offload=weights: every layer fits on the cards at {p.n_ctx:,} tokens with KV "
                            f"{p.type_k}/{p.type_v}; nothing to keep in host memory: drop offload=weights",
                            option="offload", value="weights")


def better_pair_note(p, chosen_cand, found, info, g, opts: PlanOptions) -> None:
    """Where a pair losing less than the chosen one would fit only by keeping FFN weights in host memory and the
    choice could not weigh the copies by time (kvpairs.by_time: the devices lack speed facts), a note saying so."""
    if p.cpu_ffn_layers or p.cpu_layers or "kv" in p.speed:
        return
    rank = [c for c, _ in found]
    better = [(c, q) for c, q in found if rank.index(c) < rank.index(chosen_cand) and q.cpu_ffn_layers
              and q.cpu_layers == 0]
    if not better:
        return
    c, q = better[0]
    p.notes.append(f"KV {c.name} would fit with the FFN weights of {len(q.cpu_ffn_layers)} layers in host memory; "
                   "kept every weight on the cards, as their copies to the card cannot be timed without the cards' "
                   "speed facts (--profile with tflops_f16 and link_gbs, or named cards)")
