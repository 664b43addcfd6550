"""`ctxq run` against a plain `llama_cpp.Llama` with identical parameters: prefill and decode tokens/s.

Both sides run the same model, context, KV type and prompt in fresh processes, alternating (the
order flips each round so drift in a shared machine's load hits both), greedy (temp 0) so both
generate the same tokens. The ctxq side is the real command with its progress bar and streaming;
the plain side is `Llama(**kwargs)` with the kwargs ctxq's plan produced (runner.llama_params),
`llm.eval(tokens)` for the prefill and `llm.generate()` for decoding, timed the same way.

    .venv/bin/python scripts/bench_run.py [--model PATH] [--ctx 8192] [--tokens 2048] [-n 64] [--repeats 3]
                                          [--threads N]

Prints both sides' medians and the ratio ctxq / plain (target: >= 0.99), then the same comparison
inside one process on one loaded model (ctxq's prefill/generate code against plain Llama calls),
which isolates ctxq's own cost from the load of a shared machine.

    .venv/bin/python scripts/bench_run.py --long [--long-tokens 60000]

The long-context path, which tests/test_run.py held at 60k tokens until issue 64 (131 s of the suite on a loaded
machine; the suite now runs the same command with an 8k-token file at the same context): `ctxq run` of a tiny
random model (2 layers, 64 wide, SmolLM2's tokenizer) with a 60k-token file at --ctx 65536 and a q8_0 cache, on
the CPU. Claims, each printed as `CLAIM FAILED: ...` with exit status 1 when it fails: the run ends with 0, the
command line says -c 65536 and -ctk q8_0 -ctv q8_0, the progress bar reaches N/N, the prompt line counts N tokens,
an answer is printed. The prefill's seconds are printed (about 60 s on 2 idle cores, issue 6).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from his her which an be this are have it not had "
         "river mountain city library window garden morning evening letter story journey question answer market "
         "silver green quiet ancient bright narrow distant simple careful sudden gentle heavy").split()


def make_text(model: str, n_tokens: int) -> tuple[str, int]:
    from ctxq.runtime.runner import tokenize

    rng = random.Random(0)
    sents = [" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "." for _ in range(n_tokens // 12 + 50)]
    while True:
        text = " ".join(sents)
        n = len(tokenize(model, text))
        if n <= n_tokens:
            return text, n
        sents = sents[:-max(1, (n - n_tokens) // 16)]


def plain_worker(model: str, text_file: str, kwargs_json: str, n_predict: int) -> None:
    """One plain llama-cpp-python run; prints JSON timings."""
    import llama_cpp

    kwargs = json.loads(kwargs_json)
    llm = llama_cpp.Llama(model, **kwargs)
    tokens = llm.tokenize(Path(text_file).read_text().encode("utf-8"), special=True)
    t0 = time.perf_counter()
    llm.eval(tokens)
    t1 = time.perf_counter()
    n, t_first, t_last = 0, t1, t1
    for tok in llm.generate(tokens, temp=0.0, repeat_penalty=1.0):
        t_last = time.perf_counter()
        if n == 0:
            t_first = t_last
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            break
        n += 1
        if n >= n_predict:
            break
    llm.close()
    print(json.dumps({"n_prompt": len(tokens), "n_generated": n, "prefill_tps": len(tokens) / (t1 - t0),
                      "decode_tps": (n - 1) / (t_last - t_first) if n > 1 else 0.0}))


def in_process(args, text: str, rounds: int) -> None:
    """ctxq's own code path against plain Llama calls on one loaded model, alternating: this isolates
    what ctxq adds (chunked prefill with a progress callback, streaming detokenization) from the
    process-to-process noise of a shared machine."""
    from ctxq.runtime import runner

    p = runner.make_plan(args.model, args.ctx, kv=args.kv)
    llm, _, _ = runner.load_plan(p, n_threads=args.threads)
    toks = runner.tokenize(args.model, text)
    ratios = {"prefill": [], "decode": []}
    for i in range(rounds):
        for side in (("ctxq", "plain") if i % 2 == 0 else ("plain", "ctxq")):
            if side == "ctxq":
                g = runner.generate(llm, toks, n_predict=args.n, temp=0, on_progress=lambda _: None,
                                    on_text=lambda _: None)
                c = (g.prefill_tps, g.decode_tps)
            else:
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(toks)
                t1 = time.perf_counter()
                n, t_first = 0, t1
                for tok in llm.generate(toks, temp=0.0, repeat_penalty=1.0):
                    t_last = time.perf_counter()
                    t_first = t_last if n == 0 else t_first
                    n += 1
                    if n >= args.n:
                        break
                q = (len(toks) / (t1 - t0), (n - 1) / (t_last - t_first))
        ratios["prefill"].append(c[0] / q[0])
        ratios["decode"].append(c[1] / q[1])
        print(f"  in-process round {i + 1}: prefill ratio {ratios['prefill'][-1]:.3f}, "
              f"decode ratio {ratios['decode'][-1]:.3f}", flush=True)
    llm.close()
    print(f"in-process (one model, same process): prefill ratio {statistics.median(ratios['prefill']):.3f}, "
          f"decode ratio {statistics.median(ratios['decode']):.3f} (medians of paired rounds)")


def ctxq_side(args, text_file: str) -> dict:
    exe = Path(sys.executable).with_name("ctxq")
    r = subprocess.run([str(exe), "run", args.model, "-f", text_file, "-c", str(args.ctx), "--kv", args.kv,
                        "-n", str(args.n), "--temp", "0", "-t", str(args.threads)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"ctxq run failed: {r.stderr.strip()[-500:]}")
    m = re.search(r"prompt ([\d,]+) tokens: prefill ([\d.]+) s \(([\d.]+) tok/s\).*?generated (\d+) tokens "
                  r"\(([\d.]+) tok/s", r.stderr, re.S)
    return {"n_prompt": int(m.group(1).replace(",", "")), "n_generated": int(m.group(4)),
            "prefill_tps": float(m.group(3)), "decode_tps": float(m.group(5))}


def plain_side(args, text_file: str, kwargs: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--plain-worker", args.model, text_file, json.dumps(kwargs),
                        str(args.n)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"plain llama_cpp run failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def long_context(n_tokens: int) -> int:
    """`ctxq run` of the tiny random model with an n_tokens file at --ctx 65536, q8_0 cache; 1 if a claim failed."""
    from ctxq.testing.models import tiny_chat_llama_gguf

    with tempfile.TemporaryDirectory(prefix="ctxq-bench-long-") as tmp:
        model = str(tiny_chat_llama_gguf(Path(tmp) / "tiny-chat.gguf"))
        text, n = make_text(model, n_tokens)
        f = Path(tmp) / "long.txt"
        f.write_text(text)
        exe = Path(sys.executable).with_name("ctxq")
        t0 = time.perf_counter()
        r = subprocess.run([str(exe), "run", model, "-f", str(f), "-c", "65536", "-ctk", "q8_0", "-ctv", "q8_0",
                            "-n", "16", "--seed", "1"], capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    m = re.search(r"prompt ([\d,]+) tokens: prefill ([\d.]+) s", r.stderr)
    held = {"the run ends with 0": r.returncode == 0,
            "-c 65536 and -ctk q8_0 -ctv q8_0 on the command line": "-c 65536" in r.stderr
            and "-ctk q8_0 -ctv q8_0" in r.stderr,
            f"the progress bar reaches {n}/{n}": f"{n}/{n} tokens" in r.stderr,
            f"the prompt line counts {n} tokens": bool(m) and int(m.group(1).replace(",", "")) == n,
            "an answer is printed": bool(r.stdout.strip())}
    print(f"tiny random model (2 layers, 64 wide), {n:,}-token file, --ctx 65536, q8_0 cache, CPU: "
          f"prefill {m.group(2) if m else '?'} s, the command {seconds:.1f} s")
    if r.returncode:
        print(r.stderr[-2000:])
    failed = [what for what, ok in held.items() if not ok]
    for what in failed:
        print(f"CLAIM FAILED: {what}", flush=True)
    return 1 if failed else 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--plain-worker":
        plain_worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    if "--long" in sys.argv[1:]:
        ap = argparse.ArgumentParser(description="the long-context path (see the docstring)")
        ap.add_argument("--long", action="store_true")
        ap.add_argument("--long-tokens", type=int, default=60_000)
        sys.exit(long_context(ap.parse_args().long_tokens))
    from ctxq.models import resolve_model
    from ctxq.runtime.runner import llama_params, make_plan

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length in tokens")
    ap.add_argument("-n", type=int, default=64, help="tokens to generate")
    ap.add_argument("--kv", default="q8_0")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both sides (default: ctxq's)")
    args = ap.parse_args()
    args.model = str(resolve_model(args.model))
    text, n = make_text(args.model, args.tokens)
    kwargs = llama_params(make_plan(args.model, args.ctx, kv=args.kv), n_threads=args.threads)
    args.threads = kwargs["n_threads"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    print(f"model {Path(args.model).name}, context {args.ctx}, KV {args.kv}, prompt {n} tokens, {args.n} generated, "
          f"threads {kwargs['n_threads']}, {args.repeats} alternating rounds")
    res = {"ctxq": [], "plain": []}
    for i in range(args.repeats):
        order = ["ctxq", "plain"] if i % 2 == 0 else ["plain", "ctxq"]
        for side in order:
            r = ctxq_side(args, f.name) if side == "ctxq" else plain_side(args, f.name, kwargs)
            res[side].append(r)
            print(f"  round {i + 1} {side:5s}: prefill {r['prefill_tps']:8.1f} tok/s, decode {r['decode_tps']:6.2f} "
                  f"tok/s ({r['n_prompt']} prompt, {r['n_generated']} generated)", flush=True)
    Path(f.name).unlink()
    if {r["n_prompt"] for s in res.values() for r in s} != {n}:
        print("warning: the two sides saw different prompt lengths")
    # On a shared machine the load drifts between rounds: the median of each round's paired ratio
    # (two runs seconds apart) is steadier than the ratio of the medians; both are shown.
    print(f"\n{'':8s}{'ctxq run':>12s}{'plain Llama':>14s}{'ratio':>8s}{'paired':>9s}")
    for key, label in (("prefill_tps", "prefill"), ("decode_tps", "decode")):
        a = statistics.median(r[key] for r in res["ctxq"])
        b = statistics.median(r[key] for r in res["plain"])
        paired = statistics.median(x[key] / y[key] for x, y in zip(res["ctxq"], res["plain"]) if y[key])
        print(f"{label:8s}{a:12.2f}{b:14.2f}{a / b:8.3f}{paired:9.3f}   (tok/s medians; target ratio >= 0.99)")
    print()
    in_process(args, text, max(args.repeats, 4))


if __name__ == "__main__":
    main()
