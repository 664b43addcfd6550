"""N questions over one document, asked at once (issue 29): `ctxq serve --parallel` against today's
serve (one at a time), llama.cpp's `llama-server -np N -kvu`, and `llama-batched-bench -pps -kvu`
(the ceiling: a shared prompt decoded by N sequences in one C++ loop, no HTTP, no sampling).

For each N in 1, 2, 4, 8, 16: N streamed chat requests sent together, each the document plus its
own question, greedy, `max_tokens` tokens each (end-of-generation banned, so every answer has the
same length). A fresh document per N (same length, other words), so every N prefills it once.
Printed side by side: aggregate output tokens/s (all answers' tokens over the wall time from the
first request to the last token), time to first token p50/p95, prompt tokens evaluated (prompt
tokens minus the cached ones each answer reports), KV cells used (ctxq: the engine's peak from
/metrics; today's serve: its one sequence; llama-server: every slot holds its own copy of the
document and its answer, so the sum of prompt + answer over the requests, the `-c` it needs).

    .venv/bin/python scripts/bench_parallel.py                  # SmolLM2-135M, ~6k-token document
    .venv/bin/python scripts/bench_parallel.py --model tiny --doc-tokens 30000
    .venv/bin/python scripts/bench_parallel.py --ns 1,8 --skip llama-server,batched-bench

llama-server and llama-batched-bench are built once from the vendored sources (scripts/llama_tools.py,
~1 hour on 2 busy cores); without them their rows say "not built" unless --build is given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_tools  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from which river mountain library window garden "
         "morning evening letter story journey market silver green quiet ancient bright narrow distant").split()
BAN_EOG = {"0": -100, "2": -100}  # <|endoftext|> and <|im_end|> in SmolLM2's vocabulary (the tiny model's too)


def document(llm_tokenize, n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    sents = [" ".join(rng.choice(WORDS) for _ in range(11)).capitalize() + "." for _ in range(n_tokens // 13)]
    for _ in range(4):
        n = llm_tokenize(" ".join(sents))
        if abs(n - n_tokens) <= 0.02 * n_tokens:
            break
        sents = (sents * 2)[:max(1, int(len(sents) * n_tokens / n))]
    return " ".join(sents)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free port, ready once /health answers 200; stopped with SIGINT."""

    def __init__(self, cmd: list[str], log: Path):
        import httpx

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited: {log.read_text()[-1500:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{cmd[0]} not ready: {log.read_text()[-1500:]}")
            time.sleep(0.3)

    def metrics(self) -> dict[str, float]:
        import httpx

        out = {}
        for line in httpx.get(self.base + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def ask(base: str, doc: str, question: str, max_tokens: int, t0: float) -> dict:
    import httpx

    body = {"messages": [{"role": "user", "content": doc + "\n\n" + question}], "max_tokens": max_tokens,
            "temperature": 0, "logit_bias": BAN_EOG, "stream": True, "stream_options": {"include_usage": True}}
    first, pieces, usage = None, 0, None
    with httpx.Client(timeout=3600) as c, c.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    first = first or time.monotonic()
                    pieces += 1
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    return {"ttft": (first or time.monotonic()) - t0, "end": time.monotonic(),
            "prompt": usage.get("prompt_tokens", 0), "cached": cached,
            "completion": usage.get("completion_tokens", pieces)}


def round_of(server: Server, doc: str, n: int, max_tokens: int, peak_cells=None) -> dict:
    """N requests at once; the row's numbers."""
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], peak_cells())
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True) if peak_cells else None
    if watcher:
        watcher.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        rs = list(pool.map(lambda q: ask(server.base, doc, q, max_tokens, t0), questions(n)))
    wall = max(r["end"] for r in rs) - t0
    done.set()
    if watcher:
        watcher.join()
    ttfts = sorted(r["ttft"] for r in rs)
    return {"tps": sum(r["completion"] for r in rs) / wall, "p50": statistics.median(ttfts),
            "p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "evaluated": sum(r["prompt"] - r["cached"] for r in rs), "wall": wall,
            "cells": peak[0] or None, "rows": rs}


