"""`ctxq plan`: fit a required context onto devices, the way llama.cpp will allocate it.

The memory model (all sizes in bytes) follows llama.cpp's allocations:

- weights: each layer's tensors on the device its layer is assigned to; token embeddings on the host;
  the output head (output.weight, output_norm) on the device of layer n_layer (the last GPU in use,
  or the host); tied embeddings get a second copy there (TENSOR_DUPLICATED in load_tensors).
- KV cache: per layer on that layer's device (offload_kqv), kv_size = n_ctx padded to 256 cells,
  sliding-window layers pad256(n_swa + n_ubatch) cells (llama_kv_cache_iswa), row sizes by type.
- compute buffers: measured by llama.cpp itself on a derived one-layer model (`compute.py`), plus the
  graph-input copies that each device holds when the graph is split (`_split_inputs`).
- host: token embeddings, layers left on the CPU with their KV, the CPU's compute buffer and the
  logits buffer (n_vocab floats per sequence).

The search holds n_ctx fixed, tries KV types in the order a policy prefers, and for each finds the
most layers the devices can hold (leftover layers go to the CPU, as llama.cpp puts the first
n_layer + 1 - n_gpu_layers layers there), balanced by free memory, over the distinct device orders.
The split goes to llama.cpp as integer layer counts, which it reproduces exactly.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from . import compute as compute_mod
from .devices import Device, cpu_device
from ..errors import CtxqError, DoesNotFit, InvalidOption
from ..gguf.info import ModelInfo, kv_bytes, model_info
from ..units import GiB, MiB, round_up

log = logging.getLogger(__name__)

KV_PAD = 256  # llama_context pads the KV cache to 256 cells (llama_kv_cache::get_padding)
KV_ORDER = ("f16", "q8_0", "q4_0")
# Headroom kept free on every GPU. Not measured in this repo (no CUDA device here, see issue 8):
# the CUDA context, cuBLAS workspaces and allocator slack take 300-600 MiB per card in llama.cpp
# user reports; RPC workers on this machine allocate exactly what llama.cpp logs.
GPU_MARGIN = 512 * MiB
RPC_MARGIN = 32 * MiB  # rounding of llama.cpp's per-buffer alignment, measured on RPC workers
HOST_MARGIN = 1 * GiB  # the Python process, llama.cpp's own heap and the OS page cache for mmap
# llama.cpp keeps this many copies of graph inputs with pipeline parallelism (GGML_SCHED_MAX_COPIES).
SCHED_COPIES = 4


@dataclass
class DevicePlan:
    """What one device holds; sizes in bytes."""

    device: Device
    layers: list[int]  # layer indices; n_layer stands for the output head
    weights: int = 0
    kv: int = 0
    compute: int = 0
    margin: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.margin

    @property
    def free(self) -> int:
        return self.device.usable - self.total

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


@dataclass
class Plan:
    """A runnable plan: `Llama(model, **plan.llama_kwargs())` loads it as planned."""

    model: str
    n_ctx: int
    n_batch: int
    n_ubatch: int
    type_k: str
    type_v: str
    flash_attn: bool
    n_gpu_layers: int
    tensor_split: list[int]  # integer layer counts per GPU device, in llama.cpp's device order
    gpus: list[DevicePlan]  # in llama.cpp's order (after any reordering)
    host: DevicePlan
    n_layer: int
    swa_full: bool = False  # sliding-window layers keep only their window (llama.cpp defaults to full)
    device_order: list[int] | None = None  # indices into the given devices when reordered
    reason: str = ""
    est_decode_tps: float | None = None  # an estimate from memory bandwidth, not a measurement
    notes: list[str] = field(default_factory=list)

    @property
    def devices(self) -> list[DevicePlan]:
        return [*self.gpus, self.host]

    @property
    def cpu_layers(self) -> int:
        return self.n_layer + 1 - self.n_gpu_layers

    def llama_kwargs(self) -> dict:
        """Keyword arguments for `llama_cpp.Llama`."""
        import llama_cpp
        from gguf.constants import GGMLQuantizationType as T

        kw = dict(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                  n_gpu_layers=self.n_gpu_layers, split_mode=llama_cpp.LLAMA_SPLIT_MODE_LAYER,
                  type_k=int(T[self.type_k.upper()]), type_v=int(T[self.type_v.upper()]),
                  flash_attn=self.flash_attn, offload_kqv=True, swa_full=self.swa_full)
        if self.gpus:
            kw["tensor_split"] = [float(c) for c in self.tensor_split]
            kw["main_gpu"] = 0
        return kw

    def llama_flags(self) -> str:
        """The same plan as llama.cpp command-line flags."""
        flags = f"-c {self.n_ctx} -b {self.n_batch} -ub {self.n_ubatch} -ngl {self.n_gpu_layers}"
        if self.gpus:
            flags += " -sm layer -ts " + ",".join(str(c) for c in self.tensor_split)
        flags += f" -ctk {self.type_k} -ctv {self.type_v} -fa {'on' if self.flash_attn else 'off'}"
        if self.swa_full:  # llama.cpp's tools default to the window; its C API to the full size
            flags += " --swa-full"
        return flags

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("gpus", "host")}
        d["gpus"] = [g.to_dict() for g in self.gpus]
        d["host"] = self.host.to_dict()
        d["llama_flags"] = self.llama_flags()
        d["cpu_layers"] = self.cpu_layers
        return d


# --- the memory model -------------------------------------------------------------------------

@dataclass
class _Costs:
    """Per-layer and per-device costs for one (n_ctx, KV types, flash attention) choice."""

    info: ModelInfo
    layer_weights: list[int]
    layer_kv: list[int]
    output_weights: int
    peaks: compute_mod.ComputePeaks
    inputs: int  # one copy of the split-graph inputs (masks + residual), as the host builds and devices receive them
    resid: int  # the residual stream, f32 [n_embd, n_ubatch]
    logits: int
    f16_cache: bool = True
    swa_mask_overlap: int = 0


def kv_cells(info: ModelInfo, n_ctx: int, n_ubatch: int, il: int) -> int:
    """Cells of layer il's KV cache (llama_context pads n_ctx to 256; SWA layers hold a window)."""
    size = round_up(n_ctx, KV_PAD)
    if info.swa_layers[il] and info.n_swa:
        return min(size, round_up(info.n_swa + n_ubatch, KV_PAD))
    return size


