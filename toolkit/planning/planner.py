"""`ctxq plan`: fit a required context onto devices, the way llama.cpp will allocate it.

The costs of each device come from `memory` (llama.cpp's allocations, in bytes). The search holds
n_ctx fixed, tries KV types in the order a policy prefers, and for each finds the most layers the
devices can hold (leftover layers go to the CPU, as llama.cpp puts the first n_layer + 1 -
n_gpu_layers layers there), balanced by free memory, over the distinct device orders. The split
goes to llama.cpp as integer layer counts, which it reproduces exactly.
"""

from __future__ import annotations

import os
from dataclasses import replace

from . import kvpairs, ubatch
from .devices import Device, cpu_device, resolve_devices
from .layers import fast as fast_layers
from .layers.search import best_split as _best_split, layout as _layout
from .memory import compute as compute_mod
from .memory.costs import Costs, costs, estimate_tps, host_cost, kv_by_layer
from .speed.reading import reading, workload
from .spill import placement as spill
from .tensor import batch as tensor_batch, candidates as tensor_candidates, mode as tensor_mod
from .options import PlanOptions
from .checks import check_kv_can_fit, check_reserve, does_not_fit
from .facts import model_facts
from .plan import DevicePlan, ExpertPlacement, Plan
from .referee import refereed
from .split_referee import split_refereed
from ..errors import InvalidOption
from ..gguf.info import ModelInfo, model_info
from ..gguf.once import one_parse
from ..units import GiB

__all__ = ["plan", "plan_for", "Plan", "DevicePlan", "PlanOptions", "llama_layer_counts"]


# --- public entry points ------------------------------------------------------------------------

@one_parse  # the model's header parsed once in the call
def plan(model: str | os.PathLike | None = None, n_ctx: int | None = None, *, devices: list[Device] | None = None,
         options: PlanOptions | None = None, **settings) -> Plan:
    """Plan n_ctx tokens of context for `model` (default: the embedded SmolLM2).

    `settings` are `PlanOptions` fields by keyword (gpus, profile, rpc, simulate, kv, type_k, type_v,
    flash_attn, split, prefer, n_batch, n_ubatch, cpu_memory, reorder), over `options` if given.
    `devices`: ready `Device` objects (e.g. RPC workers) instead of gpus / profile / rpc / detection.
    The micro-batch, when `n_ubatch` is not given, is the measured fastest (planning/ubatch.py).
    Raises DoesNotFit naming the smallest change that would fit.
    """
    given = (options or PlanOptions()).updated(n_ctx=n_ctx, **settings)
    opts = given.resolved()
    if devices is None:
        devices, cpu = resolve_devices(opts)
    else:
        cpu = cpu_device(opts.cpu_memory)
    p = plan_for(model, devices, cpu, opts)
    if given.n_ubatch is not None:  # never over a micro-batch the user gave
        return p
    def replan(ub: int, nb: int, kv: str | None = None) -> Plan:
        return plan_for(model, devices, cpu, replace(opts, n_ubatch=ub, n_batch=nb, kv=kv or opts.kv))

    return ubatch.chosen(p, opts, replan, batch_given=given.n_batch is not None)


def plan_for(model, devices: list[Device], cpu: Device, opts: PlanOptions) -> Plan:
    """The plan for resolved options on devices already resolved (`devices.resolve_devices`), its
    split-independent terms checked against llama.cpp's own accounting (`referee`), its split's compute buffers
    sized by llama.cpp's dry run of it (`split_referee`)."""
    src = compute_mod.load_source(model)  # headers only: a Hub model's weights are not downloaded
    path = src.source or src.path  # what llama.cpp loads: a local file, or the Hub model `ctxq run` fetches
    # verified rules, else llama.cpp's accounting of the header (planning.facts)
    info = model_facts(src, model_info(src), n_ctx=opts.n_ctx, n_ubatch=opts.n_ubatch, n_batch=opts.n_batch,
                       flash_attn=opts.flash_attn)
    def checked(devs: list[Device]) -> Plan:
        p = _plan_info(src, str(path), info, devs, cpu, opts)
        return refereed(p, src, info, lambda better: _plan_info(src, str(path), better, devs, cpu, opts))

    # the split's compute buffers: llama.cpp's own dry run of it (split_referee), whose cuts take weights off a card
    # before whole layers, as the search does (spill.search): so "nothing to spill" is known only after it
    p = split_refereed(checked(devices), info, devices, checked)
    if opts.offload == "weights":
        spill.nothing_to_spill(p)
    return p


