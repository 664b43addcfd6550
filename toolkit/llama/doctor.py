"""`ctxq doctor`: what this machine and this build of llama.cpp can do."""

from __future__ import annotations

import importlib.metadata as md
import logging
import platform
from dataclasses import asdict, dataclass, field

import psutil

from ..units import default_threads
from . import backend

log = logging.getLogger(__name__)


@dataclass
class NvidiaGpu:
    index: int
    name: str
    total: int  # bytes
    free: int  # bytes


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
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(NvidiaGpu(i, name.decode() if isinstance(name, bytes) else name, int(mem.total), int(mem.free)))
        return out, None
    finally:
        pynvml.nvmlShutdown()


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
    report = Report(
        ctxq_version=md.version("ctxq"),
        llama_cpp_python_version=md.version("llama_cpp_python"),
        python=platform.python_version(),
        system_info=backend.system_info(),
        features=features,
        ggml_devices=[asdict(d) for d in backend.ggml_devices()],
        nvidia_gpus=gpus,
        nvml_error=nvml_error,
        cpu={"model": _cpu_model(), "physical_cores": psutil.cpu_count(logical=False),
             "logical_cores": psutil.cpu_count(logical=True), "usable_cores": default_threads()},
        ram_total=vm.total,
        ram_available=vm.available,
        cuda_unavailable=backend.cuda_unavailable(),
        module_errors=dict(backend.module_errors),
    )
    if gpus and not features["cuda"]:
        report.warnings.append(f"{len(gpus)} NVIDIA GPU(s) present but this llama-cpp-python has no CUDA: "
                               "rebuild with `CTXQ_CUDA=1 make setup`")
    if not features["rpc"]:
        report.warnings.append("this llama-cpp-python has no RPC (--rpc, --simulate and `ctxq worker` need it): "
                               "rebuild it with `make setup`, or with CMAKE_ARGS=-DGGML_RPC=ON pip install "
                               "--force-reinstall --no-cache-dir llama-cpp-python==0.3.36")
    if features["amx_int8"]:
        report.warnings.append("this build has llama.cpp's AMX kernels, which crash on quantized models "
                               "on some CPUs: rebuild with `make setup` (it builds without them)")
    return report