def _costs(info: ModelInfo, src, n_ctx: int, n_ubatch: int, n_batch: int, type_k: str, type_v: str,
           flash_attn: bool) -> _Costs:
    layer_kv = [kv_cells(info, n_ctx, n_ubatch, il) * (kv_bytes(type_k, info.n_embd_k_gqa(il))
                                                      + kv_bytes(type_v, info.n_embd_v_gqa(il)))
                for il in range(info.n_layer)]
    out_w = info.output_bytes + (info.token_embd_bytes if info.output_tied else 0)
    peaks = compute_mod.compute_peaks(src, info.swa_layers, n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch,
                                      type_k=type_k, type_v=type_v, flash_attn=flash_attn)
    n_kv = round_up(n_ctx, KV_PAD)
    # Graph inputs that cross devices, read off llama.cpp's split graphs on RPC devices
    # (docs/accuracy.md): the attention mask ([n_kv, n_ubatch], f16 with flash attention, else f32;
    # iSWA models carry a second one over the window's cells) and the residual stream (f32 [n_embd, n_ubatch]).
    mask_cells = n_kv + (kv_cells(info, n_ctx, n_ubatch, info.swa_layers.index(True)) if any(info.swa_layers) else 0)
    mask = mask_cells * n_ubatch * (2 if flash_attn else 4)
    resid = info.n_embd * n_ubatch * 4
    return _Costs(info, list(info.layer_bytes), layer_kv, out_w, peaks, inputs=mask + resid,
                  resid=resid, logits=info.n_vocab * 4,
                  f16_cache=type_k == "f16" and type_v == "f16",
                  swa_mask_overlap=n_kv * n_ubatch * (2 if flash_attn else 4) if any(info.swa_layers) else 0)