def _plan_info(src, path: str, info: ModelInfo, devices: list[Device], cpu: Device, opts: PlanOptions) -> Plan:
    experts = ExpertPlacement.chosen((t.name for t in src.tensors), info.n_layer, opts)  # checked before the search
    auto_experts = bool(experts.expert_layers) and not experts.fixed and opts.expert_offload is not False
    usable, fixed = kvpairs.usable_types(info), opts.kv_fixed()
    check_reserve(devices, opts)
    cuda = any(d.backend == "cuda" for d in devices)
    if fixed is not None:
        for name, t in (("type_k", fixed[0]), ("type_v", fixed[1])):
            if t not in usable:
                raise InvalidOption(f"KV type {t} cannot hold this model's rows ({info.head_dim_k}-wide K heads, "
                                    f"{info.head_dim_v}-wide V heads: llama.cpp needs whole blocks per head); use one "
                                    f"of {', '.join(usable)}", option=name, value=t)
        if not opts.flash_attn and fixed[1] != "f16":  # llama_init_from_model refuses a quantized V without it
            raise InvalidOption(f"type_v={fixed[1]} needs flash attention; drop flash_attn=False or use type_v=f16",
                                option="type_v", value=fixed[1])
    tensor = opts.split_mode == "tensor"
    if tensor:
        tensor_mod.check(info, src.arch, opts, devices, bool(experts.cpu_layers))
        auto_experts = False  # whole layers only (tensor.check)
    # FFN weights to host memory where whole layers would go (planning/spill/placement.py), in layer mode: a dense
    # model's, or after its routed experts a MoE's shared experts and dense layers' FFN
    ffn_spill = (not tensor and opts.split is None and opts.offload != "layers"
                 and any(la.ffn_bytes for la in info.layers))
    spill.check(opts, info, tensor, bool(experts.expert_layers), devices)
    pairs = [fixed] if fixed else [(k, v) for k, v in kvpairs.at_speed(cuda) if k in usable and v in usable]
    if tensor:  # a quantized cache llama.cpp's tensor mode aborts on at the first batch (tensor/batch.py)
        pairs = tensor_batch.usable_pairs(pairs, info, src, fixed)
    cands = kvpairs.ranked(pairs, kvpairs.measurements(path, opts.n_ctx))
    allowed = kvpairs.limited(cands, opts.max_kl, path, opts.n_ctx, fixed is not None)
    check_kv_can_fit(info, devices, cpu, opts, [c.pair for c in cands])
    if opts.split is not None:
        c0 = (allowed or cands)[0]
        c = costs(info, src, opts, *c0.pair, cuda).with_cpu_experts(experts.cpu_layers)
        p = (tensor_mod.evaluate(c, src, str(path), devices, cpu, opts, *c0.pair, tensor_mod.ratios(opts.split, devices))
             if tensor else _evaluate_split(c, str(path), devices, cpu, opts, *c0.pair))
        p.kv_quality = kvpairs.quality_line(c0, path, opts.n_ctx)
        return _read(_settle(experts.apply(p), opts), info, src, opts)

    def find(tk: str, tv: str):
        c = costs(info, src, opts, tk, tv, cuda).with_cpu_experts(experts.cpu_layers)
        if tensor:  # every card and the subsets, by estimate; or the cards bench pins (tensor_candidates)
            pick = tensor_mod.search if opts.tensor_cards is None else tensor_candidates.pinned
            return pick(c, src, str(path), devices, cpu, opts, tk, tv)
        p, host = _search(c, str(path), devices, cpu, opts, tk, tv, src)
        if not devices or (p is not None and not p.cpu_layers):
            return p, host

        def make(cf, slots, order, counts, gplans, h):
            return _make_plan(cf, str(path), opts, tk, tv, slots, counts, gplans, h, order, len(devices))

        if auto_experts:  # routed experts leave the cards before any layer does (spill.search)
            q, q_host = spill.search(c, devices, cpu, opts, make, (spill.EXPERTS,))
            if p is None or (q is not None and q.cpu_layers <= p.cpu_layers):  # never more whole CPU layers
                p, host = q, q_host
        if ffn_spill and (p is None or p.cpu_layers):  # then the FFN, each card's own; the cache last
            q, q_host = spill.search(c, devices, cpu, opts, make,
                                     (spill.EXPERTS, spill.FFN) if auto_experts else (spill.FFN,))
            pick = spill.chosen(p, q, info, src, opts)
            host = q_host if pick is q and q_host is not None else host
            p = pick
        return p, host

    def kv_size(tk: str, tv: str) -> int:
        return sum(kv_by_layer(info, opts.n_ctx, opts.n_ubatch, tk, tv))

    for_speed = opts.prefer == "speed" and bool(devices)  # may trade the pair for a faster plan (kvpairs.fastest)
    found, hosts = kvpairs.search(allowed, find, kv_size, past_full=for_speed)
    if not found:
        if opts.max_kl is not None:  # name the least measured loss that would fit
            more, _ = kvpairs.search([c for c in cands if c not in allowed and c.measured], find, kv_size)
            raise kvpairs.too_lossy(opts.max_kl, min((c for c, _ in more), key=lambda c: c.loss, default=None),
                                    opts.n_ctx)
        raise does_not_fit(cpu, hosts, opts.n_ctx)
    chosen, p, why = kvpairs.choose(found, devices, opts.prefer, opts.max_kl, cands,
                                    (lambda q: ubatch.estimated_s(q, info, src, opts)) if devices else None)
    traded = (why.startswith("KV ") and " for speed" in why) or " estimated fastest for the workload" in why
    p.reason = (p.reason + "; " if tensor else "") + why + ("" if traded else _kv_why(
        chosen, found, fixed is None and len(pairs) > 1, kv_size, opts.n_ctx))
    if p.speed.get("layers_moved"):  # fast_layers: the note has the figures
        p.reason += "; " + p.speed["layers_moved"].split(";")[0]
    p.kv_quality = kvpairs.quality_line(chosen, path, opts.n_ctx)
    spill.better_pair_note(p, chosen, found, info, src, opts)
    if opts.split_mode == "auto" and len(devices) > 1:
        layer = p
        p = tensor_mod.compare(layer, src, info, str(path), devices, cpu, opts, cuda, experts)

        def over(keep: list[int], why) -> Plan | None:  # tensor mode over those cards, this K/V pair
            c = costs(info, src, opts, layer.type_k, layer.type_v, cuda)
            try:
                return tensor_candidates.pinned(c, src, str(path), devices, cpu,
                                                replace(opts, tensor_cards=tuple(keep)), layer.type_k, layer.type_v)[0]
            except InvalidOption:  # its first batch would abort on those cards (tensor/batch.py)
                return None

        if not p.speed.get("tensor_refused"):  # every tensor candidate weighed by measurement
            p = tensor_candidates.measured_best(p, layer, over, devices, workload(opts))
    return _read(_settle(experts.apply(p), opts), info, src, opts)


