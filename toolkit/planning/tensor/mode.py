"""Tensor mode (`-sm tensor`): every offloaded layer cut across all the cards, planned card by card.

llama.cpp makes one meta device of the cards and cuts each tensor by `tensor_split` (`split.py`: axes,
granularity, rotation, the mirrored tensors every card holds whole). What each card allocates, checked against
real loads over RPC workers (each worker's `GGML_RPC_DEBUG` log; scripts/accuracy.py's tensor section):

- weights and KV: its cut of each tensor and cache (`tensor_split.CardBytes`), to the byte (docs/accuracy-table.md);
- compute: the meta device's buffer is sized on the whole tensors and allocated at that size on every card
  (ggml_backend_meta_buffer_type_alloc_buffer), so each card holds the compute buffer of one device holding every
  offloaded layer (97.125 MiB on each card for SmolLM2 at 4k and 8k): the search costs it with ctxq's rules, then the
  split referee takes llama.cpp's dry run of that one device (`split_referee._tensor_measured`);
- all-reduce: ceil(log2(cards)) scratch buffers per card, each the largest partial result that opens an all-reduce
  (the residual stream of one micro-batch, f32 [n_embd, n_ubatch], times the experts used in a MoE, whose routed
  down-projection is the largest: `allreduce_bytes`), allocated at the first batch;
- CUDA's own memory and the reserve per card as for one device holding every offloaded layer (an over-estimate:
  each card converts only its own heads);
- the host: token embeddings, the layers left on the CPU with their KV, its compute buffer, as in layer mode.

The proportions are searched: each card's share of the cut bytes follows its speed (memory bandwidth, else its memory)
but never beyond what it can hold at the context after its whole part (mirrored tensors, compute buffer, reserve);
the exact cut is then checked and a card over its room gives up share until every card fits. Layers the cards cannot
hold go to the CPU, as in layer mode. Tensor mode over some of the cards is a candidate too (`search`, `subset.py`).
"""

from __future__ import annotations

import math

from ...errors import InvalidOption
from ...gguf.info import kv_cells
from ..devices import Device
from ..memory.costs import Costs, costs, device_cost, host_cost
from ..plan import DevicePlan, Plan
from .split import TensorSplit, not_planned
from . import batch
from .subset import mark_left_out, subsets

SCALE = 1000  # proportions passed to llama.cpp as integers out of SCALE (exact in its float32 scan)


def check(info, arch: str, opts, devices: list[Device], experts_fixed: bool) -> None:
    """InvalidOption (one line) when tensor mode cannot run this model with these options."""
    why = not_planned(arch, info) or batch.over_rpc(arch, devices)
    if why:
        raise InvalidOption(why, option="split_mode", value="tensor")
    if not devices:
        raise InvalidOption("tensor mode splits layers across GPUs or RPC workers, and none is given or found "
                            "(llama.cpp skips the CPU): give `gpus`, `profile`, `rpc` or `simulate`, or use split_mode=layer", option="split_mode", value="tensor")
    if opts.flash_attn is False:
        raise InvalidOption("tensor mode needs flash attention (llama.cpp refuses SPLIT_MODE_TENSOR without it): "
                            "use flash_attn=True or split_mode=layer", option="split_mode", value="tensor")
    if experts_fixed:
        raise InvalidOption("ctxq does not plan experts in CPU memory in tensor mode (cpu_moe, n_cpu_moe): "
                            "use split_mode=layer for that", option="split_mode", value="tensor")




def allreduce_bytes(info, n_cards: int, n_ubatch: int) -> int:
    """The all-reduce scratch each card holds after its first full micro-batch, as ggml-backend-meta.cpp allocates it:
    `n_reduce_steps = ceil(log2(n_devs))` buffers (ggml_backend_meta_context) on every card, each of
    `max_tmp_size` bytes, the largest PARTIAL node that starts an all-reduce subgraph
    (ggml_backend_meta_graph_compute: `max_tmp_size = max(max_tmp_size, ggml_nbytes(node))`, then
    `bcj.bufs[i].reset(ggml_backend_alloc_buffer(bcj.backend, max_tmp_size))` for every card j and step i; NCCL or
    not). The PARTIAL nodes are the row-split matmuls' results (handle_mul_mat: src0 and src1 both split on axis 0):
    attention output, FFN down, shared experts, ssm_out, all f32 [n_embd, n_tokens], and a MoE's routed
    down-projection f32 [n_embd, n_expert_used, n_tokens] (build_moe_ffn's ffn_moe_down) in every MoE: build_moe_ffn
    forward-expands its experts before a shared branch joins the graph, so the routed node is reached (and measured)
    before get_i_delayed merges anything past it, hunyuan-moe's shared-plus-routed sum included (its shared FFN is
    built first but expanded after: measured over RPC workers, tests/test_tensor_scratch.py).
    Tokens: a full micro-batch, the largest a batch makes."""
    if n_cards <= 1:
        return 0
    steps = math.ceil(math.log2(n_cards))
    routed = info.n_expert_used or 1
    return steps * info.n_embd * n_ubatch * 4 * routed


