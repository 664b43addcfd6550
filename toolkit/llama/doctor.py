"""`ctxq doctor`: what this machine and this build of llama.cpp can do."""

from __future__ import annotations

import importlib.metadata as md
import logging
import platform
from dataclasses import asdict, dataclass, field

import psutil

from ..units import default_threads
from . import backend
from .cuda_comm import CudaComm, cuda_comm

log = logging.getLogger(__name__)


@dataclass
class NvidiaGpu:
    index: int
    name: str
    total: int  # bytes
    free: int  # bytes
    # for the speed estimate (planning/devices.py); None where NVML did not say
    pcie_gen: int | None = None  # the highest PCIe generation this card and its slot can run
    pcie_width: int | None = None  # lanes at that generation
    nvlinks: int = 0  # NVLink links up
    p2p: bool | None = None  # peer-to-peer reads to every other card (NVML's P2P status)
    sm_count: int | None = None
    sm_clock_hz: float | None = None  # the SMs' highest clock
    compute_capability: tuple[int, int] | None = None
    # each other card: {"index", "p2p_read", "p2p_write" (NVML's P2P status, e.g. "ok", "chipset not
    # supported"), "topology" (nvidia-smi topo's words: PIX, PXB, PHB, NODE, SYS, or "same board")}
    peers: list[dict] = field(default_factory=list)


@dataclass
class Report:
    ctxq_version: str
    llama_cpp_python_version: str
    python: str
    system_info: str
    features: dict[str, bool]
    ggml_devices: list[dict]
    nvidia_gpus: list[NvidiaGpu]
    nvml_error: str | None
    cpu: dict
    ram_total: int  # bytes
    ram_available: int  # bytes
    # "CUDA build, no CUDA device visible (…)" when a CUDA build finds no CUDA device; None otherwise
    cuda_unavailable: str | None = None
    module_errors: dict[str, str] = field(default_factory=dict)  # backend module -> why it did not load
    cuda_comm: CudaComm | None = None  # NCCL, GGML_CUDA_ALLREDUCE and GGML_CUDA_P2P (ctxq.llama.cuda_comm)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def nvidia_gpus() -> tuple[list[NvidiaGpu], str | None]:
    """GPUs from NVML (nvidia-ml-py), honouring CUDA_VISIBLE_DEVICES only as the driver does not."""
    try:
        import pynvml
    except ImportError as e:
        return [], f"nvidia-ml-py is not installed ({e})"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver: the normal case on a CPU machine
        return [], f"NVML unavailable ({e})"
    try:
        out = []
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        for i, h in enumerate(handles):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(NvidiaGpu(i, name.decode() if isinstance(name, bytes) else name, int(mem.total), int(mem.free),
                                 **link_facts(pynvml, h, [o for o in handles if o is not h]),
                                 peers=[{"index": j, **peer_facts(pynvml, h, o)}
                                        for j, o in enumerate(handles) if o is not h]))
        return out, None
    finally:
        pynvml.nvmlShutdown()


def _ask(f, *args):
    try:
        return f(*args)
    except Exception:  # NVMLError_NotSupported and friends, or a function this nvidia-ml-py lacks
        return None


