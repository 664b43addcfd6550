"""The child process that runs llama.cpp's quantizer: `python -m ctxq.quantize_worker JOB.json`.

llama.cpp can abort the whole process (GGML_ABORT) and `llama_model_quantize` cannot be interrupted
from Python, so ctxq runs it here and the parent only watches. The worker

1. quantizes `src` into `out` with `llama_model_quantize`, its log going raw to stderr (the parent
   reads the `[ i/ N]` tensor lines for progress);
2. loads `out` with llama.cpp to prove it is a model (`verify`);
3. optionally runs the quality gate (`ctxq.quality.compare`) against `reference`;
4. writes a JSON result to `result` (never to stdout, where C code may print).

It exits 0 on success, 2 with {"error": ...} in the result when llama.cpp refused the job, and
dies with the parent (PR_SET_PDEATHSIG), so a killed `ctxq` leaves no quantizer running.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def _log_to_stderr(lc):
    @lc.llama_log_callback
    def on_log(level, text, user_data):
        os.write(2, text)

    lc.llama_log_set(on_log, ctypes.c_void_p(0))
    return on_log  # the caller keeps it alive


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


def build_params(lc, job: dict):
    """`llama_model_quantize_params` for a job; returns (params, objects to keep alive)."""
    p = lc.llama_model_quantize_default_params()
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
    keep: list = []
    if job.get("imatrix"):
        data, meta = load_imatrix(job["imatrix"])
        entries = (lc.llama_model_imatrix_data * (len(data) + 1))()  # NULL-name terminated
        for i, (name, arr) in enumerate(data.items()):
            keep.append((name.encode(), arr))
            entries[i].name = keep[-1][0]
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        p.imatrix = entries
        keep.append(entries)
        # The same provenance keys llama.cpp's quantize tool writes into the output.
        kvs = [("quantize.imatrix.file", job["imatrix"]), ("quantize.imatrix.entries_count", len(data))]
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
        p.kv_overrides = overrides
        keep.append(overrides)
    return p, keep


def verify(lc, path: str) -> int:
    """Load the model as ctxq will, weights included; return its parameter count."""
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load the quantized file {path}")
    try:
        return int(lc.llama_model_n_params(model))
    finally:
        lc.llama_model_free(model)


def run(job: dict) -> dict:
    import llama_cpp as lc

    cb = _log_to_stderr(lc)  # noqa: F841  (kept alive for the life of the job)
    lc.llama_backend_init()
    if job.get("check_only"):  # a cached file that has not been through the quality gate yet
        from .quality import compare

        return {"quality": compare(job["reference"], job["out"])}
    params, keep = build_params(lc, job)
    t0 = time.perf_counter()
    rc = lc.llama_model_quantize(job["src"].encode(), job["out"].encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    if rc != 0:
        return {"error": "llama_model_quantize failed", "rc": int(rc)}
    result = {"quantize_seconds": seconds}
    if job.get("verify", True):
        result["n_params"] = verify(lc, job["out"])
    if job.get("reference"):
        from .quality import compare

        result["quality"] = compare(job["reference"], job["out"])
    return result


def main(argv: list[str]) -> int:
    _die_with_parent()
    job = json.loads(Path(argv[0]).read_text())
    try:
        result = run(job)
    except Exception as e:  # reported to the parent as one line
        result = {"error": f"{type(e).__name__}: {e}"}
    part = job["result"] + ".part"
    Path(part).write_text(json.dumps(result))
    os.replace(part, job["result"])
    return 2 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
