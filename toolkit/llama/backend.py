"""The link to llama.cpp through llama-cpp-python: import, log capture, devices, build features.

llama.cpp's own log is captured (never dumped on the user): every line goes to the
`ctxq.llama_cpp` logger at DEBUG, and `capture_log()` collects the lines of one load so that
`parse_allocations()` can read what llama.cpp really allocated.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BuildError
from ..units import MiB

log = logging.getLogger(__name__)
llama_log = logging.getLogger("ctxq.llama_cpp")

_lock = threading.Lock()
_sinks: list[list[str]] = []
_partial = [""]
_callback = None  # keeps the ctypes callback alive for the life of the process


def llama_cpp():
    """The `llama_cpp` module, with ctxq's log callback installed."""
    try:
        import llama_cpp as lc
    except ImportError as e:  # pragma: no cover - setup installs it
        raise BuildError(f"llama-cpp-python is not installed ({e}); run `make setup`") from None
    _install_log_callback(lc)
    _load_backend_modules()
    return lc


def _install_log_callback(lc) -> None:
    global _callback
    if _callback is not None:
        return
    import llama_cpp._logger  # noqa: F401  (it installs its own callback at import; ours replaces it)

    @lc.llama_log_callback
    def _on_log(level, text, user_data):
        s = text.decode("utf-8", errors="replace")
        with _lock:
            buf = _partial[0] + s
            lines = buf.split("\n")
            _partial[0] = lines.pop()
            for line in lines:
                llama_log.debug("%s", line)
                for sink in _sinks:
                    sink.append(line)

    _callback = _on_log
    lc.llama_log_set(_callback, ctypes.c_void_p(0))


@contextmanager
def capture_log():
    """Collect llama.cpp's log lines printed inside the block."""
    llama_cpp()
    lines: list[str] = []
    with _lock:
        _sinks.append(lines)
    try:
        yield lines
    finally:
        with _lock:
            if _partial[0]:
                for sink in _sinks:
                    sink.append(_partial[0])
                _partial[0] = ""
            # by identity: a nested block's list may hold the same lines (list.remove compares by value)
            del _sinks[next(i for i, sink in enumerate(_sinks) if sink is lines)]


# --- what llama.cpp allocated, from its log --------------------------------------------------

# llama_memory_recurrent prints the recurrent state's buffers as "RS buffer" (llama-memory-recurrent.cpp)
_BUF_RE = re.compile(r"^(load_tensors|llama_kv_cache|llama_kv_cache_iswa|llama_memory_recurrent|sched_reserve|"
                     r"llama_context|graph_reserve)\s*:\s+(\S+)\s+(model|KV|RS|compute|output) buffer size =\s+"
                     r"([\d.]+) MiB")
_LAYER_RE = re.compile(r"load_tensors: layer\s+(\d+) assigned to device (\S+?),")


@dataclass
class Allocations:
    """Bytes per buffer name (e.g. "CPU", "RPC0[127.0.0.1:5001]", "CUDA0") as llama.cpp logged them."""

    model: dict[str, int] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    state: dict[str, int] = field(default_factory=dict)  # recurrent state (RS buffers)
    compute: dict[str, int] = field(default_factory=dict)
    output: dict[str, int] = field(default_factory=dict)
    layers: dict[int, str] = field(default_factory=dict)  # layer index -> device name
    printed: dict[str, int] = field(default_factory=dict)  # buffer name -> how many sizes were printed for it

    def total(self, buffer: str) -> int:
        return sum(d.get(buffer, 0) for d in (self.model, self.kv, self.state, self.compute, self.output))


def parse_allocations(lines: list[str]) -> Allocations:
    """Read llama.cpp's buffer-size and layer-assignment log lines (MiB printed with 2 decimals)."""
    a = Allocations()
    kinds = {"model": a.model, "KV": a.kv, "RS": a.state, "compute": a.compute, "output": a.output}
    for line in lines:
        m = _BUF_RE.search(line)
        if m:
            d = kinds[m.group(3)]
            d[m.group(2)] = d.get(m.group(2), 0) + round(float(m.group(4)) * MiB)
            a.printed[m.group(2)] = a.printed.get(m.group(2), 0) + 1
            continue
        m = _LAYER_RE.search(line)
        if m:
            a.layers[int(m.group(1))] = m.group(2)
    return a


# --- build features and devices ---------------------------------------------------------------

