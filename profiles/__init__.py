"""Devices as a user describes them: a list of GPU sizes (`--gpus 16,16,16,8,8`, `3x16,2x8`) or a profile (the
TOML files in this folder, or a path), and `Device`, what the planner plans on and what `ctxq.rpc.start_workers`
sizes its workers from. Nothing here asks a device anything: present GPUs and RPC workers are found by
`ctxq.planning.devices`."""

from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from ..errors import CtxqError, InvalidOption
from ..units import GiB

# Decode bandwidth assumed for a described GPU without a stated one (bytes/s): a mid-range
# consumer card (RTX 4060 Ti: 288 GB/s); only used for the labelled tokens/s estimate.
DEFAULT_GPU_BANDWIDTH = 288e9

# One CUDA copy's start-up: 5-7 us per cudaMemcpyAsync measured (DualPath, arXiv 2602.21548, section 5.2).
CUDA_CALL_S = 6e-6
# A step of an exchange between two cards: the copy, then the reduction kernel's launch (2 calls) with
# peer-to-peer; without it the driver stages the copy through host memory, a second DMA start-up (3 calls).
# GeForce cards have peer-to-peer off (RTX 40: disabled by NVIDIA; RTX 30: over an NVLink bridge only).
LINK_LATENCY_P2P = 2 * CUDA_CALL_S
LINK_LATENCY_NO_P2P = 3 * CUDA_CALL_S


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
    # for the speed estimate (planning/speed/model.py); None: unknown, and the estimate says so
    flops: float | None = None  # FLOP/s: dense FP16 tensor throughput with FP32 accumulate
    link_bandwidth: float | None = None  # bytes/s, one direction, to the other cards (PCIe, NVLink)
    link_latency: float | None = None  # seconds per exchange step between cards (see LINK_LATENCY_*)
    # the host only: pageable (mmap'd or malloc'd) host memory to a card, bytes/s; None: a share of the card's link
    # (planning/speed/model.PAGEABLE_SHARE)
    pageable_bandwidth: float | None = None

    def __post_init__(self):
        if not self.backend:
            self.backend = "cuda" if self.kind == "gpu" else self.kind

    def to_dict(self) -> dict:
        return asdict(self)


_GPUS_RE = re.compile(r"^(?:(\d+)\s*[x×*]\s*)?(\d+(?:\.\d+)?)$")


def parse_gpus(spec: str | list[float] | tuple[float, ...]) -> list[Device]:
    """`"16,16,16,8,8"`, `"3x16,2x8"` or a list of GiB sizes -> described GPUs, in that order. A size may name its
    card, `"3x16=RTX 4060 Ti,2x8=RTX 4060"`: the planner then takes its speed facts from the known cards
    (planning.devices.KNOWN_CARDS) without a profile."""
    sizes: list[float] = []
    names: list[str | None] = []
    if isinstance(spec, str):
        for part in filter(None, (p.strip() for p in spec.split(","))):
            part, _, card = part.partition("=")
            m = _GPUS_RE.match(part.strip().lower().removesuffix("gib").removesuffix("gb").strip())
            if not m or (_ and not card.strip()):
                raise InvalidOption(f"`gpus` {spec!r}: {part!r} is not a size in GiB; write e.g. 16,16,16,8,8, 3x16,2x8 "
                                    "or 3x16=RTX 4060 Ti,2x8=RTX 4060", option="gpus", value=spec)
            k = int(m.group(1) or 1)
            sizes += [float(m.group(2))] * k
            names += [card.strip() or None] * k
    else:
        sizes = [float(s) for s in spec]
        names = [None] * len(sizes)
    if not sizes or any(s <= 0 for s in sizes):
        raise InvalidOption(f"`gpus` {spec!r}: give one or more positive sizes in GiB, e.g. 16,16,16,8,8",
                            option="gpus", value=spec)
    return [Device(name=f"GPU{i} {n}" if n else f"GPU{i}", kind="gpu", total=int(s * GiB), usable=int(s * GiB),
                   bandwidth=DEFAULT_GPU_BANDWIDTH) for i, (s, n) in enumerate(zip(sizes, names))]


def list_profiles() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("ctxq.profiles").iterdir()
                  if p.name.endswith(".toml"))


_PROFILE_KEYS = {"name", "description", "device", "cpu"}
_DEVICE_KEYS = {"name", "memory_gib", "usable_gib", "bandwidth_gbs", "count", "backend", "reserve_gib",
                "tflops_f16", "link_gbs", "link_latency_us"}
_CPU_KEYS = {"memory_gib", "bandwidth_gbs", "tflops", "pageable_gbs"}


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
                reserve=int(float(d["reserve_gib"]) * GiB) if "reserve_gib" in d else None,
                flops=float(d["tflops_f16"]) * 1e12 if "tflops_f16" in d else None,
                link_bandwidth=float(d["link_gbs"]) * 1e9 if "link_gbs" in d else None,
                # a link without a stated latency: the slower case, no peer-to-peer
                link_latency=(float(d["link_latency_us"]) * 1e-6 if "link_latency_us" in d
                              else LINK_LATENCY_NO_P2P if "link_gbs" in d else None)))
    if not devices:
        raise CtxqError(f"profile {name_or_path}: no [[device]] entries")
    cpu = data.get("cpu", {})
    unknown = set(cpu) - _CPU_KEYS
    if unknown:
        raise CtxqError(f"profile {name_or_path}: unknown cpu keys {sorted(unknown)}; allowed: {sorted(_CPU_KEYS)}")
    return devices, cpu