def _device_cost(c: _Costs, layers: range, has_output: bool, first: bool, n_used: int, dev: Device) -> DevicePlan:
    dp = DevicePlan(dev, list(layers) + ([c.info.n_layer] if has_output else []))
    dp.weights = sum(c.layer_weights[i] for i in layers) + (c.output_weights if has_output else 0)
    dp.kv = sum(c.layer_kv[i] for i in layers)
    if n_used <= 1:  # one device, no pipeline: the graph's own peak (measured as such)
        dp.compute = c.peaks.output if has_output else c.peaks.layer_full
    elif has_output and not layers:  # the output head alone: no attention, so no mask copies (measured)
        dp.compute = c.peaks.output + 3 * c.resid
    elif has_output:  # with an f16 cache the output device also keeps 3 residual-sized tensors (measured, RPC)
        dp.compute = c.peaks.output + SCHED_COPIES * c.inputs + (3 * c.resid if c.f16_cache else 0)
    else:
        # iSWA graphs: the derived model's peak already holds one full-size mask that the split graph
        # receives as an input copy instead (measured on Gemma 2 at 4k-64k: the error grew by exactly
        # one f16 mask per token without this)
        dp.compute = c.peaks.layer_full + SCHED_COPIES * c.inputs - c.swa_mask_overlap
    dp.margin = GPU_MARGIN if dev.kind == "gpu" else RPC_MARGIN
    return dp


def _fill(c: _Costs, devs: list[Device], n_gpu_layer_slots: int, cap_frac: float):
    """Place the top `n_gpu_layer_slots` layer slots (output head included) on devs, filling from the
    last device backwards, each up to cap_frac of its usable memory. None if they do not all fit."""
    n = c.info.n_layer
    counts = [0] * len(devs)
    hi = n + 1  # slots [lo, hi) remain; slot n is the output head
    lo_bound = n + 1 - n_gpu_layer_slots
    for d in range(len(devs) - 1, -1, -1):
        if hi <= lo_bound:
            break
        budget = devs[d].usable * cap_frac
        take = 0
        while hi - take - 1 >= lo_bound:
            start = hi - take - 1
            has_out = hi == n + 1
            layers = range(start, min(hi, n))
            dp = _device_cost(c, layers, has_out, False, 2, devs[d])
            if dp.total > budget:
                break
            take += 1
        counts[d] = take
        hi -= take
    if hi > lo_bound:
        return None
    return counts


def _layout(c: _Costs, devs: list[Device], counts: list[int]) -> list[DevicePlan]:
    n = c.info.n_layer
    n_used = sum(1 for k in counts if k)
    start = n + 1 - sum(counts)
    out, first = [], True
    for dev, k in zip(devs, counts):
        slots = range(start, start + k)
        has_out = k > 0 and slots[-1] == n
        layers = range(start, min(start + k, n))
        dp = _device_cost(c, layers, has_out, first and k > 0, n_used, dev) if k else DevicePlan(dev, [])
        if k:
            first = False
        out.append(dp)
        start += k
    return out


def _host(c: _Costs, n_cpu_layers: int, n_used: int, cpu: Device) -> DevicePlan:
    n = c.info.n_layer
    layers = range(0, min(n_cpu_layers, n))
    has_out = n_cpu_layers == n + 1
    dp = DevicePlan(cpu, list(layers) + ([n] if has_out else []))
    dp.weights = c.info.token_embd_bytes + c.info.other_bytes + sum(c.layer_weights[i] for i in layers) \
        + (c.info.output_bytes if has_out else 0)
    dp.kv = sum(c.layer_kv[i] for i in layers)
    if n_used == 0:
        dp.compute = c.peaks.output
    else:
        # the host builds the inputs of a split graph; with CPU layers it also runs them
        copies = SCHED_COPIES if n_used > 1 else 1
        dp.compute = copies * c.inputs + c.resid  # the host builds the inputs + (c.peaks.layer_full if len(layers) else 0)
    dp.compute += c.logits
    dp.margin = HOST_MARGIN
    return dp


