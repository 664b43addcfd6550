"""The planner against llama.cpp's real allocations: one cell = one model, devices, context, KV type.

`check_cell()` plans with `ctxq.planning.planner`, then loads the model for real in a child process (on the
CPU, or split over local ggml RPC workers standing for GPUs), reads llama.cpp's own log lines
(model / KV / compute buffer sizes and `layer N assigned to device D`) and compares them per device.
The margin the planner keeps free is not an allocation and is left out of the comparison.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..planning.devices import Device
from ..planning.planner import Plan, plan
from ..units import GiB, MiB

TARGET_REL, TARGET_ABS = 0.01, 32 * MiB  # every device within 1.0 % or 32 MiB (the planner issue)
TINY_REL, TINY_ABS = 0.03, 2 * MiB  # tiny test models (issue 22): within 3 % or 2 MiB
PRINTED = 0.005 * MiB  # llama.cpp prints each buffer size in MiB with 2 decimals: half a step per printed value


@dataclass
class DeviceCheck:
    name: str
    planned: dict  # weights / kv / compute, bytes
    real: dict
    n_printed: int = 4  # how many of llama.cpp's printed sizes the real total adds up

    @property
    def resolution(self) -> float:
        """How far the real total can be from the true bytes: each printed size is rounded to 0.01 MiB."""
        return self.n_printed * PRINTED

    @property
    def planned_total(self) -> int:
        return sum(self.planned.values())

    @property
    def real_total(self) -> int:
        return sum(self.real.values())

    @property
    def error(self) -> int:
        return self.planned_total - self.real_total

    @property
    def under(self) -> bool:
        """Planned below llama.cpp by more than its printed sizes' rounding."""
        return self.error < -self.resolution

    @property
    def shown_error(self) -> float:
        """The error in bytes, 0 where it is within the rounding of llama.cpp's printed sizes."""
        return 0.0 if abs(self.error) <= self.resolution else float(self.error)

    @property
    def ok(self) -> bool:
        return abs(self.error) <= max(TARGET_REL * self.real_total, TARGET_ABS)

    @property
    def ok_tiny(self) -> bool:
        return abs(self.error) <= max(TINY_REL * self.real_total, TINY_ABS)


@dataclass
class CellResult:
    label: str
    devices: list[DeviceCheck]
    layers_match: bool
    layer_mismatch: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.layers_match and all(d.ok for d in self.devices)

    @property
    def worst(self) -> DeviceCheck:
        return max(self.devices, key=lambda d: abs(d.error))


def _on_cpu(buffers: dict[str, int]) -> int:
    return sum(v for k, v in buffers.items() if k.startswith("CPU"))


def _measure_child(model: str, kwargs: dict, cpu_patterns: tuple[str, ...] = ()) -> dict:
    """In the child: load for real, return llama.cpp's allocations as plain dicts. cpu_patterns: tensor
    buffer overrides to the CPU (the plan's experts in CPU memory), as `ctxq.llama.overrides.create_llama`
    sets them for `Llama`."""
    from ..llama.measure import measure

    m = measure(model, cpu_patterns=tuple(cpu_patterns), **kwargs)
    a = m.allocations
    return {"model": a.model, "kv": a.kv, "state": a.state, "compute": a.compute, "output": a.output,
            "layers": a.layers, "printed": a.printed}