def link_facts(nvml, h, others: list) -> dict:
    """PCIe, NVLink, peer-to-peer, SMs and clock of one card, each None (nvlinks 0) where NVML cannot say:
    an older driver or card lacks some of these queries."""
    nvlinks = 0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0)):
        state = _ask(nvml.nvmlDeviceGetNvLinkState, h, link)
        if state is None:
            break
        nvlinks += state == nvml.NVML_FEATURE_ENABLED
    p2p = [_ask(nvml.nvmlDeviceGetP2PStatus, h, o, nvml.NVML_P2P_CAPS_INDEX_READ) for o in others]
    attrs = _ask(nvml.nvmlDeviceGetAttributes, h)
    clock = _ask(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_SM)  # MHz
    cc = _ask(nvml.nvmlDeviceGetCudaComputeCapability, h)
    return dict(pcie_gen=_ask(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width=_ask(nvml.nvmlDeviceGetMaxPcieLinkWidth, h), nvlinks=nvlinks,
                p2p=None if not others or None in p2p else all(s == nvml.NVML_P2P_STATUS_OK for s in p2p),
                sm_count=getattr(attrs, "multiprocessorCount", None), sm_clock_hz=clock * 1e6 if clock else None,
                compute_capability=tuple(cc) if cc else None)


# nvmlGpuP2PStatus_t and nvmlGpuTopologyLevel_t (nvml.h), the latter in `nvidia-smi topo -m`'s words
_P2P_WORDS = {"OK": "ok", "CHIPSET_NOT_SUPPORTED": "chipset not supported", "GPU_NOT_SUPPORTED": "card not supported",
              "IOH_TOPOLOGY_NOT_SUPPORTED": "topology not supported", "DISABLED_BY_REGKEY": "disabled by regkey",
              "NOT_SUPPORTED": "not supported", "UNKNOWN": "unknown"}
_TOPO_WORDS = {"INTERNAL": "same board", "SINGLE": "PIX", "MULTIPLE": "PXB", "HOSTBRIDGE": "PHB", "NODE": "NODE",
               "SYSTEM": "SYS"}


def peer_facts(nvml, h, other) -> dict:
    """Peer-to-peer read and write status and the PCIe topology between two cards, None where NVML cannot say."""
    def word(table: dict, prefix: str, value):
        if value is None:
            return None
        return next((w for k, w in table.items() if getattr(nvml, prefix + k, object()) == value), str(value))

    caps = {"p2p_read": "NVML_P2P_CAPS_INDEX_READ", "p2p_write": "NVML_P2P_CAPS_INDEX_WRITE"}
    out = {k: word(_P2P_WORDS, "NVML_P2P_STATUS_", _ask(nvml.nvmlDeviceGetP2PStatus, h, other, getattr(nvml, c, None)))
           for k, c in caps.items()}
    topo = _ask(getattr(nvml, "nvmlDeviceGetTopologyCommonAncestor", None), h, other)
    out["topology"] = word(_TOPO_WORDS, "NVML_TOPOLOGY_", topo)
    return out


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def doctor() -> Report:
    vm = psutil.virtual_memory()
    gpus, nvml_error = nvidia_gpus()
    features = backend.build_features()
    devices = backend.ggml_devices()
    n_cuda = sum(d.name.startswith("CUDA") for d in devices)
    report = Report(
        ctxq_version=md.version("ctxq"),
        llama_cpp_python_version=md.version("llama_cpp_python"),
        python=platform.python_version(),
        system_info=backend.system_info(),
        features=features,
        ggml_devices=[asdict(d) for d in devices],
        nvidia_gpus=gpus,
        nvml_error=nvml_error,
        cpu={"model": _cpu_model(), "physical_cores": psutil.cpu_count(logical=False),
             "logical_cores": psutil.cpu_count(logical=True), "usable_cores": default_threads()},
        ram_total=vm.total,
        ram_available=vm.available,
        cuda_unavailable=backend.cuda_unavailable(),
        module_errors=dict(backend.module_errors),
        cuda_comm=cuda_comm(backend.lib_dir(), n_cuda or len(gpus) or None),
    )
    if gpus and not features["cuda"]:
        report.warnings.append(f"{len(gpus)} NVIDIA GPU(s) present but this llama-cpp-python has no CUDA: "
                               "rebuild with `CTXQ_CUDA=1 make setup`")
    if not features["rpc"]:
        report.warnings.append("this llama-cpp-python has no RPC (--rpc, --simulate and `ctxq worker` need it): "
                               "rebuild it with `make setup`, or with CMAKE_ARGS=-DGGML_RPC=ON pip install "
                               "--force-reinstall --no-cache-dir llama-cpp-python==0.3.36")
    comm = report.cuda_comm
    if comm.nccl_found is False:
        report.warnings.append(f"llama.cpp's CUDA backend needs {comm.nccl_soname}, which the loader does not find: "
                               "add NCCL's lib folder to LD_LIBRARY_PATH")
    elif comm.library and not comm.nccl and len(gpus) > 1:
        report.warnings.append(f"{len(gpus)} NVIDIA GPUs but llama.cpp's CUDA backend has no NCCL: tensor split "
                               "mode all-reduces without it; install NCCL and rebuild with `CTXQ_CUDA=1 make setup`")
    if features["amx_int8"]:
        report.warnings.append("this build has llama.cpp's AMX kernels, which crash on quantized models "
                               "on some CPUs: rebuild with `make setup` (it builds without them)")
    return report