def _orders(devs: list[Device], allow_reorder: bool) -> list[list[int]]:
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


def _best_split(c: _Costs, devs: list[Device], cpu: Device, allow_reorder: bool):
    """(n_gpu_slots, order, counts) with the most layers on the devices, balanced; None if the host
    cannot hold the rest."""
    n = c.info.n_layer
    best = None
    for order in _orders(devs, allow_reorder):
        ds = [devs[i] for i in order]
        lo, hi = 0, n + 1  # most slots that fit at full capacity
        if _fill(c, ds, 0, 1.0) is None:
            continue
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fill(c, ds, mid, 1.0) is not None:
                lo = mid
            else:
                hi = mid - 1
        if best is None or lo > best[0]:
            best = (lo, order)
    if best is None:
        return None
    slots, order = best
    ds = [devs[i] for i in order]
    # Balance: first as llama.cpp would by default (layers in proportion to memory), kept when every
    # device holds its share; else the smallest common fill fraction that still places every slot.
    prop = _proportional(ds, slots)
    if _counts_fit(c, ds, prop):
        return slots, order, prop
    f_lo, f_hi = 0.0, 1.0
    counts = _fill(c, ds, slots, 1.0)
    for _ in range(20):
        mid = (f_lo + f_hi) / 2
        k = _fill(c, ds, slots, mid)
        if k is not None:
            f_hi, counts = mid, k
        else:
            f_lo = mid
    return slots, order, counts


def _proportional(devs: list[Device], slots: int) -> list[int]:
    """Slots in proportion to usable memory, by largest remainder."""
    total = sum(d.usable for d in devs) or 1
    exact = [slots * d.usable / total for d in devs]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(devs)), key=lambda i: exact[i] - counts[i], reverse=True)[:slots - sum(counts)]:
        counts[i] += 1
    return counts


def _counts_fit(c: _Costs, devs: list[Device], counts: list[int]) -> bool:
    return all(dp.total <= dp.device.usable for dp in _layout(c, devs, counts))


def _estimate_tps(gpus: list[DevicePlan], host: DevicePlan, token_embd: int) -> float | None:
    """Decode tokens/s if each token reads every weight and the whole KV cache once (a full context),
    device after device at its memory bandwidth. An estimate, not a measurement."""
    secs = 0.0
    for dp in [*gpus, host]:
        read = dp.weights + dp.kv - (token_embd if dp is host else 0)  # embeddings: one row per token
        if read <= 0:
            continue
        if not dp.device.bandwidth:
            return None
        secs += read / dp.device.bandwidth
    return 1.0 / secs if secs > 0 else None


# --- public entry point -----------------------------------------------------------------------

