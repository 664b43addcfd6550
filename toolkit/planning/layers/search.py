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


def fill(c: Costs, devs: list[Device], n_gpu_layer_slots: int, cap_frac: float):
    """Place the top `n_gpu_layer_slots` layer slots (output head included) on devs, filling from the
    last device backwards, each up to cap_frac of its usable memory. None if they do not all fit."""
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
            key = (start, hi, id(devs[d]), d == first, slots_key(lo_bound, d == first))
            total = c.totals.get(key)
            if total is None:
                total = c.totals[key] = device_cost(c, layers, has_out, 2, devs[d], first_cuda=d == first,
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
    n = c.info.n_layer
    best = None
    for order in orders(devs, allow_reorder):
        ds = [devs[i] for i in order]
        lo, hi = 0, n + 1  # most slots that fit at full capacity
        if fill(c, ds, 0, 1.0) is None:
            continue
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fill(c, ds, mid, 1.0) is not None:
                lo = mid
            else:
                hi = mid - 1
        if best is None or lo > best[0]:
            best = (lo, order)
        if lo == n + 1:  # every slot placed: no later order can hold more (only a larger count replaces it)
            break
    if best is None:
        return None
    slots, order = best
    ds = [devs[i] for i in order]
    # Balance: first as llama.cpp would by default (layers in proportion to memory), kept when every
    # device holds its share; else the smallest common fill fraction that still places every slot.
    prop = proportional(ds, slots)
    if counts_fit(c, ds, prop):
        return slots, order, prop
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