def check_cell(model: str, n_ctx: int, type_kv: str, sizes_gib: list[float] | None, workers=None,
               label: str = "", n_ubatch: int = 512, flash_attn: bool | None = None,
               search: bool = False, cpu_moe: bool | None = None, n_cpu_moe: int | None = None,
               cpu_memory: int | None = None, parallel: int | None = None, offload: str | None = None,
               override_tensor=None, use_mmap: bool | None = None) -> CellResult:
    """Plan and really load; sizes_gib None means the CPU alone, else RPC workers split by those ratios
    (or, with `search`, RPC devices of those sizes that the planner fills, leaving the rest on the CPU).
    cpu_moe / n_cpu_moe: the user's expert placement (else, with `search`, the planner's); override_tensor: the user's -ot
    entries (PlanOptions.override_tensor); parallel: a context
    for that many sequences (PlanOptions.parallel). A plan with experts
    in CPU memory is loaded without mmap: llama.cpp's CPU_Mapped buffer would report the file's span from the
    first host tensor to the last (address space, not RAM); without mmap the host buffers hold exactly the
    host's tensors, what the plan's RAM figure counts; `use_mmap=False` loads every plan so (whole CPU layers too)."""
    moe = dict(cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, cpu_memory=cpu_memory, parallel=parallel, offload=offload,
               override_tensor=override_tensor)
    from ..rpc import run_supervised

    if sizes_gib:
        devices = [Device(name=f"RPC{i}", kind="rpc", total=int(s * GiB), usable=int(s * GiB))
                   for i, s in enumerate(sizes_gib)]
        p: Plan = plan(model, n_ctx, devices=devices, kv=type_kv, n_ubatch=n_ubatch, flash_attn=flash_attn,
                       split=None if search else ":".join(f"{s:g}" for s in sizes_gib), **moe)
    else:
        p = plan(model, n_ctx, devices=[], kv=type_kv, n_ubatch=n_ubatch, flash_attn=flash_attn, **moe)
    patterns = tuple(p.tensor_overrides())
    mmap = not patterns if use_mmap is None else use_mmap
    kw = dict(n_ctx=n_ctx, n_gpu_layers=p.n_gpu_layers, type_k=p.type_k, type_v=p.type_v,
              flash_attn=p.flash_attn, n_batch=p.n_batch, n_ubatch=p.n_ubatch, swa_full=p.swa_full,
              use_mmap=mmap, **p.context_settings())  # parallel: the engine's context (Plan.parallel)
    if sizes_gib:  # the ratios, as a user would give them, or the plan's layer counts
        kw["tensor_split"] = [float(c) for c in p.tensor_split] if search else [float(s) for s in sizes_gib]
    real = run_supervised(_measure_child, model, kw, patterns, rpc=workers.endpoints if workers else (),
                          workers=workers, timeout=900)
    checks = []
    # llama.cpp names RPC buffers "RPC<d>[host:port]" (d: the device on that worker), in worker order
    endpoints = workers.endpoints if workers else []
    for i, g in enumerate(p.gpus):
        name = f"RPC0[{endpoints[i]}]" if i < len(endpoints) else f"RPC{i}"
        checks.append(DeviceCheck(g.device.name, {"weights": g.weights, "kv": g.kv, "state": g.state,
                                                   "compute": g.compute},
                                  {"weights": real["model"].get(name, 0), "kv": real["kv"].get(name, 0),
                                   "state": real["state"].get(name, 0), "compute": real["compute"].get(name, 0)},
                                  real["printed"].get(name, 0)))
    h = p.host
    # CPU_REPACK holds re-laid-out copies of weights that stay mapped from the file (CPU_Mapped);
    # the model's own bytes are the mapped and plain CPU buffers (without mmap, the repacked ones are the only copy).
    host_model = sum(v for k, v in real["model"].items() if k.startswith("CPU") and (k != "CPU_REPACK" or not mmap))
    host_out = sum(real["output"].values())
    checks.append(DeviceCheck("CPU", {"weights": h.weights, "kv": h.kv, "state": h.state, "compute": h.compute},
                              {"weights": host_model, "kv": _on_cpu(real["kv"]), "state": _on_cpu(real["state"]),
                               "compute": sum(v for k, v in real["compute"].items() if k.startswith("CPU")) + host_out},
                              sum(n for k, n in real["printed"].items() if k.startswith("CPU"))))
    # layer assignment: the plan's device for each layer slot vs llama.cpp's log
    want = {il: f"RPC{i}" for i, g in enumerate(p.gpus) for il in g.layers}  # device names: RPC<i>
    want.update({il: "CPU" for il in h.layers})
    got = {il: re.sub(r"\[.*", "", d) for il, d in real["layers"].items()}
    mismatch = [f"layer {il}: plan {want.get(il)}, llama.cpp {d}" for il, d in sorted(got.items()) if want.get(il) != d]
    return CellResult(label, checks, not mismatch and len(got) == p.n_layer + 1, "; ".join(mismatch[:3]))


