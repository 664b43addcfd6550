#!/usr/bin/env python
"""Prefill and decode speed: one device against the same model split over simulated devices.

    python scripts/bench_rpc.py                      # 32k-token prompt, 16,16,16,8,8 GiB
    python scripts/bench_rpc.py --tokens 4096 --n-predict 32 --threads 2

Three runs on the same prompt, each in a fresh child process (`ctxq.rpc.run_supervised`):
  1 device      everything on this process's CPU device (no RPC)
  1 simulated   all layers on one local RPC worker (the cost of RPC itself)
  N simulated   the layers split over N local workers as the planner lays out the given sizes
Workers serve the CPU device over 127.0.0.1, so the split costs show up, not GPU speed-ups.
Decode tok/s counts as `ctxq run` does: n tokens, n - 1 evaluations after the prefill (`Generation`).
The default model is SmolLM2-135M (trained context 8192); a longer prompt still measures speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def make_prompt(model: str, n_tokens: int) -> list[int]:
    """`n_tokens` tokens of varied English text (numbered sentences), starting with BOS."""
    from llama_cpp import Llama

    from ctxq.llama import backend

    with backend.capture_log():  # llama.cpp's load chatter goes to ctxq's log, not the table's stderr
        vocab = Llama(model, vocab_only=True, verbose=False)
    words = ("river stone lantern orchard violin copper meadow harbor engine falcon canvas thunder "
             "glacier pepper saddle marble".split())
    text = " ".join(f"Sentence {i}: the {words[i % 16]} met the {words[(i * 7) % 16]} near the "
                    f"{words[(i * 5 + 3) % 16]}." for i in range(n_tokens // 8 + 16))
    toks = vocab.tokenize(text.encode())[:n_tokens]
    vocab.close()
    if len(toks) < n_tokens:
        sys.exit(f"could only make {len(toks)} prompt tokens")
    return toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: ctxq's default model)")
    ap.add_argument("--tokens", type=int, default=32768, help="prompt length in tokens (default 32768)")
    ap.add_argument("--n-predict", type=int, default=32, help="tokens to decode greedily (default 32)")
    ap.add_argument("--gpus", default="16,16,16,8,8", help="simulated device sizes in GiB")
    ap.add_argument("--threads", type=int, default=None, help="threads of the 1-device run (default: all cores)")
    ap.add_argument("--worker-threads", type=int, default=None,
                    help="threads per worker (default: start_workers' share of the cores)")
    ap.add_argument("--skip-one-simulated", action="store_true",
                    help="leave out the 1-simulated run (the cost of RPC alone); saves a third of a long run")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    a = ap.parse_args()

    from ctxq import rpc
    from ctxq.models import resolve_model
    from ctxq.planning.planner import plan
    from ctxq.units import default_threads

    model = str(resolve_model(a.model))
    threads = a.threads or default_threads()
    n_ctx = a.tokens + a.n_predict + 1
    prompt = make_prompt(model, a.tokens)
    sizes = [float(s) for s in a.gpus.split(",")]
    results = {}

    def run(label, kwargs, endpoints=(), workers=None):
        # With every layer on workers the client only looks up token embeddings: one thread, so that
        # it does not compete with the workers for cores.
        n = 1 if endpoints else threads
        t = time.perf_counter()
        g = rpc.run_supervised(rpc.generate_greedy, model, prompt, a.n_predict, rpc=list(endpoints), workers=workers,
                               n_threads=n, n_threads_batch=n, **kwargs)
        results[label] = {"prefill_tps": g.prefill_tps, "decode_tps": g.decode_tps, "prefill_s": g.prefill_s,
                          "wall_s": time.perf_counter() - t, "tokens": g.tokens, "devices": g.devices}
        print(f"  {label}: prefill {g.prefill_tps:.1f} tok/s, decode {g.decode_tps:.2f} tok/s", file=sys.stderr)

    print(f"bench_rpc: {model}, prompt {a.tokens} tokens, decode {a.n_predict}, {threads} threads", file=sys.stderr)
    with rpc.start_workers(1, threads=a.worker_threads) as one:
        p1 = plan(model, n_ctx, rpc=f"{one.endpoints[0]}={max(sizes):g}", kv="f16")
        cpu_kwargs = {**p1.llama_kwargs(), "n_gpu_layers": 0}
        cpu_kwargs.pop("tensor_split", None)
        run("1 device", cpu_kwargs)
        if not a.skip_one_simulated:
            run("1 simulated", p1.llama_kwargs(), one.endpoints, one)
    with rpc.start_workers(a.gpus, threads=a.worker_threads) as w:
        wthreads = f"{one.threads}/{w.threads}"
        pn = plan(model, n_ctx, rpc=w.rpc_spec, kv="f16", split=":".join(f"{s:g}" for s in sizes))
        order = pn.device_order or range(len(sizes))
        label = f"{len(sizes)} simulated"
        run(label, pn.llama_kwargs(), [w.endpoints[i] for i in order], w)

    cols = list(results)
    base = results[cols[0]]
    rows = [("prefill tok/s", "prefill_tps", "{:.1f}"), ("decode tok/s", "decode_tps", "{:.2f}"),
            ("prefill s", "prefill_s", "{:.1f}"), ("wall s (load+run)", "wall_s", "{:.1f}")]
    header = ["", *cols, *(f"{c} / {cols[0]}" for c in cols[1:])]
    table = [header]
    for name, key, fmt in rows:
        vals = [results[c][key] for c in cols]
        table.append([name, *(fmt.format(v) for v in vals), *(f"{v / base[key]:.2f}x" for v in vals[1:])])
    same = all(results[c]["tokens"] == base["tokens"] for c in cols)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(f"model {model.rsplit('/', 1)[-1]}, prompt {a.tokens} tokens, {a.n_predict} decoded, "
          f"threads: 1 device {threads}, per worker (1/{len(sizes)} simulated) {wthreads}, client 1\n"
          f"split: {pn.llama_flags()}")
    for r in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"greedy tokens identical in all runs: {'yes' if same else 'NO'}")
    if a.json:
        print(json.dumps({"tokens": a.tokens, "n_predict": a.n_predict, "threads": threads, "results": results},
                         indent=2))


if __name__ == "__main__":
    main()