def plan(model: str | os.PathLike | None, n_ctx: int, *, gpus=None, profile: str | None = None,
         rpc=None, devices: list[Device] | None = None, kv: str = "auto", type_k: str | None = None,
         type_v: str | None = None, flash_attn: bool | None = None, split=None, prefer: str = "quality",
         n_ubatch: int = 512, n_batch: int = 2048, cpu_memory: int | None = None,
         reorder: bool = True) -> Plan:
    """Plan n_ctx tokens of context for `model` on the given or detected devices.

    gpus: "16,16,16,8,8", "3x16,2x8" or a list of GiB; profile: a name in profiles/;
    devices: ready `Device` objects (e.g. RPC workers). Nothing given: the devices llama.cpp sees.
    kv: "auto" searches f16 / q8_0 / q4_0; a type name fixes both K and V (type_k/type_v override).
    split: "16:16:16:8:8" (ratios, as llama.cpp's -ts) or "19,19,19,10,14" (layer counts) evaluates that
    split instead of searching. prefer: "quality" keeps KV at q8_0 or better when layers can go to
    the CPU instead; "speed" lowers the KV type before moving layers to the CPU.
    Raises DoesNotFit naming the smallest change that would fit.
    """
    from .devices import detect_gpus, load_profile, parse_gpus
    from ..models import resolve_model

    if n_ctx <= 0:
        raise InvalidOption(f"n_ctx must be positive, got {n_ctx}", option="n_ctx", value=n_ctx)
    if prefer not in ("quality", "speed"):
        raise InvalidOption(f"`prefer` must be quality or speed, not {prefer!r}", option="prefer", value=prefer)
    path = resolve_model(model)
    src = compute_mod.load_source(path)
    info = model_info(src)
    cpu_bw = None
    if devices is None:
        if gpus is not None:
            devices = parse_gpus(gpus)
        elif profile is not None:
            devices, cpu_cfg = load_profile(profile)
            cpu_bw = float(cpu_cfg["bandwidth_gbs"]) * 1e9 if "bandwidth_gbs" in cpu_cfg else None
            if cpu_memory is None and "memory_gib" in cpu_cfg:
                cpu_memory = int(float(cpu_cfg["memory_gib"]) * GiB)
        else:
            devices = []
        if rpc:
            from ..rpc import parse_rpc, probe

            rpc_devs = []
            for i, ep in enumerate(parse_rpc(rpc)):
                free, total = (ep.declared, ep.declared) if ep.declared else probe(ep.endpoint)
                rpc_devs.append(Device(name=f"RPC{i}[{ep.endpoint}]", kind="rpc", total=total, usable=free,
                                       bandwidth=None, present=True, endpoint=ep.endpoint))
            devices = rpc_devs + devices  # llama.cpp puts RPC devices first
        if gpus is None and profile is None and not rpc:
            devices = detect_gpus()
    cpu = cpu_device(cpu_memory, cpu_bw)

    if kv not in ("auto", *KV_ORDER):
        raise InvalidOption(f"`kv` must be auto, f16, q8_0 or q4_0, not {kv!r}", option="kv", value=kv)
    if type_k or type_v or kv != "auto":
        fixed = kv if kv != "auto" else "f16"
        candidates = [(type_k or fixed, type_v or fixed)]
    else:
        candidates = [(t, t) for t in KV_ORDER]
    for tk, tv in candidates:
        for t in (tk, tv):
            if t not in info.kv_bytes_per_token:
                raise CtxqError(f"KV type {t} cannot hold this model's rows ({info.head_dim_k}-wide heads); "
                                f"use one of {', '.join(info.kv_bytes_per_token)}")

    def fa_for(tv):  # a quantized V cache needs flash attention (llama_init_from_model refuses it)
        if flash_attn is False and tv != "f16":
            raise InvalidOption(f"type_v={tv} needs flash attention; drop flash_attn=False or use type_v=f16",
                                option="type_v", value=tv)
        return True if flash_attn is None else flash_attn

    if split is not None:
        tk, tv = candidates[0]
        c = _costs(info, src, n_ctx, n_ubatch, n_batch, tk, tv, fa_for(tv))
        return _evaluate_split(c, path, info, devices, cpu, split, n_ctx, n_batch, n_ubatch, tk, tv, fa_for(tv))

    results = []
    for tk, tv in candidates:
        fa = fa_for(tv)
        c = _costs(info, src, n_ctx, n_ubatch, n_batch, tk, tv, fa)
        found = _best_split(c, devices, cpu, reorder) if devices else (0, [], [])
        if found is None:
            continue
        slots, order, counts = found
        ds = [devices[i] for i in order]
        gplans = _layout(c, ds, counts) if devices else []
        n_used = sum(1 for k in counts if k)
        host = _host(c, info.n_layer + 1 - slots, n_used, cpu)
        if host.total > host.device.usable:
            results.append((None, tk, tv, host))
            continue
        p = Plan(model=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k=tk, type_v=tv,
                 flash_attn=fa, n_gpu_layers=slots, tensor_split=counts, gpus=gplans, host=host,
                 n_layer=info.n_layer, device_order=order if order != list(range(len(devices))) else None)
        p.est_decode_tps = _estimate_tps(gplans, host, info.token_embd_bytes)
        results.append((p, tk, tv, host))
    plans = [r[0] for r in results if r[0] is not None]
    if not plans:
        raise _does_not_fit(info, devices, cpu, results, n_ctx)
    full = [p for p in plans if p.cpu_layers == 0 or not devices]
    if full:
        chosen = full[0]
        why = "all layers on the GPUs" if devices else "no GPUs: everything on the CPU"
    elif prefer == "quality":
        good = [p for p in plans if p.type_v != "q4_0"] or plans
        chosen = max(good, key=lambda p: (p.n_gpu_layers, -KV_ORDER.index(p.type_v)))
        why = f"{chosen.cpu_layers} layers on the CPU; KV kept at {chosen.type_k} for quality"
    else:
        chosen = max(plans, key=lambda p: (p.n_gpu_layers, -KV_ORDER.index(p.type_v)))
        why = f"{chosen.cpu_layers} layers on the CPU with the smallest KV type that minimises them"
    if chosen.type_k != "f16" and len(candidates) > 1:
        kv_f16 = sum(kv_cells(info, n_ctx, n_ubatch, il) * (kv_bytes("f16", info.n_embd_k_gqa(il))
                     + kv_bytes("f16", info.n_embd_v_gqa(il))) for il in range(info.n_layer))
        kv_got = chosen.host.kv + sum(g.kv for g in chosen.gpus)
        why += (f"; f16 KV ({kv_f16 / GiB:.1f} GiB) does not fit at {n_ctx} tokens, "
                f"{chosen.type_k} ({kv_got / GiB:.1f} GiB) does")
    chosen.reason = why
    return chosen