def measure(label: str, start, ns: list[int], docs: dict, max_tokens: int, *, restart: bool = False,
            engine: bool = False, today: bool = False, cells=None) -> dict:
    """{N: row} from the server `start(N)` gives (one for every N, or a fresh one per N with `restart`).
    `engine`: ctxq's, whose /metrics say the cells used and the prompt tokens evaluated; else `cells(rows)`."""
    rows, srv = {}, None
    evaluated = "ctxq_prompt_tokens_evaluated_total"
    try:
        for n in ns:
            if restart and srv is not None:
                srv.stop()
                srv = None
            srv = srv or start(n)
            before = srv.metrics() if engine or today else None
            row = round_of(srv, docs[n], n, max_tokens, (lambda: srv.metrics()["ctxq_kv_cells_used"]) if engine else None)
            if engine:
                row["evaluated"] = srv.metrics()[evaluated] - before[evaluated]
            elif today:  # one sequence: a prompt and its answer
                grew = {k: srv.metrics()[k] - before[k] for k in ("ctxq_prompt_tokens_total",
                                                                  "ctxq_prompt_tokens_reused_total")}
                row["evaluated"] = grew["ctxq_prompt_tokens_total"] - grew["ctxq_prompt_tokens_reused_total"]
                row["cells"] = grew["ctxq_prompt_tokens_total"] / n + max_tokens
            else:
                row["cells"] = cells(row["rows"])
            rows[n] = row
            short = [r["completion"] for r in row["rows"] if r["completion"] != max_tokens]
            print(f"{label}, N={n}: {row['tps']:.1f} tok/s, TTFT p50 {row['p50']:.2f} s"
                  + (f"; answers of other lengths: {short}" if short else ""), file=sys.stderr)
    finally:
        if srv is not None:
            srv.stop()
    return rows


def questions(n: int) -> list[str]:
    return [f"Question {i + 1}: which word comes most often in the text above, and why?" for i in range(n)]


def engine_rows(model: Path, docs: dict, ns: list[int], max_tokens: int, n_ctx: int, threads: int | None) -> dict:
    """The engine in this process, no HTTP (the GPU check's table): {N: row} as `round_of` gives."""
    from ctxq.runtime import runner
    from ctxq.runtime.engine import SamplingParams, from_plan

    plan = runner.make_plan(model, n_ctx)
    rows = {}
    with from_plan(plan, n_seq_max=max(ns), n_threads=threads) as engine:
        llm = engine._llm
        for n in ns:
            prompts = [llm.tokenize(f"{docs[n]}\n\n{q}".encode(), add_bos=True) for q in questions(n)]
            before, peak = engine.stats(), 0
            t0 = time.monotonic()
            reqs = [engine.submit(t, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                    logit_bias={int(k): v for k, v in BAN_EOG.items()}))
                    for t in prompts]
            firsts = [None] * n

            def read(i):
                for ev in reqs[i]:
                    if ev.text and firsts[i] is None:
                        firsts[i] = time.monotonic()

            readers = [threading.Thread(target=read, args=(i,)) for i in range(n)]
            for t in readers:
                t.start()
            while not all(r.done for r in reqs):
                peak = max(peak, engine.stats().cells_used)
                time.sleep(0.02)
            for t in readers:
                t.join()
            wall = time.monotonic() - t0
            after = engine.stats()
            ttfts = sorted((f - t0) if f else float("nan") for f in firsts)
            rows[n] = {"tps": sum(r.completion_tokens for r in reqs) / wall, "p50": statistics.median(ttfts),
                       "p95": ttfts[min(n - 1, round(0.95 * (n - 1)))], "wall": wall, "cells": peak,
                       "evaluated": after.prompt_tokens_evaluated - before.prompt_tokens_evaluated}
    return rows


def ctxq_cmd(model: Path, n_ctx: int, parallel: int | None, threads: int | None) -> list[str]:
    cmd = [str(Path(sys.executable).with_name("ctxq")), "serve", str(model), "-c", str(n_ctx)]
    if parallel:
        cmd += ["--parallel", str(parallel)]
    return cmd + (["-t", str(threads)] if threads else [])


