"""Whole layers per device (`-sm layer`): the search `planner` runs for one K/V pair.

Layer slots (the output head the last) are filled from the last device backwards, each device up to a fraction of
its usable memory; the most slots any device order holds are then balanced, first as llama.cpp would by default
(in proportion to memory), else by the smallest common fill fraction that still places every slot. Each device's
bytes come from `memory.device_cost` (llama.cpp's allocations).
"""

from __future__ import annotations

import itertools

from ..devices import Device
from ..memory.costs import Costs, device_cost, slots_key
from ..plan import DevicePlan


def fill(c: Costs, devs: list[Device], n_gpu_layer_slots: int, cap_frac: float, n_used: int = 2):
    """Place the top `n_gpu_layer_slots` layer slots (output head included) on devs, filling from the
    last device backwards, each up to cap_frac of its usable memory. None if they do not all fit.
    Each device is costed as one of `n_used` devices holding layers: 2 (a split graph's input copies: never
    under when more are used), or 1 where the caller checks that one device holds every slot (`most_slots`)."""
    n = c.info.n_layer
    counts = [0] * len(devs)
    hi = n + 1  # slots [lo, hi) remain; slot n is the output head
    lo_bound = n + 1 - n_gpu_layer_slots
    first = first_cuda(devs)
    for d in range(len(devs) - 1, -1, -1):
        if hi <= lo_bound:
            break
        budget = devs[d].usable * cap_frac
        take = 0
        while hi - take - 1 >= lo_bound:
            start = hi - take - 1
            has_out = hi == n + 1
            layers = range(start, min(hi, n))
            # as in a split; _layout costs the final one exactly
            key = (start, hi, id(devs[d]), d == first, slots_key(lo_bound, d == first), n_used)
            total = c.totals.get(key)
            if total is None:
                total = c.totals[key] = device_cost(c, layers, has_out, n_used, devs[d], first_cuda=d == first,
                                                    n_cpu_slots=lo_bound).total
            if total > budget:
                break
            take += 1
        counts[d] = take
        hi -= take
    if hi > lo_bound:
        return None
    return counts


def layout(c: Costs, devs: list[Device], counts: list[int]) -> list[DevicePlan]:
    """Each device's plan for `counts` layer slots per device, the last slot being the output head."""
    n = c.info.n_layer
    n_used = sum(1 for k in counts if k)
    n_cpu_slots = start = n + 1 - sum(counts)
    first = first_cuda(devs)
    out = []
    for i, (dev, k) in enumerate(zip(devs, counts)):
        has_out = k > 0 and start + k - 1 == n
        layers = range(start, min(start + k, n))
        # a device without layers still gets the op-offload copies when it is the first CUDA device
        out.append(device_cost(c, layers, has_out, n_used, dev, first_cuda=i == first, n_cpu_slots=n_cpu_slots)
                   if k or i == first else DevicePlan(dev, []))
        start += k
    return out


def first_cuda(devs: list[Device]) -> int | None:
    """The first CUDA device in llama.cpp's order: the scheduler offloads host-resident weights to the
    first backend whose offload_op accepts them, and RPC devices (placed first) have none."""
    return next((i for i, d in enumerate(devs) if d.backend == "cuda"), None)


def orders(devs: list[Device], allow_reorder: bool) -> list[list[int]]:
    base = list(range(len(devs)))
    if not allow_reorder or len(devs) > 8:
        return [base]
    seen, orders = set(), [base]
    seen.add(tuple(devs[i].usable for i in base))
    for perm in itertools.permutations(base):
        sig = tuple(devs[i].usable for i in perm)
        if sig not in seen:
            seen.add(sig)
            orders.append(list(perm))
    return orders


