"""The child process of a quality measurement: `python -m ctxq.quality.worker` (llama.cpp asserts instead of
returning errors, so whatever can abort runs here, never in ctxq's own process).

It reads one job (JSON) on stdin, loads the plan it names (`runtime.runner.load_plan`: the split, the KV types,
experts in CPU memory), evaluates the tokens once in order, asking llama.cpp for logits only at the scored
positions, and writes what the parent needs to `out` (an .npz): for the reference, its compact distributions
(`stats.Compact`); for a candidate, its per-position scores against the reference given. Progress goes to stdout
as `progress DONE TOTAL` lines; llama.cpp's own log goes to stderr, which the parent keeps in a file.

Job: {"plan": pickled Plan file, "tokens": .npy or null, "text": file or null, "n_tokens": N,
"score_from": first scored position, "reference": .npz or null, "top_k": k, "out": .npz, "threads": n}.
With "text" the worker tokenizes it (BOS first) and keeps the first N tokens; with "tokens" as well it checks
that the text gives those tokens under this model's vocabulary (the same model at another precision).
"""

from __future__ import annotations

import json
import pickle
import sys

import numpy as np

ROWS = 128  # rows of logits turned into log-probabilities at once: 128 x vocab float64 (48 MiB at 49k)


class JobError(Exception):
    """Bad input the parent reports in one line (the message goes to `out`'s .json beside it)."""


def _tokens(llm, job: dict) -> np.ndarray:
    if job.get("text") is None:
        return np.load(job["tokens"])
    with open(job["text"], "rb") as f:
        text = f.read()
    toks = np.asarray(llm.tokenize(text, add_bos=True, special=False), dtype=np.int32)
    n = job["n_tokens"]
    if len(toks) < n:
        raise JobError(f"the text is {len(toks):,} tokens under this model's vocabulary, shorter than the "
                       f"{n:,}-token context to measure: give a longer text (-f FILE) or a smaller context")
    toks = toks[:n]
    if job.get("tokens") is not None and not np.array_equal(toks, np.load(job["tokens"])):
        raise JobError("this model splits the text into other tokens than the reference does: they are not the "
                       "same model (another vocabulary)")
    return toks


def _evaluate(llm, lc, toks: np.ndarray, score_from: int, on_rows, stage: str) -> None:
    """Decode `toks` in order, in batches of n_batch; for the positions from `score_from` on (each predicts the
    next token), hand their logits to on_rows(first_position, rows) in chunks. `stage`: its name for the tests'
    hook (`ctxq.stages`), reached after the first batch."""
    from ..stages import reached

    ctx, n_vocab = llm.ctx, llm.n_vocab()
    n_batch = llm.n_batch
    batch = lc.llama_batch_init(n_batch, 0, 1)
    try:
        for i in range(n_batch):
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
        n = len(toks)
        last = n - 1  # the last token predicts nothing in the text
        for b0 in range(0, n, n_batch):
            b1 = min(n, b0 + n_batch)
            m = b1 - b0
            batch.n_tokens = m
            np.ctypeslib.as_array(batch.token, shape=(n_batch,))[:m] = toks[b0:b1]
            np.ctypeslib.as_array(batch.pos, shape=(n_batch,))[:m] = np.arange(b0, b1, dtype=np.int32)
            flags = (np.arange(b0, b1) >= score_from) & (np.arange(b0, b1) < last)
            np.ctypeslib.as_array(batch.logits, shape=(n_batch,))[:m] = flags.astype(np.int8)
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise JobError(f"llama_decode returned {rc} at position {b0}")
            k = int(flags.sum())
            if k:
                first = b0 + int(np.argmax(flags))
                logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(k * n_vocab,)).reshape(k, n_vocab)
                for r in range(0, k, ROWS):
                    on_rows(first + r, logits[r:r + ROWS])
            print(f"progress {b1} {n}", flush=True)
            if b0 == 0:
                reached(stage)
    finally:
        lc.llama_batch_free(batch)


def run(job: dict) -> dict:
    import llama_cpp as lc

    from ..runtime.runner import load_plan
    from . import stats

    with open(job["plan"], "rb") as f:
        plan = pickle.load(f)
    llm, _memory, _ = load_plan(plan, n_threads=job.get("threads"))
    try:
        toks = _tokens(llm, job)
        score_from = job["score_from"]
        ref = None
        if job.get("reference"):
            with np.load(job["reference"]) as z:
                ref = stats.Compact(*(z[f] for f in stats.Compact.FIELDS))
        parts: list = []

        def on_rows(pos: int, rows: np.ndarray) -> None:
            lp = stats.log_softmax(rows)
            targets = toks[pos + 1:pos + 1 + len(rows)]
            if ref is None:
                parts.append(stats.Compact.of(lp, targets, job["top_k"], seed=pos))
            else:
                i = pos - score_from
                parts.append(stats.score(ref.rows(i, i + len(rows)), lp, targets))

        _evaluate(llm, lc, toks, score_from, on_rows, "reference" if ref is None else "candidate")
    finally:
        llm.close()
    arrays = (stats.Compact if ref is None else stats.Scores).concat(parts).__dict__
    with open(job["out"], "wb") as f:
        np.savez(f, tokens=toks, **arrays)
    return {"n_tokens": int(len(toks))}


def main() -> int:
    from ..children import watch_parent
    from ..errors import CtxqError

    watch_parent()  # ctxq killed: stop at once rather than compute for nobody
    job = json.loads(sys.stdin.read())
    try:
        result = run(job)
    except (JobError, CtxqError) as e:  # bad input and failed loads: one line in the parent
        result = {"error": str(e)}
    with open(job["out"] + ".json", "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 2


if __name__ == "__main__":
    sys.exit(main())
