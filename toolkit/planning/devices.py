"""Devices a plan can use: GPUs that are present, GPUs only described, RPC workers, the CPU.

Sizes are bytes. `--gpus 16,16,16,8,8` and `--gpus 3x16,2x8` describe GPUs in GiB;
a profile (TOML in `profiles/`) describes a box by name (both read by `ctxq.profiles`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace

import psutil

# described devices live in ctxq.profiles (below the RPC workers, which size themselves from them); their names
# are this module's API too
from ..profiles import (DEFAULT_GPU_BANDWIDTH, LINK_LATENCY_NO_P2P, LINK_LATENCY_P2P, Device,  # noqa: F401
                        list_profiles, load_profile, parse_gpus)
from ..units import GiB
from .options import PlanOptions

log = logging.getLogger(__name__)


# CPU RAM bandwidth assumed for the estimate: dual-channel DDR4-3200 (51.2 GB/s), at the
# ~60 % a decode loop reaches.
DEFAULT_CPU_BANDWIDTH = 30e9
# What llama.cpp's GPU kernels reach of a card's peak figures, one pair for every card (few and physical):
# token generation reads the weights at 50-70 % of the peak memory bandwidth (llmfit PR #137's survey of measured
# cards, 2026-03-02), the upper end for llama.cpp's MMVQ; prompt processing runs its matmuls at about 80 % of the
# FP16 tensor rate (llama.cpp PR 7676's and 8062's tables: an RTX 3090 at 3.65k t/s pp512 of Llama 8B Q5_0, 82 % of
# 71 TFLOPS' 4.4k; an RTX 4090 at 10.4k t/s of Q4_0, 89 %). docs/speed-truth.md holds them to published runs.
GPU_BANDWIDTH_SHARE = 0.7
GPU_COMPUTE_SHARE = 0.8
# CPU compute assumed for the speed estimate, per physical core: one AVX2 FMA unit of 8 f32 lanes (16 FLOP per
# cycle, half of the two units recent x86 cores have) at 2.5 GHz. Conservative on purpose: only host layers use it.
CPU_FLOPS_PER_CORE = 16 * 2.5e9

# The link between cards, for the speed estimate. PCIe bandwidth per lane and direction, as NCCL's topology
# model counts it (src/graph/topo.h: PCI_BW 12 GB/s for Gen3 x16; its log shows PCI[24.0] for Gen4 x16,
# NVIDIA/nccl-tests issue 307), doubling with each generation.
PCIE_BYTES_PER_LANE = {3: 12e9 / 16, 4: 24e9 / 16, 5: 48e9 / 16, 6: 96e9 / 16}
# NVLink 3 and 4: 25 GB/s per link and direction (A100: 12 links, 600 GB/s both ways; H100: 18, 900).
NVLINK_BYTES_PER_LINK = 25e9


@dataclass(frozen=True)
class CardFacts:
    """What the speed estimate needs of a known card: memory bandwidth (bytes/s), dense FP16 tensor throughput
    with FP32 accumulate (FLOP/s; llama.cpp's matrix kernels accumulate in FP32), peer-to-peer over PCIe."""

    bandwidth: float
    flops: float
    p2p: bool


# Known NVIDIA cards, matched against the name NVML and ggml report ("NVIDIA GeForce RTX 4090"), longest key
# first. Sources: the NVIDIA Ampere GA102 and Ada Lovelace whitepapers' appendix tables ("Peak FP16 Tensor TFLOPS
# with FP32 Accumulate", dense), the A100 / H100 / H200 / RTX A4000 datasheets (dense = half the sparse figure);
# cards missing from the whitepapers: SMs x boost clock x 512 FLOP per SM and cycle (the GeForce Ampere/Ada rate:
# 165.2e12 / (128 SMs x 2.52 GHz) for the RTX 4090).
KNOWN_CARDS: dict[str, CardFacts] = {
    "RTX 5090": CardFacts(1792e9, 209.5e12, False),  # Blackwell GB202 whitepaper
    "RTX 4090": CardFacts(1008e9, 165.2e12, False),  # Ada whitepaper
    "RTX 4080": CardFacts(716.8e9, 97.5e12, False),  # Ada whitepaper (RTX 4080 16GB)
    "RTX 4060 TI": CardFacts(288e9, 34 * 2.535e9 * 512, False),  # 34 SMs, 2.535 GHz: 44.1 TFLOPS
    "RTX 4060": CardFacts(272e9, 24 * 2.46e9 * 512, False),  # 24 SMs, 2.46 GHz: 30.2 TFLOPS
    "RTX 3090": CardFacts(936e9, 71e12, False),  # GA102 whitepaper
    "RTX 3080": CardFacts(760e9, 59.5e12, False),  # GA102 whitepaper (10 GB)
    "RTX 3060": CardFacts(360e9, 28 * 1.777e9 * 512, False),  # 28 SMs, 1.777 GHz: 25.5 TFLOPS (12 GB)
    "RTX A4000": CardFacts(448e9, 76.7e12, True),  # datasheet: 153.4 TFLOPS with sparsity
    "A100": CardFacts(1555e9, 312e12, True),  # A100 40GB datasheet
    "A100 80GB PCIE": CardFacts(1935e9, 312e12, True),  # A100 datasheet
    "A100-SXM4-80GB": CardFacts(2039e9, 312e12, True),  # A100 datasheet
    "H100 PCIE": CardFacts(2.0e12, 756e12, True),  # H100 datasheet: 1,513 TFLOPS with sparsity
    "H100": CardFacts(3.35e12, 989.5e12, True),  # H100 SXM datasheet: 1,979 TFLOPS with sparsity
    "H100 NVL": CardFacts(3.9e12, 835e12, True),  # H100 datasheet: 1,671 TFLOPS with sparsity
    "H200": CardFacts(4.8e12, 989.5e12, True),  # H200 datasheet
}
# FP16 dense tensor FLOP per SM and cycle with FP32 accumulate, by compute capability, for a card missing from
# KNOWN_CARDS (NVML gives its SMs and clock): the GeForce rate where GeForce and data-centre parts differ.
FLOP_PER_SM_CYCLE = {(7, 0): 1024, (7, 5): 512, (8, 0): 2048, (8, 6): 512, (8, 9): 512, (9, 0): 4096, (12, 0): 512}


# Words after a card's name that make it another card ("RTX 4080 SUPER", "RTX 4090 D", "RTX 3060 Ti").
_VARIANTS = {"TI", "SUPER", "D", "LAPTOP", "MOBILE", "MAX"}


def card_facts(name: str) -> CardFacts | None:
    """KNOWN_CARDS' entry for a card name as NVML or ggml gives it, or None: the longest key found in the name
    as whole words (split at spaces and hyphens) and not followed by a variant word."""
    words = re.split(r"[\s-]+", name.strip().upper())
    best: str | None = None
    for key in KNOWN_CARDS:
        k = re.split(r"[\s-]+", key)
        for i in range(len(words) - len(k) + 1):
            if words[i:i + len(k)] == k and (i + len(k) == len(words) or words[i + len(k)] not in _VARIANTS):
                if best is None or len(key) > len(best):
                    best = key
    return KNOWN_CARDS[best] if best else None


def pcie_bandwidth(gen: int | None, width: int | None) -> float | None:
    """Bytes/s one direction over a PCIe link (NCCL's figures, PCIE_BYTES_PER_LANE), None if unknown."""
    if not gen or not width:
        return None
    per_lane = PCIE_BYTES_PER_LANE.get(gen) or PCIE_BYTES_PER_LANE[max(PCIE_BYTES_PER_LANE)]
    return per_lane * width


def gpu_speed_facts(name: str, nvml=None) -> dict:
    """flops, bandwidth, link_bandwidth and link_latency of a present GPU: the known-card table by name, then
    NVML (`doctor.NvidiaGpu`): its PCIe generation and width (or NVLink links), peer-to-peer, and SMs x clock for a
    card the table lacks. A fact neither gives is left out (the Device keeps its default)."""
    out: dict = {}
    known = card_facts(name)
    if known:
        out.update(flops=known.flops, bandwidth=known.bandwidth)
    if nvml is None:
        return out
    per_sm = FLOP_PER_SM_CYCLE.get(tuple(nvml.compute_capability or ()))
    if not known and per_sm and nvml.sm_count and nvml.sm_clock_hz:
        out["flops"] = nvml.sm_count * nvml.sm_clock_hz * per_sm
    link = nvml.nvlinks * NVLINK_BYTES_PER_LINK if nvml.nvlinks else pcie_bandwidth(nvml.pcie_gen, nvml.pcie_width)
    if link:
        p2p = nvml.p2p if nvml.p2p is not None else bool(nvml.nvlinks) or bool(known and known.p2p)
        out.update(link_bandwidth=link, link_latency=LINK_LATENCY_P2P if p2p else LINK_LATENCY_NO_P2P)
    return out


def default_cpu_flops() -> float:
    """The host's FLOP/s for the speed estimate: physical cores x CPU_FLOPS_PER_CORE (read when used)."""
    return (psutil.cpu_count(logical=False) or os.cpu_count() or 1) * CPU_FLOPS_PER_CORE


def cpu_device(memory: int | None = None, bandwidth: float | None = None, flops: float | None = None,
               pageable: float | None = None) -> Device:
    """Host RAM: available memory now (psutil) unless given; its compute this machine's unless a profile describes
    the host it plans for (`[cpu] tflops`), and its pageable copy rate to a card (`[cpu] pageable_gbs`)."""
    vm = psutil.virtual_memory()
    return Device(name="CPU", kind="cpu", total=memory or vm.total, usable=memory or vm.available,
                  bandwidth=bandwidth or DEFAULT_CPU_BANDWIDTH, flops=flops or default_cpu_flops(),
                  pageable_bandwidth=pageable)


def detect_gpus() -> list[Device]:
    """GPUs llama.cpp can use in this process, in its order (ggml's device list: RPC, then GPUs).

    Free memory comes from ggml (the CUDA backend asks the driver); `CUDA_VISIBLE_DEVICES`
    is honoured because the CUDA runtime applies it.
    """
    from ..llama import backend, doctor

    nvml = doctor.nvidia_gpus()[0]
    out = []
    for d in backend.ggml_devices():
        if d.type in ("gpu", "igpu") or d.name.startswith("RPC"):
            rpc = d.name.startswith("RPC")
            endpoint = None
            if rpc:
                m = re.search(r"\[(.+?)\]", d.name)
                endpoint = m.group(1) if m else None
            # ggml names devices after their backend: CUDA0, Vulkan0, ROCm0, Metal, RPC0[host:port]
            dev = Device(name=d.name, kind="rpc" if rpc else "gpu", total=d.total, usable=d.free,
                         bandwidth=DEFAULT_CPU_BANDWIDTH if rpc else DEFAULT_GPU_BANDWIDTH, endpoint=endpoint,
                         backend="rpc" if rpc else re.match(r"[A-Za-z]*", d.name).group(0).lower() or "gpu")
            if dev.backend == "cuda":
                # NVML's cards in its order, matched by name (CUDA's order may differ; cards of one name share facts)
                same = next((g for g in nvml if g.name == d.description), None)
                if same is not None:
                    nvml.remove(same)
                for k, v in gpu_speed_facts(d.description, same).items():
                    setattr(dev, k, v)
            out.append(dev)
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


def named_card(d: Device) -> Device:
    """A described GPU whose name names a known card (`--gpus 3x16=RTX 4060 Ti`): its bandwidth and FP16 throughput
    from KNOWN_CARDS, and a PCIe 4.0 x16 link (NCCL's figure; no peer-to-peer unless the card has it), where a profile
    would give link_gbs. Any other name: as given (sizes only, so no speed estimate)."""
    if d.name.split(" ", 1)[0] == d.name:  # a size alone (GPU3)
        return d
    known = card_facts(d.name)
    if known is None:
        from ..errors import InvalidOption

        raise InvalidOption(f"`gpus`: {d.name.split(' ', 1)[1]!r} is not a card ctxq knows; name one of "
                            f"{', '.join(KNOWN_CARDS)}, or describe it in a "
                            "--profile (bandwidth_gbs, tflops_f16, link_gbs)", option="gpus", value=d.name)
    return replace(d, bandwidth=known.bandwidth, flops=known.flops, link_bandwidth=pcie_bandwidth(4, 16),
                   link_latency=LINK_LATENCY_P2P if known.p2p else LINK_LATENCY_NO_P2P)


def resolve_devices(opts: PlanOptions) -> tuple[list[Device], Device]:
    """(devices in llama.cpp's order, the host) for a plan, once: `simulate`, else `gpus`, else the
    `profile`'s devices, with `rpc` workers first (llama.cpp puts RPC devices first); none of these
    given: the devices llama.cpp sees. Host memory: `cpu_memory`, else the profile's, else available now."""
    cpu_memory, cpu_bw, cpu_flops, pageable = opts.cpu_memory, None, None, None
    devices: list[Device] = []
    if opts.simulate is not None:
        devices = simulated_devices(opts.simulate)
    elif opts.gpus is not None:
        devices = [named_card(d) for d in parse_gpus(opts.gpus)]
    elif opts.profile is not None:
        devices, cpu_cfg = load_profile(opts.profile)
        cpu_bw = float(cpu_cfg["bandwidth_gbs"]) * 1e9 if "bandwidth_gbs" in cpu_cfg else None
        cpu_flops = float(cpu_cfg["tflops"]) * 1e12 if "tflops" in cpu_cfg else None
        pageable = float(cpu_cfg["pageable_gbs"]) * 1e9 if "pageable_gbs" in cpu_cfg else None
        if cpu_memory is None and "memory_gib" in cpu_cfg:
            cpu_memory = int(float(cpu_cfg["memory_gib"]) * GiB)
    if opts.rpc:
        devices = rpc_devices(opts.rpc) + devices
    elif opts.simulate is None and opts.gpus is None and opts.profile is None:
        devices = detect_gpus()
    return devices, cpu_device(cpu_memory, cpu_bw, cpu_flops, pageable)
