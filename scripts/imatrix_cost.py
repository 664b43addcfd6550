"""What ctxq's importance matrix costs (issue 45, part 3): measured on a model here, estimated for a 70B's shape.

Measures, on MODEL and the built-in text, `chunks` chunks of 512 tokens: ctxq's collector (`make_imatrix`, fresh:
the child's evaluation time and peak resident memory), and llama.cpp evaluating the same chunks with no eval
callback (llama-cpp-python, every position an output as the collector asks), so the collector's own share is the
difference. Then estimates Llama-3-70B's shape (`ctxq.testing.synthetic.GEOMETRIES`, F16, on the CPU as the
collector runs) with the formulas printed:

- time = forward + collection: forward = 2 x params x tokens / R, R the FLOP rate measured here; collection =
  (floats copied per token) x tokens / C, C the collector's rate measured here (floats/s), the floats per token being
  the input width of every blk.* matrix multiplication (n_expert_used rows of an expert tensor);
- memory = the model file (mapped, every page read) + the sums (float64, n_mat x n_cols per weight) + llama.cpp's
  logits (512 x n_vocab x 4 B) + two copies of the widest input (512 x width x 8 B) + this interpreter's own base (the
  measured peak less those four terms for MODEL).

    .venv/bin/python scripts/imatrix_cost.py ~/.cache/ctxq/models/SmolLM2-135M-Instruct.F16.gguf --chunks 8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 512


def shape_terms(tensors, n_expert_used: int) -> dict:
    """From (name, ggml shape) pairs: params, floats copied per token, sum bytes, widest input."""
    params = sum(math.prod(s) for _, s in tensors)
    mats = [(n, s) for n, s in tensors if n.startswith("blk.") and len(s) >= 2 and n.endswith(".weight")
            and "norm" not in n and "ffn_gate_inp" not in n]
    floats = sum(s[0] * (n_expert_used if len(s) > 2 else 1) for _, s in mats)
    sums = sum(s[0] * (s[2] if len(s) > 2 else 1) * 8 for _, s in mats)
    return {"params": params, "floats_per_token": floats, "sum_bytes": sums, "widest": max(s[0] for _, s in mats)}


def plain_forward(model: str, tokens, n_chunks: int, threads: int) -> float:
    """Seconds llama.cpp takes for the chunks without a callback (all logits, as the collector)."""
    from llama_cpp import Llama

    llm = Llama(model, n_ctx=CHUNK, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    t0 = time.perf_counter()
    for c in range(n_chunks):
        llm.reset()  # (eval removes the cells from n_tokens on: a cleared cache)
        llm.eval(tokens[c * CHUNK:(c + 1) * CHUNK])
    seconds = time.perf_counter() - t0
    llm.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()

    from llama_cpp import Llama

    from ctxq.conversion.imatrix import make_imatrix
    from ctxq.gguf.reader import read_gguf
    from ctxq.quality import builtin_text
    from ctxq.testing.synthetic import GEOMETRIES, tensor_specs

    g = read_gguf(a.model, skip_arrays=True)
    here = shape_terms([(t.name, tuple(t.shape)) for t in g.tensors], 1)
    n_vocab = next(t.shape[1] for t in g.tensors if t.name == "token_embd.weight")
    vocab = Llama(a.model, vocab_only=True, verbose=False)
    tokens = vocab.tokenize(builtin_text(), add_bos=True, special=False)
    vocab.close()
    with tempfile.TemporaryDirectory(prefix="imatrix-cost-") as tmp:
        r = make_imatrix(a.model, chunks=a.chunks, out=Path(tmp) / "m.gguf", force=True, threads=a.threads)
    forward = plain_forward(a.model, tokens, r.chunks, a.threads)
    n_tok = r.chunks * CHUNK
    rate = 2 * here["params"] * n_tok / forward  # FLOP/s of llama.cpp here
    collect = max(r.seconds - forward, 1e-9)
    c_rate = here["floats_per_token"] * n_tok / collect
    model_bytes = os.path.getsize(a.model)
    logits = CHUNK * n_vocab * 4
    acts = 2 * CHUNK * here["widest"] * 8
    base = r.peak_rss_bytes - model_bytes - here["sum_bytes"] - logits - acts
    print(f"{Path(a.model).name}: {here['params'] / 1e6:.1f} M parameters, {r.chunks} chunks x {CHUNK} tokens, "
          f"{a.threads} threads")
    print(f"  ctxq imatrix: {r.seconds:.1f} s evaluating, peak {r.peak_rss_bytes / 2**20:.0f} MiB "
          f"(model file {model_bytes / 2**20:.0f} MiB, sums {here['sum_bytes'] / 2**20:.1f} MiB)")
    print(f"  llama.cpp alone (no callback): {forward:.1f} s -> {rate / 1e9:.1f} GFLOP/s; the collector "
          f"{collect:.1f} s for {here['floats_per_token']:,} floats per token -> {c_rate / 1e6:.0f} M floats/s")
    geo = GEOMETRIES["llama3-70b"]
    big = shape_terms([(n, tuple(s)) for n, s, _ in tensor_specs(geo, "F16")], 1)
    chunks_70 = 32  # what ctxq convert makes (imatrix.AUTO_CHUNKS)
    t_fwd = 2 * big["params"] * chunks_70 * CHUNK / rate
    t_col = big["floats_per_token"] * chunks_70 * CHUNK / c_rate
    mem = 2 * big["params"] + big["sum_bytes"] + CHUNK * geo.n_vocab * 4 + 2 * CHUNK * big["widest"] * 8 + base
    print(f"{geo.name} (F16, {big['params'] / 1e9:.1f} B parameters), {chunks_70} chunks x {CHUNK} tokens, "
          "on this CPU at the rates above:")
    print(f"  time: forward 2 x {big['params'] / 1e9:.1f}e9 x {chunks_70 * CHUNK:,} / {rate / 1e9:.1f} GFLOP/s = "
          f"{t_fwd / 3600:.1f} h; collection {big['floats_per_token']:,} floats x {chunks_70 * CHUNK:,} / "
          f"{c_rate / 1e6:.0f} M/s = {t_col / 60:.1f} min")
    print(f"  memory: model {2 * big['params'] / 2**30:.1f} GiB + sums {big['sum_bytes'] / 2**20:.0f} MiB + logits "
          f"{CHUNK * geo.n_vocab * 4 / 2**20:.0f} MiB + inputs {2 * CHUNK * big['widest'] * 8 / 2**20:.0f} MiB + base "
          f"{base / 2**20:.0f} MiB = {mem / 2**30:.1f} GiB")


if __name__ == "__main__":
    sys.exit(main())
