"""Checks made before and after the planner's search: refusals with one line naming the fix."""

from __future__ import annotations

from .devices import Device
from .memory.costs import kv_by_layer
from .options import PlanOptions
from .plan import DevicePlan
from ..errors import DoesNotFit, InvalidOption
from ..gguf.info import ModelInfo
from ..units import GiB


def check_kv_can_fit(info: ModelInfo, devices: list[Device], cpu: Device, opts: PlanOptions, candidates) -> None:
    """Refuse, before llama.cpp is asked (its dry run would throw std::bad_alloc), a context whose KV cache
    alone, at the smallest KV type tried, exceeds all devices and the host together."""
    kv = min((sum(kv_by_layer(info, opts.n_ctx, opts.n_ubatch, tk, tv)) for tk, tv in candidates
              if tk in info.kv_bytes_per_token and tv in info.kv_bytes_per_token), default=0)
    room = sum(d.usable for d in devices) + cpu.usable
    if kv > room:
        raise DoesNotFit(f"{opts.n_ctx} tokens do not fit: their KV cache alone needs {kv / GiB:,.1f} GiB, "
                         f"the devices and the host have {room / GiB:,.1f} GiB",
                         "give a smaller n_ctx", option="n_ctx", value=opts.n_ctx)


def check_reserve(devices: list[Device], opts: PlanOptions) -> None:
    """A reserve must leave room for something on every GPU it applies to."""
    for d in devices:
        r = opts.reserve if opts.reserve is not None else d.reserve
        if d.kind == "gpu" and r is not None and r >= d.usable:
            raise InvalidOption(f"a reserve of {r / GiB:.2f} GiB leaves nothing of {d.name}'s {d.usable / GiB:.2f} GiB; "
                                "give a smaller `reserve`", option="reserve", value=r, limit=d.usable)


def does_not_fit(cpu: Device, hosts: list[tuple[DevicePlan, str]], n_ctx: int) -> DoesNotFit:
    host_need = min((h.total for h, _ in hosts), default=0)
    if hosts and host_need > cpu.usable:
        short = host_need - cpu.usable
        kv_hint = "" if any(tv == "q4_0" for _, tv in hosts) else "use type_k=q4_0 type_v=q4_0, "
        return DoesNotFit(f"{n_ctx} tokens do not fit: the CPU needs {host_need / GiB:.1f} GiB for the layers "
                          f"the GPUs cannot hold, {cpu.usable / GiB:.1f} GiB is available",
                          f"add {short / GiB:.1f} GiB of GPU memory, {kv_hint}or use a smaller quantization "
                          "of the model", option="n_ctx", value=n_ctx)
    return DoesNotFit(f"{n_ctx} tokens do not fit on these devices",
                      "use a smaller quantization, a smaller n_ctx, or more GPU memory", option="n_ctx", value=n_ctx)
