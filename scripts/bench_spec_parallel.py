"""`bench_spec.py --parallel P`: P clients asking about one document together on ctxq's engine, `--spec auto` against
off (issue 63).

For each workload P different prompts (quotes of P passages, P summaries, P answers in own words) are submitted at
once to an engine whose document is already resident (read once before the runs, as `ctxq serve --parallel` holds it
after its first request); the wall time until the last answer gives the aggregate tok/s. off and auto alternate
`--reps` times on two engines over the same model. Every answer is compared with the same prompt asked alone, without
drafts (greedy): where it differs, the first differing token and how far apart the two tokens' logits are there
(the single-sequence logits of the text before it), for off asked together too: batch composition alone moves
near-ties.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ctxq.runtime.engine import Engine, SamplingParams
from ctxq.runtime.generate import input_tokens

QUOTE_LEAD = "\n\nA passage quoted from the text above:\n\n"
ANCHORS = ("The GNU General Public License is a free", "When we speak of free", "To protect your rights",
           "For example, if you distribute", "Developers that use the GNU GPL", "Some devices are designed")
SUMMARIES = ("Summarize the text above in a few sentences.", "Give a short summary of the text above.",
             "What are the main points of the text above? Answer briefly.",
             "Summarize the preamble of the license above.", "Summarize the text above for a software developer.",
             "Summarize the text above in three sentences.")
OWN_WORDS = ("In your own words: why would someone choose this license? Answer in a short paragraph.",
             "In your own words: what does this license protect? Answer in a short paragraph.",
             "In your own words: what must someone who distributes the software do? Answer briefly.",
             "In your own words: who wrote this license and why? Answer briefly.",
             "In your own words: what is free software? Answer in a short paragraph.",
             "In your own words: why does the license talk about patents? Answer briefly.")


def prompts(llm, doc: str, workload: str, p: int) -> list[list[int]]:
    if workload == "quote":  # a plain completion led into each passage's first words (chat paraphrases)
        out = []
        for a in ANCHORS[:p]:
            at = doc.index(a)
            out.append(llm.tokenize((doc + QUOTE_LEAD + doc[at:at + 80].rsplit(" ", 1)[0]).encode("utf-8")))
        return out
    qs = SUMMARIES if workload == "summary" else OWN_WORDS
    return [input_tokens(llm.model_path, q, document=doc, chat=True)[0] for q in qs[:p]]


def _shared(toks: list[list[int]]) -> int:
    n = min(len(t) for t in toks) - 1
    for t in toks[1:]:
        n = next((i for i in range(n) if t[i] != toks[0][i]), n)
    return n


def _gap(llm, keep: int, prompt: list[int], plain: list[int], got: list[int]) -> tuple[int | None, float]:
    """The first token where `got` leaves `plain`, and the two tokens' logit gap there (single sequence)."""
    j = next((i for i, (a, b) in enumerate(zip(plain, got)) if a != b), None)
    if j is None:
        return None, 0.0
    llm.n_tokens = keep  # the document stays in the Llama's cache between calls
    llm.eval(prompt[keep:] + plain[:j])
    lg = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    return j, abs(float(lg[plain[j]] - lg[got[j]]))


def run(llm, doc: str, cost: dict, ps: list[int], workloads: list[str], n_predict: int, reps: int) -> list[tuple]:
    """Rows (P, workload, off tok/s, auto tok/s, each rep's ratio, auto's drafted / accepted, texts)."""
    rows = []
    greedy = SamplingParams(max_tokens=n_predict, temperature=0)
    for p in ps:
        with Engine(llm, n_seq_max=p + 1, spec="off") as off, \
                Engine(llm, n_seq_max=p + 1, spec="auto", spec_cost=cost) as auto:
            for w in workloads:
                toks = prompts(llm, doc, w, p)
                keep = _shared(toks)
                for e in (off, auto):
                    e.prefill(toks[0][:keep]).result()
                llm.reset()
                llm.eval(toks[0][:keep])
                best, ratios, res = {}, [], {}
                for _ in range(reps):
                    for name, e in (("off", off), ("auto", auto)):
                        t0 = time.perf_counter()
                        got = [r.result() for r in e.submit_all(toks, greedy, share_limit=keep)]
                        dt = time.perf_counter() - t0
                        tps = sum(g.completion_tokens for g in got) / dt
                        if name == "auto":
                            ratios.append(tps / last_off)
                        last_off = tps if name == "off" else last_off
                        best[name] = max(best.get(name, 0.0), tps)
                        res[name] = got
                # each prompt alone, without drafts: the text to match
                alone = [off.submit(t, greedy).result() for t in toks]
                plain = [llm.tokenize(a.text.encode(), add_bos=False, special=True) for a in alone]
                texts = {}
                for name in ("off", "auto"):
                    diffs = []
                    for t, pl, a, g in zip(toks, plain, alone, res[name]):
                        if g.text != a.text:
                            gt = llm.tokenize(g.text.encode(), add_bos=False, special=True)
                            diffs.append(_gap(llm, keep, t, pl, gt))
                    texts[name] = diffs
                drafted = sum(g.draft_n for g in res["auto"])
                accepted = sum(g.draft_n_accepted for g in res["auto"])
                rows.append((p, w, best["off"], best["auto"], ratios, drafted, accepted, texts,
                             sum(g.completion_tokens for g in res["off"])))
                print(f"# --parallel {p} {w}: each rep's ratio auto/off "
                      + " ".join(f"{r:.2f}" for r in ratios) + f" (median {statistics.median(ratios):.2f})",
                      flush=True)
    return rows


def table(rows: list[tuple], tie_bound: float) -> None:
    print("| clients | workload | generated | off tok/s | auto tok/s | auto ratio (best) | median of reps | "
          "auto drafted / accepted | off together = alone | auto together = alone |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---|")
    for p, w, off, auto, ratios, drafted, accepted, texts, n in rows:
        def said(diffs):
            if not diffs:
                return f"{p} of {p}"
            return f"{p - len(diffs)} of {p}; " + ", ".join(
                f"token {j}, logits {gap:.3f} apart" + ("" if gap < tie_bound else " (NOT a near-tie)")
                for j, gap in diffs)
        print(f"| {p} | {w} | {n} | {off:.2f} | {auto:.2f} | {auto / off:.2f}x | {statistics.median(ratios):.2f}x | "
              f"{drafted} / {accepted} | {said(texts['off'])} | {said(texts['auto'])} |")
