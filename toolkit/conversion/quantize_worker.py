"""The child process that runs llama.cpp's quantizer. The parent's side is
`ctxq.conversion.quantize_process.Worker`.

llama.cpp can abort the whole process (GGML_ABORT) and `llama_model_quantize` cannot be interrupted
from Python, so ctxq runs it here and the parent only watches. The worker

1. quantizes `src` into `out` with `llama_model_quantize`, its log going raw to stderr (the parent
   reads the `[ i/ N]` tensor lines for progress);
2. has llama.cpp load `out` (`verify`): metadata, vocabulary, every tensor's shape, type and file
   bounds, without reading the weights (a dry run, `no_alloc`);
3. optionally runs the quality gate (`ctxq.conversion.quality.compare`) against `reference`;
4. writes a JSON result to `result` (never to stdout, where C code may print).

It exits 0 on success, 2 with {"error": ...} in the result when llama.cpp refused the job, and
dies with the parent (its lifeline, `ctxq.children`, and PR_SET_PDEATHSIG), so a killed `ctxq` leaves no quantizer
running.

Its start-up is on the critical path of every quantization, so a plain job (no quality gate, no
imatrix) runs lean: `python -I -S quantize_worker.py --lean --lib DIR` imports only the standard
library modules below and binds the few llama.cpp functions it calls itself with ctypes (45 ms to
a ready worker against 220 ms through llama-cpp-python's bindings). The structures mirror
include/llama.h; tests/test_quantize.py checks them field by field against llama-cpp-python's.
Jobs with a quality gate or an imatrix run as `python -m ctxq.conversion.quantize_worker` with everything.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LOAD_MODE_NONE = 0  # enum llama_load_mode: read with plain file I/O (a dry run aborts with mmap)

c_bool, c_int, c_int32, c_void_p = ctypes.c_bool, ctypes.c_int, ctypes.c_int32, ctypes.c_void_p


class QuantizeParams(ctypes.Structure):
    """struct llama_model_quantize_params (include/llama.h)."""

    _fields_ = [
        ("nthread", c_int32), ("ftype", c_int), ("output_tensor_type", c_int), ("token_embedding_type", c_int),
        ("allow_requantize", c_bool), ("quantize_output_tensor", c_bool), ("only_copy", c_bool), ("pure", c_bool),
        ("keep_split", c_bool), ("dry_run", c_bool),
        ("imatrix", c_void_p), ("kv_overrides", c_void_p), ("tt_overrides", c_void_p), ("prune_layers", c_void_p),
        ("max_buf_size", ctypes.c_size_t),
    ]


class TensorOverride(ctypes.Structure):
    """struct llama_model_tensor_override (include/llama.h): a regex and the ggml type for tensors it matches."""

    _fields_ = [("pattern", ctypes.c_char_p), ("type", c_int)]


class ModelParams(ctypes.Structure):
    """struct llama_model_params (include/llama.h)."""

    _fields_ = [
        ("devices", c_void_p), ("tensor_buft_overrides", c_void_p), ("n_gpu_layers", c_int32),
        ("split_mode", c_int), ("load_mode", c_int), ("lazy_mode", c_int), ("main_gpu", c_int32),
        ("tensor_split", c_void_p), ("progress_callback", c_void_p), ("progress_callback_user_data", c_void_p),
        ("kv_overrides", c_void_p), ("vocab_only", c_bool), ("check_tensors", c_bool),
        ("use_extra_bufts", c_bool), ("no_host", c_bool), ("no_alloc", c_bool), ("load_mtp", c_bool),
    ]


LogCallback = ctypes.CFUNCTYPE(None, c_int, ctypes.c_char_p, c_void_p)


def library_file(lib_dir: str) -> str:
    """libllama in llama-cpp-python's lib folder (the file its own bindings load)."""
    names = {"darwin": "libllama.dylib", "win32": "llama.dll"}
    return os.path.join(lib_dir, names.get(sys.platform, "libllama.so"))


