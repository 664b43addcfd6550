"""Devices a plan can use: GPUs that are present, GPUs only described, RPC workers, the CPU.

Sizes are bytes. `--gpus 16,16,16,8,8` and `--gpus 3x16,2x8` describe GPUs in GiB;
a profile (TOML in `profiles/`) describes a box by name.
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import psutil

from ..errors import CtxqError, InvalidOption
from ..units import GiB
from .options import PlanOptions

log = logging.getLogger(__name__)


# Decode bandwidth assumed for a described GPU without a stated one (bytes/s): a mid-range
# consumer card (RTX 4060 Ti: 288 GB/s); only used for the labelled tokens/s estimate.
DEFAULT_GPU_BANDWIDTH = 288e9
# CPU RAM bandwidth assumed for the estimate: dual-channel DDR4-3200 (51.2 GB/s), at the
# ~60 % a decode loop reaches.
DEFAULT_CPU_BANDWIDTH = 30e9


@dataclass
class Device:
    """One place llama.cpp can put layers.

    kind is "gpu" (a present or described GPU), "rpc" (a ggml RPC worker) or "cpu" (host RAM).
    `backend` is the ggml backend that allocates its memory: "cuda" (described GPUs are CUDA cards
    unless a profile says otherwise), "rpc", "cpu", or another GPU backend ("vulkan", "metal", ...),
    which gets a safe default reserve. `total` is the device's memory; `usable` is what a plan may fill
    (free memory for a present device, the declared size or `usable` for a described one).
    `reserve`: bytes kept free outside every buffer on a GPU (None: the backend's default, see cuda.py).
    """

    name: str
    kind: str
    total: int  # bytes
    usable: int  # bytes
    bandwidth: float | None = None  # bytes/s, for the decode estimate
    endpoint: str | None = None  # host:port for RPC devices
    backend: str = ""  # "" means: "cuda" for a GPU, else the kind
    reserve: int | None = None  # bytes

    def __post_init__(self):
        if not self.backend:
            self.backend = "cuda" if self.kind == "gpu" else self.kind

    def to_dict(self) -> dict:
        return asdict(self)


_GPUS_RE = re.compile(r"^(?:(\d+)\s*[x×*]\s*)?(\d+(?:\.\d+)?)$")


def parse_gpus(spec: str | list[float] | tuple[float, ...]) -> list[Device]:
    """`"16,16,16,8,8"`, `"3x16,2x8"` or a list of GiB sizes -> described GPUs, in that order."""
    sizes: list[float] = []
    if isinstance(spec, str):
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = _GPUS_RE.match(part.lower().removesuffix("gib").removesuffix("gb").strip())
            if not m:
                raise InvalidOption(f"`gpus` {spec!r}: {part!r} is not a size in GiB; write e.g. 16,16,16,8,8 or 3x16,2x8",
                                    option="gpus", value=spec)
            sizes += [float(m.group(2))] * int(m.group(1) or 1)
    else:
        sizes = [float(s) for s in spec]
    if not sizes or any(s <= 0 for s in sizes):
        raise InvalidOption(f"`gpus` {spec!r}: give one or more positive sizes in GiB, e.g. 16,16,16,8,8",
                            option="gpus", value=spec)
    return [Device(name=f"GPU{i}", kind="gpu", total=int(s * GiB), usable=int(s * GiB),
                   bandwidth=DEFAULT_GPU_BANDWIDTH) for i, s in enumerate(sizes)]


def list_profiles() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("ctxq.profiles").iterdir()
                  if p.name.endswith(".toml"))


_PROFILE_KEYS = {"name", "description", "device", "cpu"}
_DEVICE_KEYS = {"name", "memory_gib", "usable_gib", "bandwidth_gbs", "count", "backend", "reserve_gib"}
_CPU_KEYS = {"memory_gib", "bandwidth_gbs"}


def load_profile(name_or_path: str) -> tuple[list[Device], dict]:
    """Devices (in order) and CPU settings from a profile name in profiles/ or a TOML path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        text = path.read_text()
    else:
        f = resources.files("ctxq.profiles") / f"{name_or_path}.toml"
        if not f.is_file():
            raise CtxqError(f"no profile named {name_or_path!r}; choose one of {', '.join(list_profiles())} "
                            "or pass a .toml file")
        text = f.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CtxqError(f"profile {name_or_path}: not valid TOML ({e})") from None
    unknown = set(data) - _PROFILE_KEYS
    if unknown:
        raise CtxqError(f"profile {name_or_path}: unknown keys {sorted(unknown)}; allowed: {sorted(_PROFILE_KEYS)}")
    devices: list[Device] = []
    for d in data.get("device", []):
        unknown = set(d) - _DEVICE_KEYS
        if unknown:
            raise CtxqError(f"profile {name_or_path}: unknown device keys {sorted(unknown)}; allowed: {sorted(_DEVICE_KEYS)}")
        if "memory_gib" not in d:
            raise CtxqError(f"profile {name_or_path}: every [[device]] needs memory_gib")
        count = int(d.get("count", 1))
        for k in range(count):
            total = int(float(d["memory_gib"]) * GiB)
            name = d.get("name", f"GPU{len(devices)}")
            devices.append(Device(
                name=f"{name} #{k + 1}" if count > 1 else name,
                kind="gpu", total=total, usable=int(float(d.get("usable_gib", d["memory_gib"])) * GiB),
                bandwidth=float(d["bandwidth_gbs"]) * 1e9 if "bandwidth_gbs" in d else DEFAULT_GPU_BANDWIDTH,
                backend=str(d.get("backend", "cuda")).lower(),
                reserve=int(float(d["reserve_gib"]) * GiB) if "reserve_gib" in d else None))
    if not devices:
        raise CtxqError(f"profile {name_or_path}: no [[device]] entries")
    cpu = data.get("cpu", {})
    unknown = set(cpu) - _CPU_KEYS
    if unknown:
        raise CtxqError(f"profile {name_or_path}: unknown cpu keys {sorted(unknown)}; allowed: {sorted(_CPU_KEYS)}")
    return devices, cpu


def cpu_device(memory: int | None = None, bandwidth: float | None = None) -> Device:
    """Host RAM: available memory now (psutil) unless given."""
    vm = psutil.virtual_memory()
    return Device(name="CPU", kind="cpu", total=memory or vm.total, usable=memory or vm.available,
                  bandwidth=bandwidth or DEFAULT_CPU_BANDWIDTH)


def detect_gpus() -> list[Device]:
    """GPUs llama.cpp can use in this process, in its order (ggml's device list: RPC, then GPUs).

    Free memory comes from ggml (the CUDA backend asks the driver); `CUDA_VISIBLE_DEVICES`
    is honoured because the CUDA runtime applies it.
    """
    from ..llama import backend

    out = []
    for d in backend.ggml_devices():
        if d.type in ("gpu", "igpu") or d.name.startswith("RPC"):
            rpc = d.name.startswith("RPC")
            endpoint = None
            if rpc:
                m = re.search(r"\[(.+?)\]", d.name)
                endpoint = m.group(1) if m else None
            # ggml names devices after their backend: CUDA0, Vulkan0, ROCm0, Metal, RPC0[host:port]
            out.append(Device(name=d.name, kind="rpc" if rpc else "gpu", total=d.total, usable=d.free,
                              bandwidth=DEFAULT_CPU_BANDWIDTH if rpc else DEFAULT_GPU_BANDWIDTH, endpoint=endpoint,
                              backend="rpc" if rpc else re.match(r"[A-Za-z]*", d.name).group(0).lower() or "gpu"))
    log.debug("detected devices: %s (CUDA_VISIBLE_DEVICES=%s)", [d.name for d in out],
              os.environ.get("CUDA_VISIBLE_DEVICES"))
    return out


def rpc_devices(rpc) -> list[Device]:
    """ggml RPC workers as devices, in the given order: a declared size (HOST:PORT=GiB) is taken as
    given, an undeclared one is asked of the worker."""
    from ..rpc.client import parse_rpc, probe

    out = []
    for i, ep in enumerate(parse_rpc(rpc)):
        free, total = (ep.declared, ep.declared) if ep.declared else probe(ep.endpoint)
        out.append(Device(name=f"RPC{i}[{ep.endpoint}]", kind="rpc", total=total, usable=free, bandwidth=None,
                          endpoint=ep.endpoint))
    return out


def simulated_devices(spec) -> list[Device]:
    """RPC devices of the given GiB sizes (as `gpus` writes them) that no worker stands behind yet."""
    return [Device(name=f"RPC{i}[simulated]", kind="rpc", total=d.total, usable=d.usable, bandwidth=None)
            for i, d in enumerate(parse_gpus(spec))]


def resolve_devices(opts: PlanOptions) -> tuple[list[Device], Device]:
    """(devices in llama.cpp's order, the host) for a plan, once: `simulate`, else `gpus`, else the
    `profile`'s devices, with `rpc` workers first (llama.cpp puts RPC devices first); none of these
    given: the devices llama.cpp sees. Host memory: `cpu_memory`, else the profile's, else available now."""
    cpu_memory, cpu_bw = opts.cpu_memory, None
    devices: list[Device] = []
    if opts.simulate is not None:
        devices = simulated_devices(opts.simulate)
    elif opts.gpus is not None:
        devices = parse_gpus(opts.gpus)
    elif opts.profile is not None:
        devices, cpu_cfg = load_profile(opts.profile)
        cpu_bw = float(cpu_cfg["bandwidth_gbs"]) * 1e9 if "bandwidth_gbs" in cpu_cfg else None
        if cpu_memory is None and "memory_gib" in cpu_cfg:
            cpu_memory = int(float(cpu_cfg["memory_gib"]) * GiB)
    if opts.rpc:
        devices = rpc_devices(opts.rpc) + devices
    elif opts.simulate is None and opts.gpus is None and opts.profile is None:
        devices = detect_gpus()
    return devices, cpu_device(cpu_memory, cpu_bw)