def _does_not_fit(info, devices, cpu, results, n_ctx) -> DoesNotFit:
    host_need = min((r[3].total for r in results), default=0)
    if results and host_need > cpu.usable:
        short = host_need - cpu.usable
        tried_q4 = any(r[2] == "q4_0" for r in results)
        kv_hint = "" if tried_q4 else "use type_k=q4_0 type_v=q4_0, "
        return DoesNotFit(f"{n_ctx} tokens do not fit: the CPU needs {host_need / GiB:.1f} GiB for the layers "
                          f"the GPUs cannot hold, {cpu.usable / GiB:.1f} GiB is available",
                          f"add {short / GiB:.1f} GiB of GPU memory, {kv_hint}or use a smaller quantization "
                          "of the model")
    return DoesNotFit(f"{n_ctx} tokens do not fit on these devices",
                      "use a smaller quantization, a smaller n_ctx, or more GPU memory")


def _evaluate_split(c, path, info, devices, cpu, split, n_ctx, n_batch, n_ubatch, tk, tv, fa) -> Plan:
    """The plan for a split the user gave: ratios as llama.cpp takes them, or layer counts."""
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
    n = info.n_layer
    counts = llama_layer_counts(vals, n + 1, n + 1)
    gplans = _layout(c, devices, counts)
    n_used = sum(1 for k in counts if k)
    host = _host(c, 0, n_used, cpu)
    p = Plan(model=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k=tk, type_v=tv,
             flash_attn=fa, n_gpu_layers=n + 1, tensor_split=counts, gpus=gplans, host=host, n_layer=n,
             reason="the split you gave")
    over = [g for g in gplans if g.total > g.device.usable]
    if over:
        p.notes.append("does not fit: " + ", ".join(
            f"{g.device.name} needs {g.total / GiB:.2f} GiB of {g.device.usable / GiB:.2f}" for g in over))
    p.est_decode_tps = _estimate_tps(gplans, host, info.token_embd_bytes)
    return p


def llama_layer_counts(split: list[float], n_gpu_layers: int, n_layer_all_plus_1: int) -> list[int]:
    """How many layer slots llama.cpp puts on each device for a tensor_split (llama_model::load_tensors):
    cumulative float32 fractions, then upper_bound of (il - i_gpu_start) / act_gpu_layers."""
    splits = np.cumsum(np.asarray(split, dtype=np.float32), dtype=np.float32)
    splits = (splits / splits[-1]).astype(np.float32)
    act = min(n_gpu_layers, n_layer_all_plus_1)
    counts = [0] * len(split)
    for j in range(act):
        x = np.float32(j) / np.float32(act)
        counts[int(np.searchsorted(splits, x, side="right"))] += 1
    return counts