def bind(lib_dir: str):
    """libllama with the argument and result types of the functions the worker calls."""
    lib = ctypes.CDLL(library_file(lib_dir))
    lib.llama_model_quantize_default_params.restype = QuantizeParams
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(QuantizeParams)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    lib.llama_model_default_params.restype = ModelParams
    lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, ModelParams]
    lib.llama_model_load_from_file.restype = c_void_p
    lib.llama_model_free.argtypes = [c_void_p]
    lib.llama_model_n_params.argtypes = [c_void_p]
    lib.llama_model_n_params.restype = ctypes.c_uint64
    lib.llama_log_set.argtypes = [LogCallback, c_void_p]
    return lib


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)
    _sibling("children").watch_parent()  # PR_SET_PDEATHSIG follows the spawning thread; the lifeline the process


def _sibling(name: str):
    """A standard-library-only module of ctxq (`children`, `stages`) loaded by its path: a lean worker runs with
    `-I -S` and imports nothing of ctxq."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_ctxq_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_imatrix(path: str) -> tuple[dict[str, "object"], dict]:
    """A GGUF imatrix as llama.cpp's quantize tool reads it (tools/quantize/quantize.cpp,
    load_imatrix): per tensor, `in_sum2 / counts` per expert, 1.0 where a count is 0."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.name.endswith(".in_sum2"):
            sums[t.name[: -len(".in_sum2")]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
        elif t.name.endswith(".counts"):
            counts[t.name[: -len(".counts")]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    data = {}
    for name, s in sums.items():
        c = np.rint(counts[name])  # llama.cpp rounds counts to integers (std::lround)
        per = s.reshape(len(c), -1)
        data[name] = np.where(c[:, None] > 0, per / np.where(c > 0, c, 1)[:, None], 1.0).astype(np.float32).reshape(-1)
    field = reader.fields.get("imatrix.datasets")
    meta = {
        "datasets": list(field.contents()) if field else [],
        "chunk_count": int(reader.fields["imatrix.chunk_count"].contents()) if "imatrix.chunk_count" in reader.fields else 0,
    }
    return data, meta


def _imatrix_params(p: QuantizeParams, path: str, keep: list) -> None:
    """Point `p` at the importance matrix in `path` and at the provenance keys llama.cpp's quantize
    tool writes with it. The arrays use llama-cpp-python's structures (a full worker has them)."""
    import llama_cpp.llama_cpp as lc

    data, meta = load_imatrix(path)
    entries = (lc.llama_model_imatrix_data * (len(data) + 1))()  # NULL-name terminated
    for i, (name, arr) in enumerate(data.items()):
        keep.append((name.encode(), arr))
        entries[i].name = keep[-1][0]
        entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = arr.size
    keep.append(entries)
    p.imatrix = ctypes.cast(entries, c_void_p)
    kvs = [("quantize.imatrix.file", path), ("quantize.imatrix.entries_count", len(data))]
    if meta["datasets"]:
        kvs.append(("quantize.imatrix.dataset", meta["datasets"][0]))
    if meta["chunk_count"] > 0:
        kvs.append(("quantize.imatrix.chunks_count", meta["chunk_count"]))
    overrides = (lc.llama_model_kv_override * (len(kvs) + 1))()  # empty-key terminated
    for o, (key, value) in zip(overrides, kvs):
        o.key = key.encode()
        if isinstance(value, int):
            o.tag, o.value.val_i64 = lc.LLAMA_KV_OVERRIDE_TYPE_INT, value
        else:
            o.tag, o.value.val_str = lc.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()[:127]
    keep.append(overrides)
    p.kv_overrides = ctypes.cast(overrides, c_void_p)


def build_params(lib, job: dict) -> tuple[QuantizeParams, list]:
    """`llama_model_quantize_params` for a job; returns (params, objects to keep alive)."""
    p = lib.llama_model_quantize_default_params()
    p.ftype = job["ftype"]
    p.nthread = job.get("nthread") or 0  # 0: std::thread::hardware_concurrency(), as the tool does
    p.allow_requantize = bool(job.get("allow_requantize"))
    p.quantize_output_tensor = not job.get("leave_output_tensor")
    p.only_copy = bool(job.get("only_copy"))
    p.pure = bool(job.get("pure"))
    if job.get("output_tensor_type") is not None:
        p.output_tensor_type = job["output_tensor_type"]
    if job.get("token_embedding_type") is not None:
        p.token_embedding_type = job["token_embedding_type"]
    p.dry_run = bool(job.get("dry_run"))
    keep: list = []
    if job.get("imatrix"):
        _imatrix_params(p, job["imatrix"], keep)
    if job.get("tensor_types"):  # [[regex, ggml type], ...]: llama.cpp's --tensor-type
        entries = (TensorOverride * (len(job["tensor_types"]) + 1))()  # NULL-pattern terminated
        for e, (pattern, ggml) in zip(entries, job["tensor_types"]):
            keep.append(pattern.encode())
            e.pattern, e.type = keep[-1], ggml
        keep.append(entries)
        p.tt_overrides = ctypes.cast(entries, c_void_p)
    return p, keep


def verify(lib, path: str, free: bool = True) -> int:
    """Have llama.cpp load the model without its weights; return its parameter count.

    The loader still parses the whole header, builds the vocabulary, checks every tensor's name,
    shape and type against the architecture and its data against the file's bounds, and picks a
    buffer type that supports it: what could fail in a real load, short of reading the weights."""
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = False
    mp.no_alloc = True
    mp.load_mode = LOAD_MODE_NONE
    model = lib.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load the quantized file {path}")
    try:
        return int(lib.llama_model_n_params(model))
    finally:
        if free:
            lib.llama_model_free(model)


def run(lib, job: dict) -> dict:
    if job.get("check_only"):  # a cached file that has not been through the quality gate yet
        from ctxq.conversion.quality import compare

        return {"quality": compare(job["reference"], job["out"], cache_dir=job.get("logits_cache"),
                         reference_id=job.get("reference_id"))}
    params, keep = build_params(lib, job)
    t0 = time.perf_counter()
    rc = lib.llama_model_quantize(job["src"].encode(), job["out"].encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    if rc != 0:
        return {"error": "llama_model_quantize failed", "rc": int(rc)}
    result = {"quantize_seconds": seconds}
    if job.get("dry_run"):  # nothing written: the types are in the log the parent keeps
        return result
    if job.get("reference"):  # the quality gate loads the result: that is the load check too
        from ctxq.conversion.quality import compare

        result["quality"] = compare(job["reference"], job["out"], cache_dir=job.get("logits_cache"),
                         reference_id=job.get("reference_id"))
    else:
        t0 = time.perf_counter()
        # Not freed: the worker exits next, and freeing SmolLM2's vocabulary alone takes 35 ms.
        result["n_params"] = verify(lib, job["out"], free=False)
        result["verify_seconds"] = time.perf_counter() - t0
    return result


def main(argv: list[str]) -> int:
    _die_with_parent()
    # Loaded before the job arrives, while the parent prepares it.
    if "--lean" not in argv:
        import llama_cpp  # noqa: F401  (the quality gate's `Llama`; it sets a log callback, replaced below)
    lib = bind(argv[argv.index("--lib") + 1])

    stop_at_first_tensor = os.environ.get("CTXQ_TEST_STAGE", "").startswith("quantize:")  # tests (ctxq.stages)

    @LogCallback
    def on_log(level, text, user_data):
        os.write(2, text)
        if stop_at_first_tensor and text.lstrip().startswith(b"[") and text.lstrip()[1:].lstrip().startswith(b"1/"):
            _sibling("stages").reached("quantize")  # inside llama_model_quantize, its first tensor under way

    lib.llama_log_set(on_log, None)
    lib.llama_backend_init()
    ready = time.time()
    text = sys.stdin.read()
    if not text:  # the parent changed its mind
        return 0
    job = json.loads(text)
    waited = time.time() - ready
    try:
        result = run(lib, job)
    except Exception as e:  # reported to the parent as one line
        result = {"error": f"{type(e).__name__}: {e}"}
    result["waited_for_job_seconds"] = waited  # > 0: starting the worker early hid its start-up
    part = job["result"] + ".part"
    with open(part, "w") as f:
        f.write(json.dumps(result))
    os.replace(part, job["result"])
    return 2 if "error" in result else 0


if __name__ == "__main__":
    # os._exit: the result is written, and tearing down the interpreter and llama.cpp's backends
    # would only keep the parent waiting.
    os._exit(main(sys.argv[1:]))
