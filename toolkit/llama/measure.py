"""Ask the real llama.cpp what it allocates for a model and context: load, read its log, free.

`measure()` loads a model with the given parameters through llama.cpp's C API (as llama-cpp-python's
`Llama` does), creates a context (which reserves the KV cache and the compute buffers), and returns
what llama.cpp logged. With `dry_run=True` nothing is allocated (`no_alloc`): compute buffers are
still sized, model and KV buffers print 0.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

from . import backend
from ..errors import CtxqError
from ..units import last_error_line

log = logging.getLogger(__name__)


@dataclass
class Measurement:
    allocations: backend.Allocations
    log: list[str]
    model_bytes: int = 0  # llama_model_size: the bytes of every tensor llama.cpp created (a dry run too)


def load_reason(lines: list[str]) -> str:
    """Why llama.cpp refused a model: its loader's "error loading model: ..." line, else the last error."""
    for line in lines:
        if "error loading model: " in line:
            return line.split("error loading model: ", 1)[1].strip()
    return last_error_line(lines)


def measure(model_path: str, *, n_ctx: int, n_gpu_layers: int = 0, tensor_split: list[float] | None = None,
            type_k: str = "f16", type_v: str = "f16", flash_attn: bool = False, n_batch: int = 2048,
            n_ubatch: int = 512, dry_run: bool = False, use_mmap: bool = True,
            swa_full: bool = False, n_seq_max: int = 1, kv_unified: bool = False,
            n_outputs_max: int = 0, cpu_patterns: tuple[str, ...] = ()) -> Measurement:
    """n_seq_max / kv_unified / n_outputs_max: llama_context_params' own (0 outputs: llama.cpp's default,
    n_batch); a parallel plan's (`Plan.context_settings`). cpu_patterns: tensor buffer overrides to the CPU (a
    plan's experts in CPU memory, `Plan.expert_overrides`), as `ctxq.llama.overrides.create_llama` sets them."""
    lc = backend.llama_cpp()
    lc.llama_backend_init()
    from gguf.constants import GGMLQuantizationType as T

    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = n_gpu_layers
    mp.split_mode = lc.LLAMA_SPLIT_MODE_LAYER
    split_arr = None
    if tensor_split:
        split_arr = (ctypes.c_float * len(tensor_split))(*tensor_split)
        mp.tensor_split = split_arr
    overrides = None
    if cpu_patterns:
        from .overrides import TensorOverrides

        overrides = TensorOverrides.build(cpu_patterns)
        mp.tensor_buft_overrides = ctypes.cast(overrides.array, ctypes.c_void_p)
    if dry_run:
        mp.no_alloc = True
        mp.load_mode = lc.LLAMA_LOAD_MODE_NONE  # a dry run aborts with mmap (NOTES)
    else:
        mp.load_mode = lc.LLAMA_LOAD_MODE_MMAP if use_mmap else lc.LLAMA_LOAD_MODE_NONE
    cp = lc.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = n_batch
    cp.n_ubatch = n_ubatch
    cp.n_seq_max = n_seq_max
    cp.kv_unified = kv_unified
    cp.n_outputs_max = n_outputs_max
    cp.type_k = int(T[type_k.upper()])
    cp.type_v = int(T[type_v.upper()])
    cp.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / DISABLED
    cp.offload_kqv = True
    cp.swa_full = swa_full  # llama.cpp's default is a full-size SWA cache; ctxq plans the window
    with backend.capture_log() as lines:
        model = lc.llama_model_load_from_file(str(model_path).encode(), mp)
        if not model:
            e = CtxqError(f"llama.cpp could not load {model_path}: {load_reason(lines)}")
            e.reason = load_reason(lines)
            raise e
        try:
            model_bytes = int(lc.llama_model_size(model))
            ctx = lc.llama_init_from_model(model, cp)
            if not ctx:
                raise CtxqError(f"llama.cpp could not create the context: {last_error_line(lines)}")
            lc.llama_free(ctx)
        finally:
            lc.llama_model_free(model)
    del split_arr, overrides
    return Measurement(backend.parse_allocations(lines), lines, model_bytes)