def batched_bench(bin_dir: Path, model: Path, n_doc: int, ns: list[int], max_tokens: int, threads: int | None):
    """llama-batched-bench -pps -kvu: {N: (S_TG aggregate tokens/s, T_PP s, N_KV cells)}."""
    n_ctx = n_doc + max(ns) * (max_tokens + 32) + 256
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
           "-npp", str(n_doc), "-ntg", str(max_tokens), "-npl", ",".join(map(str, ns)), "-pps", "-kvu", "-fa", "on"]
    if threads:
        cmd += ["-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    rows = {}
    for line in out.stdout.splitlines():  # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit():
            rows[int(cells[2])] = (float(cells[7]), float(cells[4]), int(cells[3]))
    if not rows:
        print(out.stdout[-1500:], out.stderr[-1500:], file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny, or a GGUF path")
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip", default="", help="comma-separated: today,llama-server,batched-bench")
    ap.add_argument("--build", action="store_true", help="build llama.cpp's tools when they are missing")
    ap.add_argument("--engine-only", action="store_true",
                    help="only ctxq's engine, in this process without HTTP (scripts/gpu_check.sh's table)")
    a = ap.parse_args()
    from ctxq.models import fetch_default_model
    from ctxq.runtime import runner

    if a.model == "default":
        model = fetch_default_model()
    elif a.model == "tiny":
        from ctxq.testing.models import tiny_chat_llama_gguf

        model = tiny_chat_llama_gguf(Path(tempfile.mkdtemp(prefix="ctxq-bench-")) / "tiny-chat.gguf")
    else:
        model = Path(a.model)
    ns, skip = [int(x) for x in a.ns.split(",")], set(filter(None, a.skip.split(",")))
    n_tok = lambda text: len(runner.tokenize(model, text))  # noqa: E731
    docs = {n: document(n_tok, a.doc_tokens, seed=n) for n in ns}
    n_doc = n_tok(docs[ns[0]])
    per_answer = 64 + a.max_tokens  # the chat template, the question and the answer
    n_ctx = -(-(n_doc + max(ns) * per_answer + 256) // 256) * 256
    logs = Path(tempfile.mkdtemp(prefix="ctxq-bench-parallel-"))
    table: dict[str, dict[int, dict]] = {}
    if a.engine_only:
        table[f"ctxq engine, n_seq_max {max(ns)}"] = engine_rows(model, docs, ns, a.max_tokens, n_ctx, a.threads)
        return report(model, n_doc, n_ctx, ns, a.max_tokens, table, {}, None)

    table[f"ctxq serve --parallel {max(ns)}"] = measure(
        "ctxq --parallel", lambda n: Server(ctxq_cmd(model, n_ctx, max(ns), a.threads), logs / "ctxq.log"),
        ns, docs, a.max_tokens, engine=True)
    if "today" not in skip:  # llama-cpp-python's streams carry no usage: its /metrics say what it evaluated
        table["ctxq serve (one at a time)"] = measure(
            "today's serve", lambda n: Server(ctxq_cmd(model, n_ctx, None, a.threads), logs / "today.log"),
            ns, docs, a.max_tokens, today=True)
    bin_dir = None
    if not {"llama-server", "batched-bench"} <= skip:
        try:
            bin_dir = llama_tools.build() if a.build else llama_tools.built()
        except subprocess.CalledProcessError as e:
            print(f"llama.cpp's tools did not build: {e}", file=sys.stderr)
    if bin_dir is not None and "llama-server" not in skip:
        def llama_server(n):  # -c for N private copies of the document and answer, as each slot holds one
            c = -(-(n * (n_doc + per_answer) + 256) // 256) * 256
            return Server([str(bin_dir / "llama-server"), "-m", str(model), "-c", str(c), "-np", str(n), "-kvu",
                           "-fa", "on", "-b", "2048", "-ub", "512", "--host", "127.0.0.1",
                           *(["-t", str(a.threads)] if a.threads else [])], logs / f"llama-server-{n}.log")

        table["llama-server -np N -kvu"] = measure(
            "llama-server", llama_server, ns, docs, a.max_tokens, restart=True,
            cells=lambda rs: sum(r["prompt"] + r["completion"] for r in rs))
    bench = batched_bench(bin_dir, model, n_doc, ns, a.max_tokens, a.threads) \
        if bin_dir is not None and "batched-bench" not in skip else {}
    report(model, n_doc, n_ctx, ns, a.max_tokens, table, bench, bin_dir is not None)


def report(model, n_doc, n_ctx, ns, max_tokens, table, bench, built) -> None:
    print(f"\n{Path(model).name}: a {n_doc:,}-token document, N questions at once, {max_tokens} tokens each "
          f"(greedy), ctxq's n_ctx {n_ctx:,}; {os.cpu_count()} CPU cores")
    head = f"{'':<30}" + "".join(f"{'N=' + str(n):>12}" for n in ns)
    for title, key, fmt in (("aggregate output tokens/s", "tps", "{:.1f}"), ("TTFT p50 s", "p50", "{:.2f}"),
                            ("TTFT p95 s", "p95", "{:.2f}"), ("prompt tokens evaluated", "evaluated", "{:,.0f}"),
                            ("KV cells used", "cells", "{:,.0f}")):
        print(f"\n{title}\n{head}")
        for name, rows in table.items():
            print(f"{name:<30}" + "".join(f"{fmt.format(rows[n][key]) if rows.get(n) and rows[n][key] is not None else '-':>12}"
                                          for n in ns))
        if key in ("tps", "evaluated", "cells"):
            i = {"tps": 0, "evaluated": None, "cells": 2}[key]
            vals = [("-" if n not in bench else f"{bench[n][0]:.1f}" if i == 0 else f"{bench[n][2]:,}")
                    if i is not None else ("-" if n not in bench else f"{n_doc:,}") for n in ns]
            if built is not None:
                print(f"{'llama-batched-bench -pps -kvu':<30}" + "".join(f"{v:>12}" for v in vals)
                      + ("" if built else "   (not built: scripts/llama_tools.py)"))


if __name__ == "__main__":
    main()
