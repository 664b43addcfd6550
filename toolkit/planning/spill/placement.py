"""Weights in host memory, never the cache: the placement for a model one size too big for the cards at the context.

When the cards cannot hold every layer, llama.cpp's `-ngl` leaves whole layers on the CPU, their KV cache with them:
attention over that cache then runs on the CPU (op offload copies a CPU layer's *weights* to the first card for
batches of 32+ tokens; the cache is no weight), quadratic work in the context on the slowest device. Here the dense
FFN weights of chosen layers go to host memory instead (`tensor_buft_overrides`, llama.cpp's `-ot
blk\\.N\\.ffn_(up|down|gate|gate_up)\\.=CPU`) and every layer's attention, norms and KV cache stay on its card. A
mixture of experts keeps its routed experts there first (planner._search_experts), then its shared experts
and dense layers' FFN (`ffn_*_shexp`, gguf.info.FFN_RE).

`search_ffn` finds that placement as `planner._search_experts` finds a mixture-of-experts model's: first every FFN in
host memory and the rest of each layer split over the cards (whole layers only if even that does not fit: then
this placement is refused), then each card takes back the FFN of as many of its layers as it holds, its first layers
keeping theirs on the host. `chosen` takes it or the whole-layer plan by `PlanOptions.offload`; "auto" by the
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


def search_ffn(c: Costs, devices: list[Device], cpu: Device, opts: PlanOptions, make_plan, experts_back: bool = False):
    """(plan or None, host) with every layer's attention and KV cache on the cards and the dense FFN of as few layers
    as the cards need in host memory. None where even every FFN on the host leaves a whole layer for the CPU, or the
    host cannot hold its part. `make_plan(costs, slots, order, counts, gplans, host)` builds the Plan.
    A mixture of experts comes with its routed experts in host memory (`c.cpu_experts`: all, or the user's); its
    shared experts and dense layers' FFN are this FFN (gguf.info.FFN_RE). The cards take back FFN first (every token
    reads it, a routed expert only n_expert_used of n_expert), then with `experts_back` routed experts."""
    n = c.info.n_layer
    layers = spillable(c)
    if not layers or not devices:
        return None, None
    bare = c.with_cpu_ffn(layers)
    found = best_split(bare, devices, opts.reorder)
    if found is None or found[0] < n + 1:  # a whole layer would still go to the CPU with its cache
        return None, None
    slots, order, counts = found
    ds = [devices[i] for i in order]

    def restore(cand: list[int]) -> Costs:
        got = take_back(bare, ds, cand, bare.cpu_ffn, bare.with_cpu_ffn)
        if experts_back and got.cpu_experts:  # then routed experts, where a card has room left
            got = take_back(got, ds, cand, got.cpu_experts, got.with_cpu_experts)
        return got

    best = least_held(bare, ds, slots, counts, restore, lambda got: (len(got.cpu_ffn), len(got.cpu_experts)))
    if best is None:
        return None, None
    cf, cand = best
    host = host_cost(cf, 0, sum(1 for k in cand if k), cpu, cand)
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
    return (f"weights in host memory: {what} of {len(p.cpu_ffn_layers)} of {p.n_layer} layers "
            f"({nbytes / 2**30:.2f} GiB); every layer's attention and KV cache stay on the cards")


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
