"""Every tensor-mode candidate the planner considers (every card, and each subset of `tensor_subset.subsets`),
planned one by one and weighed by measurement (issue 44).

`tensor.search` takes one candidate by estimate (or every card, where the devices say too little to estimate).
`ctxq bench` measures each candidate instead (`PlanOptions.tensor_cards` pins one), and `-sm auto` then takes the
candidate, or layer mode, with the least measured time for the workload: `measured_best` after `tensor.compare`.
A card left out is not given to llama.cpp (`-dev`; docs/planner.md, "Tensor mode over some of the cards").
"""

from __future__ import annotations

from ...errors import InvalidOption
from ..speed import store as speed_store
from . import mode as tensor_mod
from ..devices import Device
from ..plan import Plan
from .subset import mark_left_out, subsets


def card_sets(devices: list[Device]) -> list[tuple[list[int], str | None]]:
    """(indices of the cards kept, why the others are left out) for every candidate: every card first."""
    if len(devices) < 2:
        return []
    return [(list(range(len(devices))), None), *subsets(devices)]


def pinned(c, g, path: str, devices: list[Device], cpu: Device, opts, tk: str, tv: str):
    """`tensor.search` over exactly the cards `opts.tensor_cards` names: (plan or None, the host's plan)."""
    keep = sorted(set(opts.tensor_cards))
    if len(keep) < 2 or keep[0] < 0 or keep[-1] >= len(devices):
        raise InvalidOption(f"tensor_cards {list(opts.tensor_cards)}: give 2 or more of the cards 0 to "
                            f"{len(devices) - 1}", option="tensor_cards", value=opts.tensor_cards)
    why = dict((tuple(k), w) for k, w in card_sets(devices)).get(tuple(keep), "as asked")
    p, host = tensor_mod.search_cards(c, g, path, [devices[i] for i in keep], cpu, opts, tk, tv)
    if p is not None and len(keep) < len(devices):
        mark_left_out(p, devices, keep, why)
    return p, host


def measured_best(chosen: Plan, layer: Plan, plan_cards, devices: list[Device], work: tuple[int, int]) -> Plan:
    """`-sm auto` among every tensor candidate: `chosen` (what `tensor.compare` took, layer mode unless both modes
    were measured), or the tensor candidate measured fastest where layer mode is measured too and that candidate
    is faster than it and than `chosen`. `plan_cards(keep)` plans tensor mode over those cards (None: no fit)."""
    sets = card_sets(devices)
    if len(sets) < 2:  # every card only: tensor.compare has weighed it
        return chosen
    m_layer = speed_store.lookup(layer)
    t_layer = m_layer.total_s(*work) if m_layer is not None else None
    if t_layer is None:  # auto takes tensor mode only against a measurement of layer mode: nothing to plan
        return chosen
    rows = []
    for keep, why in sets:
        t = plan_cards(keep, why)
        m = speed_store.lookup(t) if t is not None else None
        rows.append((keep, t, m.total_s(*work) if m is not None else None))
    chosen.speed = {**chosen.speed, "tensor_candidates": [
        {"cards": [devices[i].name for i in keep], "tensor_split": t.tensor_split if t is not None else None,
         "measured_s": s} for keep, t, s in rows]}
    timed = [(s, keep, t) for keep, t, s in rows if s is not None]
    if not timed:
        return chosen
    s, keep, t = min(timed, key=lambda x: x[0])
    m_chosen = speed_store.lookup(chosen)
    t_chosen = m_chosen.total_s(*work) if m_chosen is not None else t_layer
    if s >= min(t_layer, t_chosen if t_chosen is not None else t_layer) or _same(t, chosen):
        return chosen
    cards = ", ".join(devices[i].name for i in keep)
    line = ", ".join(f"{'+'.join(devices[i].name for i in k)}: {x:.1f} s" if x is not None else
                     f"{'+'.join(devices[i].name for i in k)}: not measured" for k, _, x in rows)
    t.speed = chosen.speed
    t.kv_quality = chosen.kv_quality
    t.notes = [n for n in chosen.notes if not n.startswith("split mode:")] + [
        n for n in t.notes if n not in chosen.notes] + [
        f"split mode: measured on these devices by ctxq bench, for {work[0]:,} prompt and {work[1]} generated tokens: "
        f"layer mode {t_layer:.1f} s; tensor mode over {line}: tensor mode over {cards} chosen"]
    t.reason += f"; chosen by measurement ({s:.1f} s against layer mode's {t_layer:.1f} s)"
    return t


def _same(a: Plan, b: Plan) -> bool:
    return (a.split_mode == b.split_mode and list(a.tensor_split) == list(b.tensor_split)
            and a.llama_devices == b.llama_devices and a.n_gpu_layers == b.n_gpu_layers)
