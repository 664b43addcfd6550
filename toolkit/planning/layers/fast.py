"""Layer mode for speed: whole layers moved to the cards where they run fastest (issue 44).

In layer mode a decoded token passes every card in turn, each reading its layers' weights and KV cache at its
memory bandwidth, so the decode time is the sum of each card's bytes over its bandwidth (`memory.estimate_tps`,
the plan's decode estimate). The search balances the layers by memory; where the context fits with memory left
over on a faster card, a layer there reads faster than on a slower one. So, one layer at a time, the move from a
slower card (by memory bandwidth) to a faster one that raises the decode estimate most is made, as long as every
card still holds its part at the context (each card's bytes as the planner counts them: `layer_search.layout`);
until no move raises it. Cards of one bandwidth, or cards without one (`--gpus` without a profile assumes one
figure for all; RPC workers have none): nothing moves.
"""

from __future__ import annotations

from typing import Callable

from ..devices import Device
from .search import layout
from ..memory.costs import Costs, estimate_tps
from ..plan import DevicePlan


MIN_GAIN = 0.01  # a move that raises the decode estimate by less than 1 % is within its error: the split stays


def faster(c: Costs, devs: list[Device], counts: list[int], host_of: Callable[[list[int]], DevicePlan],
           judge: Callable[[list[int]], float | None] | None = None) -> tuple[list[int], str] | None:
    """(counts with layers moved to faster cards, what moved and why) where that raises the decode estimate and
    every card still fits; None when nothing does. `host_of(counts)` is the host's plan for a split; `judge(counts)`
    the estimated seconds of the workload (prefill included: fewer cards overlap fewer micro-batches), or None
    where the devices say too little: then the moves stop where the workload is fastest, and none is made when
    that is the split as found."""
    bw = [d.bandwidth for d in devs]
    if len(devs) < 2 or not all(bw) or len(set(bw)) == 1:
        return None

    def tps(k: list[int]) -> float | None:
        g = layout(c, devs, k)
        if any(dp.total > dp.device.usable for dp in g):
            return None
        return estimate_tps(g, host_of(k), c.info.token_embd_bytes, c.info.expert_read_fraction)

    start = tps(counts)
    if start is None:
        return None
    path = [(list(counts), start)]
    for _ in range(sum(counts)):  # at most every slot moves once
        best, cur = path[-1]
        step = None
        for s in range(len(devs)):
            for d in range(len(devs)):
                if best[s] == 0 or bw[d] <= bw[s]:
                    continue
                k = list(best)
                k[s] -= 1
                k[d] += 1
                t = tps(k)
                if t is not None and t > cur * (1 + 1e-9) and (step is None or t > step[1]):
                    step = (k, t)
        if step is None:
            break
        path.append(step)
    path = [x for x in path if x is path[0] or x[1] >= start * (1 + MIN_GAIN)]
    timed = [(judge(k), k, t) for k, t in path] if judge is not None else []
    if timed and all(x[0] is not None for x in timed):
        secs, best, cur = min(timed, key=lambda x: x[0])
        workload = f"; the workload {timed[0][0]:.1f} -> {secs:.1f} s estimated, prefill included"
    else:
        best, cur = path[-1]
        workload = ""
    if best == list(counts):
        return None
    gave = [f"{counts[i] - best[i]} from {devs[i].name} ({bw[i] / 1e9:.0f} GB/s)"
            for i in range(len(devs)) if best[i] < counts[i]]
    took = [f"{best[i] - counts[i]} to {devs[i].name} ({bw[i] / 1e9:.0f} GB/s)"
            for i in range(len(devs)) if best[i] > counts[i]]
    return best, (f"layers moved where they run fastest: {', '.join(gave)}, {', '.join(took)}; the cards' "
                  f"memory-bandwidth bound {start:.1f} -> {cur:.1f} tokens/s{workload}; every card still holds its "
                  "part at the context")