def lib_dir() -> Path:
    """llama-cpp-python's lib folder (libllama, libggml*), found without importing the package."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("llama-cpp-python is not installed: run `make setup`")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


# --- a GGML_BACKEND_DL build: backends are modules loaded at run time ------------------------------
# The CUDA wheel (scripts/setup.sh, CTXQ_CUDA=1) is built with GGML_BACKEND_DL, so that a machine
# without the NVIDIA driver still runs: libggml-cuda.so needs libcuda.so.1 and is skipped when it
# cannot load. Such a build registers no backend until its modules are loaded, and llama.cpp's own
# ggml_backend_load_all() searches only the executable's folder and the current one, not the wheel's
# lib folder, so ctxq loads them before anything asks llama.cpp for a device. The plain build (CPU +
# RPC linked in, what CI uses) has its backends registered already and loads nothing here.

# llama.cpp's order (ggml_backend_load_all_from_path): GPUs before RPC before the CPU.
_MODULE_ORDER = ("cuda", "rpc", "cpu")
_modules_lock = threading.Lock()  # not _lock: ggml logs while loading, and the log callback takes _lock
_modules_done = False
module_errors: dict[str, str] = {}  # backend module ("cuda") -> why it did not load


def _load_backend_modules() -> None:
    global _modules_done
    with _modules_lock:
        if _modules_done:
            return
        _modules_done = True
        d = lib_dir()
        g = ctypes.CDLL(str(d / "libggml.so.0"))
        g.ggml_backend_reg_count.restype = ctypes.c_size_t
        if g.ggml_backend_reg_count():  # the plain build: backends linked in
            return
        g.ggml_backend_load.restype = ctypes.c_void_p
        g.ggml_backend_load.argtypes = [ctypes.c_char_p]
        names = [p.name[len("libggml-"):-len(".so")] for p in d.glob("libggml-*.so")]
        names = sorted((n for n in names if n != "base"),
                       key=lambda n: _MODULE_ORDER.index(n) if n in _MODULE_ORDER else -1)
        if "cuda" in names:
            _preload_cuda_libraries()
        for name in names:
            path = d / f"libggml-{name}.so"
            if g.ggml_backend_load(str(path).encode()):
                continue
            try:  # ggml logs the loader's reason at ERROR level; keep it for doctor's one line
                ctypes.CDLL(str(path))
                module_errors[name] = "ggml_backend_init failed"
            except OSError as e:
                module_errors[name] = str(e).replace(f"{path}: ", "")
            log.info("llama.cpp backend %s not loaded: %s", name, module_errors[name])


def _preload_cuda_libraries() -> None:
    """cuBLAS and the CUDA runtime from PyPI's nvidia-* wheels, when installed and the loader cannot
    find them otherwise: libggml-cuda.so's own search path is only its folder ($ORIGIN)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return
    for stem in ("libcudart", "libcublasLt", "libcublas"):  # dependencies first
        for root in spec.submodule_search_locations:
            for f in sorted(Path(root).glob(f"cu*/lib/{stem}.so.*")):
                try:
                    ctypes.CDLL(f.name, mode=ctypes.RTLD_GLOBAL)  # the system's copy, if it has one
                except OSError:
                    try:
                        ctypes.CDLL(str(f), mode=ctypes.RTLD_GLOBAL)
                    except OSError as e:
                        log.info("cannot preload %s: %s", f, e)


def rpc_library_path() -> Path:
    """libggml-rpc: the SONAME file libllama links in the plain build, the module in a BACKEND_DL
    build (the one ggml loaded; a second name would be a second copy with its own state)."""
    d = _lib_dir()
    return next((p for p in (d / "libggml-rpc.so.0", d / "libggml-rpc.so") if p.is_file()), d / "libggml-rpc.so.0")


def cuda_unavailable() -> str | None:
    """One line when this is a CUDA build but ggml lists no CUDA device (no driver, no GPU, an empty
    CUDA_VISIBLE_DEVICES), else None: the run then falls back to the CPU."""
    if not build_features()["cuda"] or any(d.name.startswith("CUDA") for d in ggml_devices()):
        return None
    why = module_errors.get("cuda")
    return "CUDA build, no CUDA device visible" + (f" (libggml-cuda.so: {why})" if why else "")


def _lib_dir() -> Path:
    """`lib_dir()` after llama_cpp has loaded its libraries, so ctypes gets the same copies."""
    llama_cpp()
    return lib_dir()


def _ggml():
    """libggml by its SONAME file: the wheel also holds a second copy (libggml.so) whose registry
    libllama never sees (see shared/NOTES-llama-cpp.md)."""
    lib = ctypes.CDLL(str(_lib_dir() / "libggml.so.0"))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
        fn.restype = ctypes.c_char_p
        fn.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    return lib


_DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass
class GgmlDevice:
    name: str
    description: str
    type: str  # cpu | gpu | igpu | accel | meta
    free: int  # bytes
    total: int  # bytes


def ggml_devices() -> list[GgmlDevice]:
    """ggml's device list in registration order (the CPU is listed too). For a model llama.cpp
    puts RPC devices first, then GPUs (llama_model_load_from_file)."""
    lc = llama_cpp()
    lc.llama_backend_init()
    lib = _ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(GgmlDevice(
            name=(lib.ggml_backend_dev_name(dev) or b"").decode(),
            description=(lib.ggml_backend_dev_description(dev) or b"").decode(),
            type=_DEV_TYPES.get(lib.ggml_backend_dev_type(dev), "unknown"),
            free=free.value, total=total.value))
    return out


def system_info() -> str:
    return llama_cpp().llama_print_system_info().decode(errors="replace").strip()


def build_features() -> dict[str, bool]:
    lc = llama_cpp()
    libs = {p.name for p in _lib_dir().glob("*.so*")}
    info = system_info()
    return {
        "gpu_offload": bool(lc.llama_supports_gpu_offload()),
        "cuda": any(n.startswith("libggml-cuda") for n in libs) or "CUDA" in info,
        "rpc": bool(lc.llama_supports_rpc()) and any(n.startswith("libggml-rpc") for n in libs),
        "amx_int8": "AMX_INT8 = 1" in info,
    }


def require_rpc() -> None:
    if not build_features()["rpc"]:
        raise BuildError("this llama-cpp-python was built without RPC; rebuild with "
                         "`make setup` (it passes CMAKE_ARGS=-DGGML_RPC=ON)")
