"""The child process that collects an importance matrix: `python -m ctxq.conversion.imatrix_worker`.
The parent's side is `ctxq.conversion.imatrix`.

It does what llama.cpp's `llama-imatrix` does (tools/imatrix/imatrix.cpp), through llama.cpp's eval callback
(`cb_eval` in llama_context_params): the text is tokenized once (BOS first), cut into chunks of `chunk` tokens, each
chunk decoded alone in a cleared cache with its first token replaced by BOS and every position an output (as the tool
asks logits everywhere, so the last layer runs on every token); for each MUL_MAT whose weight is a `blk.*` tensor and
whose input has at least 16 F32 rows, the sum of squared inputs per input column and the rows counted; for each
MUL_MAT_ID the same per expert, routed by the ids tensor. llama.cpp can abort the process, hence the child.

Job (JSON on stdin): {"model", "text" (file), "chunk", "chunks" (null: all), "dataset", "out" (.gguf to write),
"threads"}. Progress: `progress DONE TOTAL` lines on stdout. Result: `out`.json ({"error": ...} for bad input).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import time

import numpy as np

GGML_TYPE_F32 = 0  # enum ggml_type
MIN_ROWS = 16  # imatrix.cpp collect_imatrix: "why are small batches ignored (<16 tokens)?"


class Tensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h; GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64)."""

    _fields_ = [
        ("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class JobError(Exception):
    """Bad input, reported to the parent in one line."""


def bind_ggml(lib_dir: str):
    """libggml-base (already loaded by llama_cpp) with the few functions the collector calls."""
    name = {"darwin": "libggml-base.dylib", "win32": "ggml-base.dll"}.get(sys.platform, "libggml-base.so")
    g = ctypes.CDLL(os.path.join(lib_dir, name))
    g.ggml_backend_buffer_is_host.argtypes, g.ggml_backend_buffer_is_host.restype = [ctypes.c_void_p], ctypes.c_bool
    g.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    g.ggml_backend_tensor_get.restype = None
    g.ggml_nbytes.argtypes, g.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
    g.ggml_op_name.argtypes, g.ggml_op_name.restype = [ctypes.c_int], ctypes.c_char_p
    return g


def weight_name(raw: bytes) -> str:
    """imatrix.cpp filter_tensor_name: the part between the first two '#' when there are any."""
    s = raw.decode("utf-8", "replace")
    if "#" in s:
        s = s.split("#", 2)[1]
    return s


class Collector:
    """Sums of squared activations per weight tensor: `sums[name]` (n_mat, n_cols) float64, `counts[name]` (n_mat,)."""

    def __init__(self, g):
        self.g = g
        ops = {g.ggml_op_name(i): i for i in range(128) if g.ggml_op_name(i)}
        self.mul_mat, self.mul_mat_id = ops[b"MUL_MAT"], ops[b"MUL_MAT_ID"]
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}
        self.error: str | None = None

    def _array(self, ptr: int, t: Tensor, dtype, dims: int) -> np.ndarray:
        """The tensor's first `dims` dimensions as a strided numpy array (outermost first), copied to the host."""
        n = self.g.ggml_nbytes(ptr)
        if t.buffer and self.g.ggml_backend_buffer_is_host(t.buffer):
            raw = np.frombuffer((ctypes.c_char * n).from_address(t.data), dtype=np.uint8)
        else:
            raw = np.empty(n, dtype=np.uint8)
            self.g.ggml_backend_tensor_get(ptr, raw.ctypes.data, 0, n)
        shape = tuple(t.ne[i] for i in reversed(range(dims)))
        strides = tuple(t.nb[i] for i in reversed(range(dims)))
        return np.lib.stride_tricks.as_strided(raw.view(dtype), shape=shape, strides=strides)

    def __call__(self, ptr: int, ask: bool, _user_data) -> bool:
        try:
            return self._collect(ptr, ask)
        except BaseException as e:  # an exception must not cross into C; the parent hears of it
            self.error = self.error or f"{type(e).__name__}: {e}"
            return False

    def _collect(self, ptr: int, ask: bool) -> bool:
        t = Tensor.from_address(ptr)
        if t.op not in (self.mul_mat, self.mul_mat_id):
            return False
        src0, src1 = Tensor.from_address(t.src[0]), Tensor.from_address(t.src[1])
        name = weight_name(src0.name)
        if ask:
            if t.op == self.mul_mat_id:
                return True  # every indirect matrix multiplication, as the tool
            return src1.ne[1] >= MIN_ROWS and src1.type == GGML_TYPE_F32 and name.startswith("blk.")
        x = self._array(t.src[1], src1, np.float32, 4).astype(np.float64)  # (ne3, ne2, ne1, ne0)
        ne0 = x.shape[-1]
        if t.op == self.mul_mat_id:
            n_as = src0.ne[2]
            ids_t = Tensor.from_address(t.src[2])
            ids = self._array(t.src[2], ids_t, np.int32, 2)  # (n_tokens, n_ids)
            xs = x[0][:, np.arange(ids.shape[1]) % x.shape[2], :]  # (n_tokens, n_ids, ne0)
            ex = ids.reshape(-1)
            if ex.min() < 0 or ex.max() >= n_as:
                raise ValueError(f"expert id out of range in {name}")
            acc = self.sums.setdefault(name, np.zeros((n_as, ne0)))
            np.add.at(acc, ex, np.square(xs).reshape(-1, ne0))
            cnt = self.counts.setdefault(name, np.zeros(n_as, dtype=np.int64))
            cnt += np.bincount(ex, minlength=n_as)
        else:
            m2, m3 = src0.ne[2], src0.ne[3]
            acc = self.sums.setdefault(name, np.zeros((m2 * m3, ne0)))
            per = np.square(x).sum(axis=2)  # (ne3, ne2, ne0): rows summed
            for i3 in range(per.shape[0]):
                for i2 in range(per.shape[1]):
                    acc[(i3 % m3) * m2 + (i2 % m2)] += per[i3, i2]
            cnt = self.counts.setdefault(name, np.zeros(1, dtype=np.int64))
            cnt += x.shape[0] * x.shape[1] * x.shape[2] // (m2 * m3)  # ggml_nrows(src1) / n_mat
        if not np.isfinite(acc).all():
            raise ValueError(f"non-finite activations in {name}")
        return True


def write_imatrix(out: str, sums: dict, counts: dict, datasets: list[str], chunk_count: int, chunk: int) -> None:
    """llama.cpp's GGUF imatrix (imatrix.cpp save_imatrix): `general.type` imatrix, `imatrix.datasets`,
    `imatrix.chunk_count`, `imatrix.chunk_size`; per weight, in name order, `<name>.in_sum2` (ne: columns x
    matrices) and `<name>.counts` (ne: 1 x matrices), both F32."""
    import gguf

    w = gguf.GGUFWriter(out, "imatrix")
    for kv in w.kv_data:  # the writer adds general.architecture; llama.cpp's imatrix file has none
        kv.pop("general.architecture", None)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", datasets)
    w.add_uint32("imatrix.chunk_count", chunk_count)
    w.add_uint32("imatrix.chunk_size", chunk)
    for name in sorted(sums):
        w.add_tensor(f"{name}.in_sum2", sums[name].astype(np.float32))
        w.add_tensor(f"{name}.counts", counts[name].astype(np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run(job: dict) -> dict:
    import llama_cpp as lc

    from ..llama.backend import lib_dir

    g = bind_ggml(str(lib_dir()))
    col = Collector(g)
    callback = lc.ggml_backend_sched_eval_callback(col)
    chunk = int(job["chunk"])
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(job["model"].encode(), mp)
    if not model:
        raise JobError(f"llama.cpp cannot load {job['model']}")
    cp = lc.llama_context_default_params()
    cp.n_ctx = cp.n_batch = chunk
    cp.n_ubatch = min(chunk, 512)  # llama.cpp's default n_ubatch (common.h)
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = int(job.get("threads") or os.cpu_count() or 1)
    cp.cb_eval = callback
    cp.cb_eval_user_data = None
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        raise JobError(f"llama.cpp cannot make a context of {chunk} tokens for {job['model']}")
    vocab = lc.llama_model_get_vocab(model)
    with open(job["text"], "rb") as f:
        text = f.read()
    buf = (lc.llama_token * (len(text) + 2))()
    n = lc.llama_tokenize(vocab, text, len(text), buf, len(buf), True, False)
    if n < 0:
        raise JobError("the text could not be tokenized")
    toks = np.ctypeslib.as_array(buf)[:n].copy()
    n_max = n // chunk
    if n_max < 1:
        raise JobError(f"the text is {n:,} tokens under this model's vocabulary, shorter than one chunk of {chunk:,}: "
                       "give a longer text (-f FILE) or a smaller chunk")
    n_chunks = n_max if job.get("chunks") is None else min(int(job["chunks"]), n_max)
    add_bos = lc.llama_vocab_get_add_bos(vocab)
    bos = lc.llama_vocab_bos(vocab)
    batch = lc.llama_batch_init(chunk, 0, 1)
    t0 = time.perf_counter()
    try:
        for i in range(chunk):
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
        for c in range(n_chunks):
            part = toks[c * chunk:(c + 1) * chunk].copy()
            if add_bos:
                part[0] = bos
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            batch.n_tokens = chunk
            np.ctypeslib.as_array(batch.token, shape=(chunk,))[:] = part
            np.ctypeslib.as_array(batch.pos, shape=(chunk,))[:] = np.arange(chunk, dtype=np.int32)
            np.ctypeslib.as_array(batch.logits, shape=(chunk,))[:] = 1  # every position an output, as the tool
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise JobError(f"llama_decode returned {rc} in chunk {c + 1}")
            if col.error:
                raise JobError(col.error)
            print(f"progress {c + 1} {n_chunks}", flush=True)
    finally:
        lc.llama_batch_free(batch)
    seconds = time.perf_counter() - t0
    if not col.sums:
        raise JobError("no matrix multiplication was seen: nothing to write")
    write_imatrix(job["out"], col.sums, col.counts, [job.get("dataset") or os.path.basename(job["text"])],
                  n_chunks, chunk)
    return {"chunks": n_chunks, "n_tokens": int(n), "tensors": len(col.sums), "seconds": seconds,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> int:
    from ..children import watch_parent
    from ..errors import CtxqError

    watch_parent()  # ctxq killed: stop at once
    job = json.loads(sys.stdin.read())
    try:
        result = run(job)
    except (JobError, CtxqError) as e:
        result = {"error": str(e)}
    with open(job["out"] + ".json", "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 2


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())  # the result is written; tearing down llama.cpp would only keep the parent waiting
