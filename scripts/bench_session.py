"""Time to first token with a saved session against a full prefill (issue 17; target: <= 5 %).

Two inputs, each a document followed by a question (`-f doc --chat -p question`):

- `tiny`: a 2-layer, 64-wide model made in code (SmolLM2's tokenizer and chat template, random
  weights) with a ~60k-token document at n_ctx 65536, q8_0 KV;
- `smollm2`: SmolLM2-135M-Instruct with a ~4k-token document at n_ctx 8192, q8_0 KV; its answer
  after a fresh prefill (no session) and after a restored session are compared (greedy).

For each: run 1 prefills the document and saves the session, run 2 (a new load) restores it and
evaluates only the question. Time to first token counts from the end of the model's load: the
prefill (and the save) in run 1, the session's restore and the question in run 2.

    .venv/bin/python scripts/bench_session.py [--only tiny|smollm2] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from ctxq.models import fetch_default_model
from ctxq.runtime import runner
from ctxq.testing.models import tiny_chat_llama_gguf

TARGET = 0.05
QUESTION = "Which city does the text mention first?"
WORDS = ("the of and to in is was for on that with as by at from which an be this are have it not river mountain "
         "city library window garden morning evening letter story journey question answer market silver green "
         "quiet ancient bright narrow distant simple careful sudden gentle heavy Paris Lisbon Oslo").split()


def document(model, n_tokens: int) -> str:
    """English-looking sentences of about n_tokens tokens (within 2 %)."""
    rng = random.Random(0)
    sents = [" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "." for _ in range(n_tokens // 12)]
    for _ in range(4):
        n = len(runner.tokenize(model, " ".join(sents)))
        if abs(n - n_tokens) <= 0.02 * n_tokens:
            break
        sents = (sents * 2)[:max(1, int(len(sents) * n_tokens / n))]
    return " ".join(sents)


def bench(name: str, model: Path, n_doc: int, n_ctx: int, threads: int | None, compare: bool) -> dict:
    doc = document(model, n_doc)
    kw = dict(document=doc, chat=True, temp=0, n_predict=16, seed=1, n_ctx=n_ctx, kv="q8_0", n_threads=threads)
    path = Path(tempfile.mkdtemp(prefix="ctxq-bench-session-")) / f"{name}.kv"
    fresh = runner.run(model, QUESTION, **kw) if compare else None
    t = time.perf_counter()
    first = runner.run(model, QUESTION, session=path, **kw)
    first_wall = time.perf_counter() - t
    t = time.perf_counter()
    second = runner.run(model, QUESTION, session=path, **kw)
    second_wall = time.perf_counter() - t
    ratio = second.ttft_s / first.ttft_s
    print(f"\n{name}: {Path(model).name}, {first.n_prompt:,}-token input ({second.n_cached:,} restored), "
          f"n_ctx {n_ctx:,}, q8_0 KV, session {path.stat().st_size / 2**20:,.1f} MiB")
    print(f"  {'':<34}{'TTFT s':>10}{'prefill s':>11}{'wall s':>9}")
    print(f"  {'run 1: prefill + save':<34}{first.ttft_s:>10.2f}{first.prefill_s:>11.2f}{first_wall:>9.2f}")
    print(f"  {'run 2: restore + question':<34}{second.ttft_s:>10.3f}{second.prefill_s:>11.3f}{second_wall:>9.2f}")
    print(f"  ratio run 2 / run 1: {ratio:.4f} ({ratio * 100:.2f} %, target <= {TARGET * 100:.0f} %: "
          f"{'met' if ratio <= TARGET else 'NOT met'})")
    same = first.tokens == second.tokens and (fresh is None or fresh.tokens == second.tokens)
    print(f"  greedy answers identical (fresh{'' if compare else ' not run'}, saved, restored): {same}")
    if fresh is not None:
        print(f"  fresh prefill TTFT {fresh.ttft_s:.2f} s; answer: {second.text.strip()!r}")
    return {"ratio": ratio, "same": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tiny", "smollm2"])
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.only != "smollm2":
        tiny = tiny_chat_llama_gguf(Path(tempfile.mkdtemp(prefix="ctxq-bench-tiny-")) / "tiny-chat.gguf")
        bench("tiny", tiny, 60_000, 65536, a.threads, compare=False)
    if a.only != "tiny":
        bench("smollm2", fetch_default_model(), 4_000, 8192, a.threads, compare=True)


if __name__ == "__main__":
    main()
