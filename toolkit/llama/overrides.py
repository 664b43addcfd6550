"""Tensor buffer-type overrides: the one place ctxq hands `llama_model_params.tensor_buft_overrides`
to llama.cpp (expert weights of a mixture-of-experts model kept in CPU memory).

llama-cpp-python 0.3.36 declares the field (`c_void_p  # NOTE: unused`) but takes no keyword for it,
and `Llama.__init__` fills its `llama_model_params` and loads the model in one go. `create_llama`
therefore sets the field on the params struct at the moment llama.cpp receives it: a pass-through
wrapper of `llama_cpp.llama_cpp.llama_model_load_from_file` (installed once; the function `_internals.
LlamaModel` calls) adds the array only for the thread inside `create_llama`, and only for its first
load. Whatever else `Llama` puts in the struct is left as it is. The array and its strings live as
long as the `Llama` (`llm.ctxq_overrides`), and the load's own log proves each pattern was applied.

The patterns are llama.cpp's own (common/common.h): `blk\\.N\\.ffn_(up|down|gate|gate_up)_(ch|)exps`,
what `--n-cpu-moe N` adds for each layer below N. They match the stacked expert tensors only, never the
router `ffn_gate_inp` or the shared experts `ffn_*_shexp`.
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..errors import BuildError, CtxqError, InvalidOption
from . import backend

# common/common.h LLM_FFN_EXPS_REGEX and llm_ffn_block_regex(idx, ...) = "blk\\.%d" + LLM_FFN_EXPS_REGEX
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)" + FFN_EXPS_REGEX)
# llama-model-loader.cpp (check overrides): logged at DEBUG for every tensor a pattern matched
_OVERRIDDEN = re.compile(r"tensor (\S+) \(\d+ MiB \S+\) buffer type overridden to (\S+)")
_GGML_BACKEND_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type (ggml-backend.h)


def expert_pattern(layer: int) -> str:
    """The regex llama.cpp's `--n-cpu-moe` uses for layer `layer`'s expert tensors."""
    return f"blk\\.{layer}{FFN_EXPS_REGEX}"


def experts_pattern(layers: Iterable[int]) -> str:
    """One regex for the expert tensors of several layers (for layers 1, 3 and 5: blk, a dot, (1|3|5), then the
    expert suffix): what a llama.cpp user types as one `-ot` pattern instead of one per layer. The dot after the
    group keeps layer 1 from matching layer 13."""
    layers = list(layers)
    if len(layers) == 1:
        return expert_pattern(layers[0])
    return f"blk\\.({'|'.join(map(str, layers))}){FFN_EXPS_REGEX}"


# A layer's dense FFN or a MoE's shared experts (gguf.info.FFN_RE): the weights a plan keeps in host memory when the
# cards cannot hold them all, the layer's attention and KV cache staying on its card. The dot after the name keeps
# ffn_gate from matching ffn_gate_inp (the router) or ffn_gate_inp_shexp (the shared experts' gate), and ffn_up from
# matching ffn_up_exps (the routed experts: expert_pattern's).
FFN_REGEX = r"\.ffn_(up|down|gate|gate_up)\."
SHARED_FFN_REGEX = r"\.ffn_(up|down|gate|gate_up)(_shexp|)\."


def ffn_pattern(layers: Iterable[int], shared: bool = False) -> str:
    r"""One regex for the dense FFN tensors (weights and biases) of `layers`: `blk\.(3|4|5)\.ffn_(up|down|gate|
    gate_up)\.`, what a llama.cpp user types as `-ot PATTERN=CPU`; `shared`: a MoE's shared experts' too
    (`ffn_up_shexp`, ...)."""
    layers = list(layers)
    group = str(layers[0]) if len(layers) == 1 else f"({'|'.join(map(str, layers))})"
    return f"blk\\.{group}{SHARED_FFN_REGEX if shared else FFN_REGEX}"


def expert_layers(tensor_names: Iterable[str]) -> list[int]:
    """The layers that hold expert tensors (the names llama.cpp's expert regex matches), in order."""
    return sorted({int(m.group(1)) for n in tensor_names if (m := _EXPERT_TENSOR.match(n))})


class _Override(ctypes.Structure):
    """struct llama_model_tensor_buft_override (include/llama.h); llama_cpp.py does not define it."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass
class TensorOverrides:
    """A NULL-terminated `llama_model_tensor_buft_override` array for `entries`, in order (llama.cpp takes a
    tensor's first match), and what llama.cpp did with it: tensor name -> the buffer type it logged. An entry is a
    regex (to the CPU: ctxq's own patterns) or llama.cpp's -ot form PATTERN=BUFFER (the user's, `Plan.override_tensor`)."""

    patterns: list[str]
    array: ctypes.Array = field(repr=False)
    overridden: dict[str, str] = field(default_factory=dict)

    @classmethod
    def build(cls, entries: Sequence[str]) -> TensorOverrides:
        lc = backend.llama_cpp()
        limit = lc.llama_max_tensor_buft_overrides()
        if len(entries) >= limit:  # one slot is the terminator
            raise InvalidOption(f"{len(entries)} tensor overrides; llama.cpp takes at most {limit - 1}",
                                value=len(entries), limit=limit - 1)
        array = (_Override * (len(entries) + 1))()  # zeroed: the last entry is the {NULL, NULL} terminator
        patterns = []
        for i, entry in enumerate(entries):
            pattern, eq, buffer = entry.partition("=")  # common/arg.cpp splits at the first '='
            array[i].pattern = pattern.encode()  # the Structure keeps the bytes alive with the array
            array[i].buft = buffer_type(buffer) if eq else cpu_buffer_type()
            patterns.append(pattern)
        return cls(patterns, array)

    to_cpu = build  # the name its callers knew when every entry went to the CPU

    def unapplied(self) -> list[str]:
        """Patterns that matched no tensor of the load (Python's re and std::regex agree on these)."""
        return [p for p in self.patterns if not any(re.search(p, name) for name in self.overridden)]


def cpu_buffer_type() -> int:
    """The CPU device's buffer type from ggml's device API: the pointer llama.cpp compares with
    `ggml_backend_cpu_buffer_type()` to keep the CPU's extra (repacked) types in play
    (llama_model_loader::create_tensor). libggml by its SONAME file, as libllama loads it."""
    backend.llama_cpp()  # loads libllama and with it the libggml copies ctypes must share
    lib = ctypes.CDLL(str(backend.lib_dir() / "libggml.so.0"))
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    dev = lib.ggml_backend_dev_by_type(_GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise BuildError("ggml has no CPU device; reinstall llama-cpp-python with `make setup`")
    return lib.ggml_backend_dev_buffer_type(dev)


def _ggml():
    """libggml by its SONAME file, as libllama loads it (NOTES), with the device API's signatures."""
    backend.llama_cpp()  # loads libllama and with it the libggml copies ctypes must share
    lib = ctypes.CDLL(str(backend.lib_dir() / "libggml.so.0"))
    for name, res, args in (("ggml_backend_dev_count", ctypes.c_size_t, []),
                            ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
                            ("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p]),
                            ("ggml_backend_dev_description", ctypes.c_char_p, [ctypes.c_void_p]),
                            ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p]),
                            ("ggml_backend_dev_buffer_type", ctypes.c_void_p, [ctypes.c_void_p]),
                            ("ggml_backend_buft_name", ctypes.c_char_p, [ctypes.c_void_p])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def buffer_type(name: str) -> int:
    """The buffer type a -ot BUFFER names, as llama.cpp's parse_tensor_buffer_overrides finds it (common/arg.cpp:
    each device's `ggml_backend_dev_buffer_type`, by `ggml_backend_buft_name`: CPU, CUDA0, RPC0[host:port]), or by
    the plan's name for a device: RPCi[host:port] (the worker at that endpoint, else the i-th RPC device: the split
    referee's dry run has workers of its own), GPUi / CUDAi (the i-th GPU, else the i-th non-CPU device).
    InvalidOption naming the buffers there are."""
    if name == "CPU":
        return cpu_buffer_type()
    lib = _ggml()
    devs = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    devs = [d for d in devs if lib.ggml_backend_dev_type(d) != _GGML_BACKEND_DEVICE_TYPE_CPU]
    bufts = [lib.ggml_backend_dev_buffer_type(d) for d in devs]
    named = [(lib.ggml_backend_buft_name(b).decode(), lib.ggml_backend_dev_name(d).decode(),
              (lib.ggml_backend_dev_description(d) or b"").decode()) for d, b in zip(devs, bufts)]
    for i, (buft, dev, desc) in enumerate(named):
        if name in (buft, dev):
            return bufts[i]
    m = re.fullmatch(r"RPC(\d+)\[(.+)\]", name)
    if m:  # an RPC device's description is its endpoint (ggml-rpc.cpp ggml_backend_rpc_add_server)
        rpc = [i for i, (_, dev, _) in enumerate(named) if dev.startswith("RPC")]
        hit = next((i for i in rpc if named[i][2] == m.group(2)), None)
        if hit is None and int(m.group(1)) < len(rpc):
            hit = rpc[int(m.group(1))]
        if hit is not None:
            return bufts[hit]
    m = re.fullmatch(r"(?:GPU|CUDA)(\d+)", name)
    if m:
        gpus = [i for i, d in enumerate(devs) if not named[i][1].startswith("RPC")] or list(range(len(devs)))
        if int(m.group(1)) < len(gpus):
            return bufts[gpus[int(m.group(1))]]
    raise InvalidOption(f"-ot buffer {name!r} is not a device llama.cpp sees here; use one of "
                        f"{', '.join(['CPU'] + [b for b, _, _ in named])}", option="override_tensor", value=name)


_pending = threading.local()  # the array create_llama hands to its own thread's next model load
_install_lock = threading.Lock()
_installed = [False]


def _install(lc) -> None:
    """Wrap llama_model_load_from_file once; it passes every call through, adding the thread's array."""
    if "tensor_buft_overrides" not in dict(lc.llama_model_params._fields_):
        raise BuildError("this llama-cpp-python's llama_model_params has no tensor_buft_overrides field; "
                         "install the version pyproject.toml names (`make setup`)")
    with _install_lock:
        if _installed[0]:
            return
        original = lc.llama_model_load_from_file

        def llama_model_load_from_file(path_model, params):
            array = getattr(_pending, "array", None)
            if array is not None:
                _pending.array = None  # this load only (not a draft model or a later vocab-only load)
                params.tensor_buft_overrides = ctypes.cast(array, ctypes.c_void_p)
            return original(path_model, params)

        lc.llama_model_load_from_file = llama_model_load_from_file
        _installed[0] = True


def create_llama(model_path: str, llama_kwargs: dict, cpu_patterns: Sequence[str] = ()):
    """`llama_cpp.Llama(model_path, **llama_kwargs)` with the tensors matching `cpu_patterns` (llama.cpp
    regexes, to CPU memory, or PATTERN=BUFFER entries: TensorOverrides.build) where they say. Without patterns it is the plain call. The overrides stay alive on the
    model as `llm.ctxq_overrides` (None without patterns). Raises CtxqError if llama.cpp's log does not
    show every pattern applied; llama-cpp-python's ValueError for a failed load passes through."""
    lc = backend.llama_cpp()
    if not cpu_patterns:
        llm = lc.Llama(model_path, **llama_kwargs)
        llm.ctxq_overrides = None
        return llm
    from llama_cpp import llama_cpp as low

    _install(low)
    ov = TensorOverrides.build(cpu_patterns)
    _pending.array = ov.array
    try:
        with backend.capture_log() as lines:
            llm = lc.Llama(model_path, **llama_kwargs)
    finally:
        _pending.array = None
    ov.overridden = {m.group(1): m.group(2) for line in lines if (m := _OVERRIDDEN.search(line))}
    llm.ctxq_overrides = ov  # tensor_buft_overrides points into ov.array: it lives as long as the model
    missing = ov.unapplied()
    if missing:
        llm.close()
        raise CtxqError(f"llama.cpp did not apply the tensor override {missing[0]!r} ({len(missing)} of "
                        f"{len(ov.patterns)} matched nothing); this llama-cpp-python may not pass "
                        "tensor_buft_overrides on")
    return llm
