"""Decode speed with and without drafts from the context (issue 55), in one run, on a long document.

    .venv/bin/python scripts/bench_spec.py [--chars 16000] [-n 128] [--reps 2] [--parallel 2 --parallel 4]

Three workloads over the same document (the built-in licences text, the first --chars characters, a few thousand
tokens): a verbatim quote, a summary, an answer in the model's own words. Each is generated greedily with --spec off,
ngram and auto, `--reps` times interleaved (a shared machine's slow moments fall on all three alike), each from the
same cache (the document evaluated once, its last token alone before every run, so every run reads the same
logits first), and the best decode tok/s of each is kept. auto uses the cost of a draft's batch measured first at
the document's depth (`runtime.bench.spec_cost`, what `ctxq bench --spec` keeps). Prints decode tok/s, tokens per
pass, acceptance and the ratios to off, and whether the text equals off's: where not, the first token that
differs and how far apart the two tokens' logits are there (a near-tie under 1.0, the greedy test's bound).
`--parallel P` (repeatable) adds P clients asking together on ctxq's engine, auto against off
(`bench_spec_parallel.py`); `--no-single` leaves the one-sequence runs out.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import time
from importlib.resources import files

import ctxq
from ctxq.runtime import speculative
from ctxq.runtime.bench import spec_cost
from ctxq.runtime.generate import generate, input_tokens

# The quote is a plain completion: asked in a chat turn, SmolLM2-135M paraphrases instead of quoting (1.4 tokens
# per pass); led into the Preamble's first words it goes on with the document's text.
QUOTE_LEAD = "\n\nThe Preamble, quoted from the text above:\n\n"
TIE_BOUND = 1.0  # logits: where a batch's kernels may rank two tokens otherwise than a single token's (the greedy test's)
WORKLOADS = {
    "quote": None,
    "summary": "Summarize the text above in a few sentences.",
    "own words": "In your own words: why would someone choose this license? Answer in a short paragraph.",
}


def quote_prompt(llm, doc: str) -> list[int]:
    at = doc.index("The GNU General Public License is a free")
    lead = doc[at:at + 80].rsplit(" ", 1)[0]  # ends at a word
    return llm.tokenize((doc + QUOTE_LEAD + lead).encode("utf-8"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=16000, help="characters of the built-in text (licences)")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS), help="only these (default: all three)")
    ap.add_argument("--parallel", type=int, action="append", default=[],
                    help="also P clients together on the engine (repeatable: --parallel 2 --parallel 4)")
    ap.add_argument("--no-single", action="store_true", help="only the --parallel runs")
    ap.add_argument("--default-cost", action="store_true",
                    help="auto drafts with speculative.DEFAULT_COST (a quiet machine's curve) instead of measuring one "
                         "first: on a loaded machine the measurement itself is noise")
    a = ap.parse_args()
    with gzip.open(str(files("ctxq.quality").joinpath("licences.txt.gz")), "rt") as f:
        doc = f.read()[:a.chars]
    llm = ctxq.load(n_ctx=8192, spec="off", n_threads=a.threads)
    prompts = {w: input_tokens(llm.model_path, q, document=doc, chat=True)[0] if q else quote_prompt(llm, doc)
               for w, q in WORKLOADS.items() if not a.workload or w in a.workload}
    depth = max(len(t) for t in prompts.values())
    t0 = time.perf_counter()
    cost = dict(speculative.DEFAULT_COST) if a.default_cost else spec_cost(llm, depth, 8)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, SmolLM2-135M-Instruct Q4_1, {llm.ctxq_plan.llama_flags()}, "
          f"{a.threads or 'default'} threads, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    how = "speculative.DEFAULT_COST" if a.default_cost else f"measured in {time.perf_counter() - t0:.0f} s"
    print(f"# a draft's batch of n tokens against one, at depth {depth} ({how}): "
          + ", ".join(f"{n}: {c:.2f}" for n, c in cost.items()))
    rows = []
    for w, toks in ({} if a.no_single else prompts).items():
        llm.reset()
        speculative.attach(llm, "off")
        llm.eval(toks[:-1])  # the document once; every run evaluates its last token alone, so all start alike
        best: dict[str, object] = {}
        paired: dict[str, list[float]] = {"ngram": [], "auto": []}  # each rep's ratio to the off run just before
        for _ in range(a.reps):
            for mode in ("off", "ngram", "auto"):
                speculative.attach(llm, mode, cost if mode == "auto" else None, cost_source="measured")
                llm.n_tokens = len(toks) - 1
                r = generate(llm, toks, n_predict=a.n_predict, temp=0, n_cached=len(toks) - 1)
                if mode == "off":
                    last_off = r.decode_tps
                else:
                    paired[mode].append(r.decode_tps / last_off)
                if mode not in best or r.decode_tps > best[mode].decode_tps:
                    best[mode] = r
        off = best["off"]
        ties = {m: _tie(llm, toks, off.tokens, best[m].tokens) for m in ("ngram", "auto")}
        rows.append((w, len(toks), off, best["ngram"], best["auto"], ties))
        print(f"# {w}: {off.text[:100]!r}; each rep's ratio to its off run: "
              + "; ".join(f"{m} " + " ".join(f"{x:.2f}" for x in v) + f" (median {statistics.median(v):.2f})"
                          for m, v in paired.items()), flush=True)
    speculative.detach(llm)
    together = []
    if a.parallel:
        import bench_spec_parallel as par

        together = par.run(llm, doc, cost, a.parallel, list(prompts), a.n_predict, a.reps)
    llm.close()
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    if together:
        print()
        par.table(together, TIE_BOUND)
    if not rows:
        return
    print()
    # "at c(n)": the ratio the passes made would give if each cost what the cost line says (`_modeled`): what the
    # drafts are worth, whatever else ran on the machine
    print("| workload | prompt tokens | generated | off tok/s | ngram tok/s | ngram ratio | ngram at c(n) | "
          "ngram tokens/pass | ngram acceptance | auto tok/s | auto ratio | auto at c(n) | auto tokens/pass | same text |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for w, n, off, ng, au, ties in rows:
        same = "; ".join(f"{m}: token {j}, the two best logits {gap:.3f} apart"
                         + ("" if gap < TIE_BOUND else f" (NOT a near-tie: bound {TIE_BOUND})")
                         for m, (j, gap) in ties.items() if j is not None) or "yes"
        print(f"| {w} | {n:,} | {off.n_generated} | {off.decode_tps:.2f} | {ng.decode_tps:.2f} | "
              f"{ng.decode_tps / off.decode_tps:.2f}x | {_modeled(ng):.2f}x | {ng.tokens_per_pass:.2f} | "
              f"{100 * ng.spec['acceptance']:.0f} % | {au.decode_tps:.2f} | {au.decode_tps / off.decode_tps:.2f}x | "
              f"{_modeled(au):.2f}x | {au.tokens_per_pass:.2f} | {same} |")


def _tie(llm, toks: list[int], plain: list[int], got: list[int]) -> tuple[int | None, float]:
    """Where `got` first differs from decoding without drafts (`plain`), and how far apart the two tokens' logits are
    there, recomputed from the cached document (None, 0: the same text): the near-tie the greedy test bounds."""
    j = next((i for i, (a, b) in enumerate(zip(plain, got)) if a != b), None)
    if j is None:
        return None, 0.0
    import numpy as np

    speculative.attach(llm, "off")
    llm.n_tokens = len(toks) - 1
    llm.eval(toks[-1:] + plain[:j])
    lg = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    return j, abs(float(lg[plain[j]] - lg[got[j]]))


def _modeled(r) -> float:
    """The single-token passes plain decoding takes for this output (n - 1, and one more that samples the end of
    generation) against the cost of the passes made, each c(k + 1) by the drafter's cost curve."""
    cost = r.spec.get("cost") if r.spec else None
    return (r.n_generated - 1 + (r.stop == "eos")) / cost if cost else 1.0

if __name__ == "__main__":
    main()