def best_split(c: Costs, devs: list[Device], allow_reorder: bool):
    """(n_gpu_slots, order, counts): the device order that holds the most layer slots, and those
    slots balanced over its devices."""
    best = None
    for order in orders(devs, allow_reorder):
        ds = [devs[i] for i in order]
        if fill(c, ds, 0, 1.0) is None:
            continue
        lo, alone = most_slots(c, ds)
        if best is None or lo > best[0]:
            best = (lo, order, alone)
        if lo == c.info.n_layer + 1:  # every slot placed: no later order can hold more (only a larger count replaces it)
            break
    if best is None:
        return None
    slots, order, alone = best
    ds = [devs[i] for i in order]
    # Balance: first as llama.cpp would by default (layers in proportion to memory), kept when every
    # device holds its share; else the smallest common fill fraction that still places every slot.
    prop = proportional(ds, slots)
    if counts_fit(c, ds, prop):
        return slots, order, prop
    if alone is not None:  # only one device holds them all: nothing to balance
        return slots, order, alone
    f_lo, f_hi = 0.0, 1.0
    counts = fill(c, ds, slots, 1.0)
    for _ in range(20):
        mid = (f_lo + f_hi) / 2
        k = fill(c, ds, slots, mid)
        if k is not None:
            f_hi, counts = mid, k
        else:
            f_lo = mid
    return slots, order, counts


def most_slots(c: Costs, ds: list[Device]) -> tuple[int, list[int] | None]:
    """(the most layer slots `ds` hold in this order, their counts where only one device holds them, else None).
    `fill` costs each device as one of two holding layers; where the slots end on one device (a card beside one too
    small for a layer, or the host), its split has no second card's input copies, so one device may hold more:
    the counts of that case are checked exactly (`counts_fit`)."""
    n = c.info.n_layer

    def most(ok) -> int:
        lo, hi = 0, n + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    lo = most(lambda s: fill(c, ds, s, 1.0) is not None)
    if lo == n + 1:
        return lo, None

    def alone(s: int) -> list[int] | None:
        k = fill(c, ds, s, 1.0, n_used=1)
        return k if k is not None and sum(1 for x in k if x) == 1 and counts_fit(c, ds, k) else None

    one = most(lambda s: s <= lo or alone(s) is not None)
    return (one, alone(one)) if one > lo else (lo, None)


def proportional(devs: list[Device], slots: int) -> list[int]:
    """Slots in proportion to usable memory, by largest remainder."""
    total = sum(d.usable for d in devs) or 1
    exact = [slots * d.usable / total for d in devs]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(devs)), key=lambda i: exact[i] - counts[i], reverse=True)[:slots - sum(counts)]:
        counts[i] += 1
    return counts


def counts_fit(c: Costs, devs: list[Device], counts: list[int]) -> bool:
    return all(dp.total <= dp.device.usable for dp in layout(c, devs, counts))


def take_back(c: Costs, devs: list[Device], counts: list[int], held, place) -> Costs:
    """Costs with the host-memory tensors of as many layers as each device can hold back on it: `held` the layers whose
    tensors of one kind sit in host memory (`place(layers)`: the costs with exactly those there, e.g.
    `Costs.with_cpu_experts`), `counts` the devices' layer slots, all fitting as `c` stands. Within a device its last
    layers take theirs back first, so the host keeps a prefix of each device's layers (`--n-cpu-moe N` on one)."""
    n = c.info.n_layer
    held = set(held)
    start = n + 1 - sum(counts)
    for k in counts:
        mine = [il for il in range(start, min(start + k, n)) if il in held]
        start += k
        lo, hi = 0, len(mine)  # the most of its layers, from its last one back, that fit on this device with the rest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if counts_fit(place(held - set(mine[len(mine) - mid:])), devs, counts):
                lo = mid
            else:
                hi = mid - 1
        held -= set(mine[len(mine) - lo:])
    return place(held)


def least_held(bare: Costs, devs: list[Device], slots: int, counts: list[int], restore, held):
    """(costs, counts) of the split that keeps the least in host memory, or None: of the search's split `counts` and
    llama.cpp's proportional one over the same `slots`, each that holds `bare` (everything of one kind in host memory)
    with `restore(counts)` giving back what its devices can take (`take_back`), compared by `held(costs)`."""
    best = None
    for cand in (counts, proportional(devs, slots)):
        if counts_fit(bare, devs, cand):
            got = restore(cand)
            if best is None or held(got) < held(best[0]):
                best = got, cand
    return best