def _read(p: Plan, info: ModelInfo, src, opts: PlanOptions) -> Plan:
    """The plan with its time to read the context (`speed["read"]`, planning/speed/reading.py)."""
    p.speed = {**p.speed, "read": reading(p, info, src, opts)}
    if p.speed["read"].get("decode_tps"):  # one decode rate per plan: the workload's, at its depth
        p.est_decode_tps = p.speed["read"]["decode_tps"]
    return p


def _kv_why(chosen, found, searched: bool, kv_size, n_ctx: int) -> str:
    """Why not an f16 cache, when the plan searched."""
    if chosen.pair == ("f16", "f16") or not searched:
        return ""
    f16 = next((p for c, p in found if c.pair == ("f16", "f16")), None)
    p = next(p for c, p in found if c is chosen)
    if f16 is not None and f16.cpu_layers == 0 and f16.cpu_ffn_layers and not p.cpu_ffn_layers:
        return (f"; f16 KV ({kv_size('f16', 'f16') / GiB:.1f} GiB) fits only with the FFN weights of "
                f"{len(f16.cpu_ffn_layers)} layers in host memory, {chosen.name} ({kv_size(*chosen.pair) / GiB:.1f} "
                "GiB) with every weight on the cards")
    if f16 is not None and f16.cpu_layers == 0 and (f16.cpu_ffn_layers or p.cpu_ffn_layers):
        return (f"; f16 KV would keep the FFN weights of {len(f16.cpu_ffn_layers)} layers in host memory, "
                f"{chosen.name} of {len(p.cpu_ffn_layers)}")
    if f16 is not None and f16.cpu_layers == 0:
        return (f"; f16 KV would keep the experts of {len(f16.cpu_expert_layers)} layers in CPU memory, "
                f"{chosen.name} of {len(p.cpu_expert_layers)}")
    return (f"; f16 KV ({kv_size('f16', 'f16') / GiB:.1f} GiB) does not fit at {n_ctx} tokens, "
            f"{chosen.name} ({kv_size(*chosen.pair) / GiB:.1f} GiB) does")


def _settle(p: Plan, opts: PlanOptions) -> Plan:
    """The plan with its context's sequence settings (PlanOptions.context_settings)."""
    for k, v in opts.context_settings().items():
        setattr(p, k, v)
    p.use_mmap = not opts.no_mmap
    return p