def meta_order(devices: list[Device]) -> list[Device]:
    """The cards in the meta device's order: every non-CPU device in ggml's registry order (llama.cpp's
    llama_prepare_model_devices), the process's own GPUs before RPC workers registered later; layer mode instead
    puts RPC devices first."""
    return sorted(devices, key=lambda d: d.kind == "rpc")


class _Cards:
    """What each card needs for a given number of offloaded layer slots and proportions."""

    def __init__(self, c: Costs, g, devices: list[Device], cpu: Device, opts, tk: str, tv: str):
        devices = meta_order(devices)
        self.c, self.devices, self.cpu, self.opts = c, devices, cpu, opts
        self.info, self.g = c.info, g
        self.ts = TensorSplit(g, c.info, len(devices), tk, tv)
        self.n_ctx, self.n_ubatch = opts.n_ctx, opts.n_ubatch
        self.allreduce = allreduce_bytes(self.info, len(devices), opts.n_ubatch)

    def cells(self, il: int) -> int:
        return kv_cells(self.info, self.n_ctx, self.n_ubatch, il)

    def slots_layers(self, slots: int) -> tuple[range, bool]:
        n = self.info.n_layer
        start = n + 1 - slots
        return range(min(start, n), n), slots > 0

    def whole(self, slots: int) -> list[DevicePlan]:
        """Each card as one device holding every offloaded layer: its compute buffer, CUDA terms and margin."""
        layers, has_out = self.slots_layers(slots)
        n_cpu = self.info.n_layer + 1 - slots
        first = next((i for i, d in enumerate(self.devices) if d.backend == "cuda"), None)
        return [device_cost(self.c, layers, has_out, 1, d, first_cuda=i == first, n_cpu_slots=n_cpu)
                for i, d in enumerate(self.devices)]

    def cards(self, slots: int, proportions, whole: list[DevicePlan] | None = None) -> list[DevicePlan]:
        layers, has_out = self.slots_layers(slots)
        cb = self.ts.at(proportions)
        weights = cb.card_weights(layers, has_out)
        kv = cb.card_kv(layers, self.cells)
        state = cb.card_state(layers, self.opts.parallel or 1)
        out = []
        for j, w1 in enumerate(whole or self.whole(slots)):
            dp = DevicePlan(w1.device, list(layers) + ([self.info.n_layer] if has_out else []))
            dp.weights, dp.kv, dp.state = weights[j], kv[j], state[j]
            dp.compute = w1.compute + (self.allreduce if slots else 0)
            dp.cuda_copies, dp.cuda_pool, dp.margin = w1.cuda_copies, w1.cuda_pool, w1.margin
            out.append(dp)
        return out

    def host(self, slots: int) -> DevicePlan:
        return host_cost(self.c, self.info.n_layer + 1 - slots, 1 if slots else 0, self.cpu)

    def proportions(self, slots: int) -> tuple[list[int], list[DevicePlan]] | None:
        """Integer proportions (out of SCALE) with which every card holds its cut of `slots` offloaded
        slots, and the cards' plans; None when no proportions do."""
        n = len(self.devices)
        whole = self.whole(slots)
        even = self.cards(slots, [1] * n, whole)
        mirrored = self._mirrored(slots)
        fixed = [w.compute + (self.allreduce if slots else 0) + w.cuda_copies + w.cuda_pool + w.margin + mirrored
                 for w in whole]
        cut = sum(dp.weights + dp.kv + dp.state for dp in even) - n * mirrored  # the bytes shared out
        room = [d.usable - f for d, f in zip(self.devices, fixed)]
        if any(r < 0 for r in room):
            return None
        if cut <= 0:
            return [SCALE // n] * n, even
        speed = [d.bandwidth or 0 for d in self.devices]
        if not all(speed):
            speed = [max(r, 1) for r in room]
        caps = [r / cut for r in room]
        for _ in range(40):
            shares = _water_fill(speed, caps)
            if shares is None:
                return None
            props = _integers(shares, caps)
            if props is None:
                return None
            plans = self.cards(slots, props, whole)
            over = [dp.total - dp.device.usable for dp in plans]
            if all(o <= 0 for o in over):
                return props, plans
            for j, o in enumerate(over):
                if o > 0:  # give up that much share, and one granule more
                    caps[j] = max(0.0, min(caps[j], props[j] / SCALE) - (o + self._granule(slots)) / cut)
        return None

    def _mirrored(self, slots: int) -> int:
        layers, has_out = self.slots_layers(slots)
        whole = [sum(x for x in row if isinstance(x, int)) for row in self.ts.state]  # a mirrored state (LFM2)
        return (sum(self.ts.fixed_layer[il] + whole[il] for il in layers) + (self.ts.fixed_out if has_out else 0))

    def _granule(self, slots: int) -> int:
        """About one step of the cut (a KV head of every offloaded layer's cache): what a card gives up
        beyond its overflow per round."""
        layers, _ = self.slots_layers(slots)
        return sum(1 for il in layers if self.info.layers[il].attention) * 4096


def _water_fill(speed: list[float], caps: list[float]) -> list[float] | None:
    """Shares in proportion to speed, each at most its cap, summing to 1; None when the caps sum below 1."""
    if sum(caps) < 1:
        return None
    shares = [0.0] * len(speed)
    free = set(range(len(speed)))
    left = 1.0
    while free:
        total = sum(speed[j] for j in free)
        capped = [j for j in free if left * speed[j] / total > caps[j]]
        if not capped:
            for j in free:
                shares[j] = left * speed[j] / total
            break
        for j in capped:
            shares[j] = caps[j]
            left -= caps[j]
            free.discard(j)
    return shares


def _integers(shares: list[float], caps: list[float]) -> list[int] | None:
    """Shares as integers out of SCALE, never above a cap, summing to SCALE where the caps allow."""
    props = [min(int(s * SCALE), int(c * SCALE)) for s, c in zip(shares, caps)]
    short = SCALE - sum(props)
    for j in sorted(range(len(props)), key=lambda j: shares[j] * SCALE - props[j], reverse=True):
        if short <= 0:
            break
        extra = min(short, int(caps[j] * SCALE) - props[j])
        if extra > 0:
            props[j] += extra
            short -= extra
    return props if short <= 0 and sum(props) > 0 else None


def search(c: Costs, g, path: str, devices: list[Device], cpu: Device, opts, tk: str, tv: str):
    """(the tensor-mode plan with these KV types, or None when the host cannot hold what is left; the host's plan).
    Every card, and each subset of `subsets(devices)`, is a candidate: a card left out is not given to llama.cpp
    (a card with proportion 0 stays in the meta device, holding the mirrored tensors, a whole compute buffer and
    its all-reduce scratch, and joins every all-reduce: docs/planner.md). Among the candidates that keep the most
    layers on the cards, the least estimated time for the context wins where every one can be estimated; else
    every card (or, where they do not hold tensor mode, the largest subset that does)."""
    from ..speed import model as speed

    work = speed.Workload(opts.n_ctx if opts.prompt_tokens is None else opts.prompt_tokens,
                          speed.DEFAULT_GEN_TOKENS if opts.gen_tokens is None else opts.gen_tokens,
                          n_ubatch=opts.n_ubatch, n_batch=opts.n_batch)
    shape = speed.model_shape(c.info, tk, tv, g)
    cands, refused = [], []
    for keep, why in [(list(range(len(devices))), None), *subsets(devices)]:
        try:
            p, host = search_cards(c, g, path, [devices[i] for i in keep], cpu, opts, tk, tv)
        except InvalidOption as e:  # llama.cpp would abort at the first batch (batch.py)
            p, host = None, refused.append((keep, e))
        total = speed.estimate(shape, speed.placement_from_plan(p), work).total_s if p is not None else None
        cands.append((p, host, keep, why, total))
    fit = [x for x in cands if x[0] is not None]
    if not fit and refused:
        raise refused[0][1]
    if not fit:
        return None, cands[0][1]
    least = min(x[0].cpu_layers for x in fit)
    fit = [x for x in fit if x[0].cpu_layers == least]
    timed = all(x[4] is not None for x in fit)
    p, host, keep, why, total = min(fit, key=lambda x: x[4]) if timed else fit[0]
    if len(keep) == len(devices):
        return p, host
    every = cands[0]
    if every[0] is None:
        than = next((str(e) for k, e in refused if k == every[2]), "tensor mode over every card does not fit")
    elif every[0].cpu_layers > p.cpu_layers:
        than = f"over every card it keeps {every[0].cpu_layers} layer slots on the CPU, here {p.cpu_layers}"
    else:
        than = (f"estimated {total:.1f} s for {work.prompt_tokens:,} prompt and {work.gen_tokens} generated tokens "
                f"against {every[4]:.1f} s over every card (estimates, not measurements)")
    mark_left_out(p, devices, keep, why, than)
    return p, host


def search_cards(c: Costs, g, path: str, devices: list[Device], cpu: Device, opts, tk: str, tv: str):
    """search() over exactly these cards."""
    cards = _Cards(c, g, devices, cpu, opts, tk, tv)
    n = c.info.n_layer
    best = cards.proportions(0)
    lo, hi = (0 if best is not None else -1), n + 1
    while lo < hi:  # the most slots the cards hold
        mid = (lo + hi + 1) // 2
        got = cards.proportions(mid)
        if got is not None:
            lo, best = mid, got
        else:
            hi = mid - 1
    slots = max(lo, 0)
    if best is None:
        return None, cards.host(slots)
    slots, props, plans, note = batch.settled(cards, slots, *best, [SCALE // len(devices)] * len(devices))
    host = cards.host(slots)
    if host.total > host.device.usable:
        return None, host
    how = {"how": "the nearest llama.cpp runs, " + note.split(" (", 1)[1].split(")", 1)[0]} if note else {}
    p = _make(c, g, path, opts, tk, tv, slots, props, plans, host, **how)
    p.notes += [note] if note else []
    return p, host


def evaluate(c: Costs, g, path: str, devices: list[Device], cpu: Device, opts, tk: str, tv: str,
             ratios: list[float]) -> Plan:
    """The plan for proportions the user gave (`--split` with `--split-mode tensor`), every layer offloaded."""
    cards = _Cards(c, g, devices, cpu, opts, tk, tv)  # ratios in the meta device's order (meta_order)
    slots = c.info.n_layer + 1
    why = batch.at_proportions(cards.ts, c.info, g, ratios)
    if why:
        raise InvalidOption(why, option="split", value=":".join(f"{x:g}" for x in ratios))
    plans = cards.cards(slots, ratios)
    p = _make(c, g, path, opts, tk, tv, slots, ratios, plans, cards.host(slots))
    p.reason = "tensor mode, the proportions you gave"
    over = [g for g in plans if g.total > g.device.usable]
    if over:
        p.notes.append("does not fit: " + ", ".join(
            f"{g.device.name} needs {g.total / 2**30:.2f} GiB of {g.device.usable / 2**30:.2f}" for g in over))
    return p


def _make(c: Costs, g, path: str, opts, tk: str, tv: str, slots: int, props, plans, host,
          how: str = "by speed, within each card's memory") -> Plan:
    from ..speed import model as speed
    n = c.info.n_layer
    p = Plan(model=path, n_ctx=opts.n_ctx, n_batch=opts.n_batch, n_ubatch=opts.n_ubatch, type_k=tk, type_v=tv,
             flash_attn=True, n_gpu_layers=slots, tensor_split=[_num(x) for x in props], gpus=plans, host=host,
             n_layer=n, split_mode="tensor", expert_layers=c.info.expert_layers)
    total = sum(p.tensor_split) or 1
    p.reason = (f"tensor mode: {'every layer' if slots == n + 1 else f'{max(slots - 1, 0)} of {n} layers'} cut "
                f"across {len(plans)} cards, " + ":".join(f"{x / total:.0%}" for x in p.tensor_split)
                + f" of each ({how})")
    est = speed.estimate(speed.model_shape(c.info, tk, tv, g), speed.placement_from_plan(p),
                         speed.Workload(opts.n_ctx, n_ubatch=opts.n_ubatch, n_batch=opts.n_batch))
    p.est_decode_tps = est.decode_tps
    return p


def _num(x):
    return int(x) if float(x).is_integer() else float(x)


def compare(p: Plan, src, info, path: str, devices: list[Device], cpu: Device, opts, cuda: bool, experts) -> Plan:
    """`--split-mode auto`: the tensor-mode plan for the chosen KV pair beside the layer plan, both speeds estimated
    (planning/speed/model.py) and, where `ctxq bench` measured both plans on these devices (planning/speed/store.py),
    measured. The faster by measurement is returned; without both measurements the layer plan: llama.cpp marks
    tensor mode experimental, and which mode is faster has to be measured on the devices (docs/planner.md)."""
    from ..speed import model as speed
    from ..speed import store as speed_store

    why, t = None, None
    try:
        check(info, src.arch, opts, devices, bool(experts.cpu_layers))
        why = batch.pair_refused(info, src, p.type_k, p.type_v)
        if why is None:
            c = costs(info, src, opts, p.type_k, p.type_v, cuda)
            t, _ = search(c, src, path, devices, cpu, opts, p.type_k, p.type_v)
    except InvalidOption as e:
        why = str(e)
    if why is None:
        if t is None:
            why = "tensor mode does not fit these devices at this context"
        elif t.cpu_layers > p.cpu_layers:
            why = f"tensor mode keeps {t.cpu_layers} layer slots on the CPU, layer mode {p.cpu_layers}"
    shape = speed.model_shape(info, p.type_k, p.type_v, src)
    work = speed.Workload(opts.n_ctx if opts.prompt_tokens is None else opts.prompt_tokens,
                          speed.DEFAULT_GEN_TOKENS if opts.gen_tokens is None else opts.gen_tokens,
                          n_ubatch=opts.n_ubatch, n_batch=opts.n_batch)
    ests = [speed.estimate(shape, speed.placement_from_plan(p), work)]
    if t is not None:
        ests.append(speed.estimate(shape, speed.placement_from_plan(t), work))
    choice = speed.choose(ests)
    measured = {"layer": speed_store.lookup(p), "tensor": speed_store.lookup(t) if t is not None else None}
    totals = {m: r.total_s(work.prompt_tokens, work.gen_tokens) for m, r in measured.items() if r is not None}
    info_ = {"layer": ests[0].to_dict(), "tensor": ests[1].to_dict() if t is not None else None,
             "tensor_split": t.tensor_split if t is not None else None,
             "tensor_left_out": t.left_out if t is not None else None, "estimated": choice.reason,
             "tensor_refused": why, "measured": {m: r.to_dict() for m, r in measured.items() if r is not None}}
    if len(totals) == 2 and None not in totals.values():
        best = min(totals, key=totals.get)
        rates = "; ".join(f"{m} mode pp {r.pp:.1f} t/s, tg {r.tg:.1f} t/s ({totals[m]:.1f} s)"
                          for m, r in measured.items())
        note = (f"split mode: measured on these devices by ctxq bench, for {work.prompt_tokens:,} prompt and "
                f"{work.gen_tokens} generated tokens: {rates}: {best} mode chosen")
        chosen = t if best == "tensor" and why is None else p
        if best == "tensor" and why is None:
            t.reason += f"; chosen over layer mode by measurement ({totals['layer']:.1f} s against {totals['tensor']:.1f})"
            t.kv_quality, t.notes = p.kv_quality, [*p.notes, *(n for n in t.notes if n not in p.notes)]
    else:
        chosen = p
        missing = [m for m in ("layer", "tensor") if measured.get(m) is None and (m == "layer" or t is not None)]
        note = (f"split mode: {choice.reason}" + (f"; tensor mode: {why}" if why else "")
                + ("; the plan stays in layer mode until tensor mode is measured faster here "
                   f"(-sm tensor -ts {','.join(map(str, t.tensor_split))}{_dev_flag(t)}): `ctxq bench` with the same "
                   f"options measures {' and '.join(missing)} mode" if t is not None else ""))
    chosen.speed = info_
    chosen.notes.append(note)
    return chosen


def _dev_flag(p: Plan) -> str:
    return f" -dev {','.join(p.llama_devices)}" if p.llama_devices else ""


def ratios(split, devices: list[Device]) -> list[float]:
    """A `split` in tensor mode: proportions, one per card."""
    parts = split if isinstance(split, (list, tuple)) else str(split).replace(":", ",").split(",")
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        raise InvalidOption(f"`split` {split!r}: give proportions like 60,40 or 16:16:8", option="split",
                            value=split) from None
    if len(vals) != len(devices) or any(v < 0 for v in vals) or not any(vals):
        raise InvalidOption(f"`split` {split!r}: give {len(devices)} proportions, not all zero", option="split",
                            value=split, limit=len(devices))
    return vals
