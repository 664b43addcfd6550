"""The child process that runs llama.cpp's quantizer (`python -m ctxq.quantize_worker`, job on stdin),
and `Worker`, the parent's handle on it.

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

import collections
import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

llama_log = logging.getLogger("ctxq.llama_cpp")

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
    """Load the model, weights mapped; return its parameter count."""
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = False  # repacking weights for the CPU kernels would only cost time here
    model = lc.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load the quantized file {path}")
    try:
        return int(lc.llama_model_n_params(model))
    finally:
        lc.llama_model_free(model)


def run(lc, job: dict) -> dict:
    if job.get("check_only"):  # a cached file that has not been through the quality gate yet
        from .quality import compare

        return {"quality": compare(job["reference"], job["out"], cache_dir=job.get("logits_cache"))}
    params, keep = build_params(lc, job)
    t0 = time.perf_counter()
    rc = lc.llama_model_quantize(job["src"].encode(), job["out"].encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    if rc != 0:
        return {"error": "llama_model_quantize failed", "rc": int(rc)}
    result = {"quantize_seconds": seconds}
    if job.get("reference"):  # the quality gate loads the result: that is the load check too
        from .quality import compare

        result["quality"] = compare(job["reference"], job["out"], cache_dir=job.get("logits_cache"))
    else:
        t0 = time.perf_counter()
        result["n_params"] = verify(lc, job["out"])
        result["verify_seconds"] = time.perf_counter() - t0
    return result


def _bindings():
    """llama-cpp-python's ctypes bindings (`llama_cpp.llama_cpp`) without the package's __init__,
    which also imports the high-level `Llama` with numpy and jinja2: 0.34 s of its 0.38 s import
    (`python -X importtime -c "import llama_cpp"`), paid on every quantization otherwise."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("llama_cpp")
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
    sys.modules["llama_cpp"] = pkg
    import llama_cpp.llama_cpp as lc

    return lc


def main(argv: list[str]) -> int:
    _die_with_parent()
    # Loaded before the job arrives, while the parent prepares it. The quality gate needs `Llama`.
    if "--lean" in argv:
        lc = _bindings()
    else:
        import llama_cpp as lc

    cb = _log_to_stderr(lc)  # noqa: F841  (kept alive for the life of the job)
    lc.llama_backend_init()
    ready = time.time()
    text = sys.stdin.read()
    if not text:  # the parent changed its mind
        return 0
    job = json.loads(text)
    waited = time.time() - ready
    try:
        result = run(lc, job)
    except Exception as e:  # reported to the parent as one line
        result = {"error": f"{type(e).__name__}: {e}"}
    result["waited_for_job_seconds"] = waited  # > 0: starting the worker early hid its start-up
    part = job["result"] + ".part"
    Path(part).write_text(json.dumps(result))
    os.replace(part, job["result"])
    return 2 if "error" in result else 0


# --- the parent's side -------------------------------------------------------------------------

_TENSOR_RE = re.compile(rb"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


def _failure(rc: int, result: dict, tail: collections.deque) -> str:
    """One line saying why the worker failed, from llama.cpp's own error when it printed one."""
    lines = [ln.strip() for ln in tail if ln.strip()]
    for ln in reversed(lines):
        m = re.search(r"failed to quantize: (.+)", ln)
        if m:
            return m.group(1).rstrip("!. ")
    if rc < 0:
        last = next((ln for ln in reversed(lines) if re.search(r"error|abort|assert", ln, re.I)), "")
        return f"llama.cpp died with {signal.Signals(-rc).name}" + (f" ({last[:200]})" if last else "")
    return result.get("error") or (lines[-1][:200] if lines else f"exit status {rc}")


class Worker:
    """A started worker process. Start it early: it imports llama.cpp while the caller prepares the
    job. It runs in its own session, so a terminal's Ctrl-C reaches only the parent, which kills it
    (`close`): interrupting never waits for a tensor to finish."""

    def __init__(self, lean: bool = False):
        """`lean`: the job runs no quality gate, so the worker loads only llama.cpp's bindings."""
        self._tmp = tempfile.TemporaryDirectory(prefix="ctxq-quantize-")
        argv = [sys.executable, "-m", "ctxq.quantize_worker"] + (["--lean"] if lean else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stderr):
            try:
                pipe.close()
            except OSError:  # a pipe to a dead process
                pass
        self._tmp.cleanup()

    def run(self, job: dict, progress=None) -> dict:
        """Send the job, follow the `[ i/ N]` tensor lines, return the result; ConversionError on failure."""
        from .errors import ConversionError

        result_path = Path(self._tmp.name) / "result.json"
        try:
            self.proc.stdin.write(json.dumps({**job, "result": str(result_path)}).encode())
            self.proc.stdin.close()
        except BrokenPipeError:  # it died while starting; its stderr says why
            pass
        tail: collections.deque = collections.deque(maxlen=40)
        line, last = b"", 0
        while chunk := self.proc.stderr.read1(1 << 16):
            line += chunk
            *done, line = line.split(b"\n")
            for ln in done:
                text = ln.decode("utf-8", "replace")
                llama_log.debug("%s", text)
                tail.append(text)
                if progress and last and "quant size" in text:  # quantized; loading or the gate follows
                    progress(last, last, "")
            for m in _TENSOR_RE.finditer(b"\n".join(done + [line])):
                i, n = int(m.group(1)), int(m.group(2))
                if progress and i > last:
                    progress(i - 1, n, m.group(3).decode("utf-8", "replace"))
                last = max(last, i)
        rc = self.proc.wait()
        if line:
            tail.append(line.decode("utf-8", "replace"))
        try:
            result = json.loads(result_path.read_text())
        except (OSError, ValueError):
            result = {}
        if rc != 0 or "error" in result:
            raise ConversionError(_failure(rc, result, tail))
        return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