def _search(c: Costs, path: str, devices: list[Device], cpu: Device, opts: PlanOptions, tk: str, tv: str, g=None):
    """(the best plan with these KV types or None if the host cannot hold the rest, the host's plan)."""
    n = c.info.n_layer
    slots, order, counts = _best_split(c, devices, opts.reorder) if devices else (0, [], [])
    ds = [devices[i] for i in order]
    host_of = lambda k: host_cost(c, n + 1 - slots, sum(1 for x in k if x), cpu, k)  # noqa: E731

    shape = []

    def judge(k: list[int]) -> float | None:  # the workload's estimated seconds with split k (planning/speed/model.py)
        from .speed.shape import model_shape

        p = _make_plan(c, path, opts, tk, tv, slots, k, _layout(c, ds, k), host_of(k), order, len(devices))
        shape[:] = shape or [model_shape(c.info, tk, tv, g)]
        return ubatch.estimated_s(p, c.info, g, opts, shape[0])

    fast = fast_layers.faster(c, ds, counts, host_of, judge) if devices else None  # layers to faster cards
    if fast:
        counts = fast[0]
    gplans = _layout(c, ds, counts) if devices else []
    host = host_of(counts)
    if host.total > host.device.usable:
        return None, host
    p = _make_plan(c, path, opts, tk, tv, slots, counts, gplans, host, order, len(devices))
    if fast:
        p.notes.append(fast[1])
        p.speed = {**p.speed, "layers_moved": fast[1]}
    return p, host


def _make_plan(c: Costs, path: str, opts: PlanOptions, tk: str, tv: str, slots: int, counts: list[int],
               gplans: list[DevicePlan], host: DevicePlan, order: list[int], n_devices: int) -> Plan:
    p = Plan(model=path, n_ctx=opts.n_ctx, n_batch=opts.n_batch, n_ubatch=opts.n_ubatch, type_k=tk, type_v=tv,
             flash_attn=opts.flash_attn, n_gpu_layers=slots, tensor_split=counts, gpus=gplans, host=host,
             n_layer=c.info.n_layer, device_order=order if order != list(range(n_devices)) else None,
             expert_layers=c.info.expert_layers, cpu_expert_layers=sorted(c.cpu_experts),
             cpu_ffn_layers=sorted(c.cpu_ffn))
    p.est_decode_tps = estimate_tps(gplans, host, c.info.token_embd_bytes, c.info.expert_read_fraction)
    return p


def _evaluate_split(c: Costs, path: str, devices: list[Device], cpu: Device, opts: PlanOptions,
                    tk: str, tv: str) -> Plan:
    """The plan for a split the caller gave: ratios as llama.cpp takes them, or layer counts."""
    split = opts.split
    if not devices:
        raise InvalidOption("a `split` needs devices: give `gpus`, `profile` or `rpc`", option="split", value=split)
    parts = split if isinstance(split, (list, tuple)) else str(split).replace(":", ",").split(",")
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        raise InvalidOption(f"`split` {split!r}: give ratios like 16:16:16:8:8 or layer counts like 19,19,19,10,14",
                            option="split", value=split) from None
    if len(vals) != len(devices):
        raise InvalidOption(f"`split` has {len(vals)} values for {len(devices)} devices", option="split", value=split,
                            limit=len(devices))
    n = c.info.n_layer
    counts = llama_layer_counts(vals, n + 1, n + 1)
    gplans = _layout(c, devices, counts)
    host = host_cost(c, 0, sum(1 for k in counts if k), cpu, counts)
    p = Plan(model=path, n_ctx=opts.n_ctx, n_batch=opts.n_batch, n_ubatch=opts.n_ubatch, type_k=tk, type_v=tv,
             flash_attn=opts.flash_attn, n_gpu_layers=n + 1, tensor_split=counts, gpus=gplans, host=host, n_layer=n,
             reason="the split you gave")
    over = [g for g in gplans if g.total > g.device.usable]
    if over:
        p.notes.append("does not fit: " + ", ".join(
            f"{g.device.name} needs {g.total / GiB:.2f} GiB of {g.device.usable / GiB:.2f}" for g in over))
    p.expert_layers, p.cpu_expert_layers = c.info.expert_layers, sorted(c.cpu_experts)
    p.est_decode_tps = estimate_tps(gplans, host, c.info.token_embd_bytes, c.info.expert_read_fraction)
    return p


def llama_layer_counts(split: list[float], n_gpu_layers: int, n_layer_all_plus_1: int) -> list[int]:
    """How many layer slots llama.cpp puts on each device for a tensor_split (llama_model::load_tensors):
    cumulative float32 fractions, then upper_bound of (il - i_gpu_start) / act_gpu_layers."""
    import numpy as np  # here: a plan that gives no split needs none of numpy's import (0.1 s)

    splits = np.cumsum(np.asarray(split, dtype=np.float32), dtype=np.float32)
    splits = (splits / splits[-1]).astype(np.float32)
    act = min(n_gpu_layers, n_layer_all_plus_1)
    counts = [0] * len(split)
    for j in range(act):
        x = np.float32(j) / np.float32(act)
        counts[int(np.searchsorted(splits, x, side="right"))] += 1
    return counts
