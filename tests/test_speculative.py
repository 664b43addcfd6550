"""Drafts from the context verified in one batch (issue 55): greedy text as without drafts (or a recorded near-tie),
the sampling distribution unchanged (chi-square against the exact distribution), grammar output valid, the KV
cache after a rejection as if the rejected tokens had never been evaluated, and recurrent memory left alone."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import ctxq
from ctxq.runtime import speculative as S
from ctxq.runtime.generate import generate, input_tokens

from .conftest import run_ctxq

# A batch of n >= 2 tokens and one token take different CPU kernels: the same position's logits differed by up to
# 0.85 (SmolLM2-135M Q4_1, this project's CPU, 16 positions of the licences text). Greedy text with drafts may thus
# leave the text without them only where the two best tokens are closer than this.
TIE_BOUND = 1.0
SIGNIFICANCE = 1e-3  # of the chi-square tests: seeds are fixed, so a pass or a failure is reproducible

FOX = "The quick brown fox jumps over the lazy dog. "
ALICE = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
         "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
         "in it.")
RECORDS = "Name: Ada Lovelace. Born: 1815. Known for: the first computer program.\n" \
          "Name: Alan Turing. Born: 1912. Known for: the Turing machine.\n"
PROMPTS = [  # (document, question), as one chat turn
    (ALICE, "Repeat the text above exactly."),
    (FOX * 2, "Repeat the sentence above twice."),
    (RECORDS, "Copy the second record exactly."),
    (ALICE, "Who is Alice sitting with?"),
]


@pytest.fixture(scope="module")
def llm(smollm2):
    m = ctxq.load(smollm2, n_ctx=1024, kv="f16", spec="off")
    yield m
    m.close()


def _logits(llm) -> np.ndarray:
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).copy()


def test_greedy_text_equals_decoding_without_drafts_or_a_recorded_tie(llm):
    ties, same, drafted, accepted = [], 0, 0, 0
    for doc, question in PROMPTS:
        toks, _ = input_tokens(llm.model_path, question, document=doc, chat=True)
        S.attach(llm, "off")
        plain = generate(llm, toks, n_predict=24, temp=0).tokens
        S.attach(llm, "ngram")
        r = generate(llm, toks, n_predict=24, temp=0)
        drafted, accepted = drafted + r.spec["drafted"], accepted + r.spec["accepted"]
        S.attach(llm, "off")
        j = next((i for i, (a, b) in enumerate(zip(plain, r.tokens)) if a != b), None)
        if j is None:
            assert r.tokens == plain
            same += 1
            continue
        llm.reset()
        llm.eval(toks + plain[:j])  # the logits decoding without drafts chose from
        lg = _logits(llm)
        gap = abs(float(lg[plain[j]] - lg[r.tokens[j]]))
        ties.append((question, j, gap))
        assert gap < TIE_BOUND, f"{question!r}: differs at token {j} where the two best logits are {gap:.3f} apart"
    print(f"greedy: {same} of {len(PROMPTS)} identical; near-ties {ties}; {accepted} of {drafted} drafted accepted")
    assert same >= len(PROMPTS) - 2
    assert accepted >= 10 and drafted > accepted  # drafts were taken and some were rejected (rolled back)


def test_cache_after_a_rejection_equals_one_that_never_saw_the_draft(llm):
    toks = llm.tokenize((FOX * 2).encode())
    y, w = llm.tokenize(b" The", add_bos=False)[0], llm.tokenize(b" cat", add_bos=False)[0]

    def after(draft, rollback=True):
        S.attach(llm, "ngram")
        llm.reset()
        llm.eval(toks)
        llm.ctxq_spec.drafter.pending = True  # the loop's state after handing out a draft
        llm.eval([y] + draft)  # one llama_decode, logits at each position
        # the draft rejected at its first token, as Llama.generate does; without the rollback, as if it kept one
        llm.n_tokens = len(toks) + (1 if rollback else 2)
        llm.eval([w])  # removes cells from n_tokens on (llama_memory_seq_rm), then decodes
        out = _logits(llm)
        S.attach(llm, "off")
        return out

    a = after(llm.tokenize(b" quick brown fox", add_bos=False))
    b = after(llm.tokenize(b" slow red hen", add_bos=False))
    assert np.array_equal(a, b)  # two different rejected drafts leave exactly the same cache
    llm.reset()
    llm.eval(toks)
    llm.eval([y])
    llm.eval([w])
    fresh = _logits(llm)  # never saw a draft (y decoded alone: the single-token kernels, TIE_BOUND's deviation)
    stale = after(llm.tokenize(b" quick brown fox", add_bos=False), rollback=False)
    near, far = np.abs(a - fresh).max(), np.abs(stale - fresh).max()
    assert int(np.argmax(a)) == int(np.argmax(fresh)) and near < TIE_BOUND
    assert far > 3 * near  # the same comparison sees a rejected cell left in the cache


def _filtered(logits: np.ndarray, top_k: int, temp: float) -> np.ndarray:
    """The target distribution of llama.cpp's chain top-k -> temperature -> dist (top_p 1, min_p 0)."""
    keep = np.argsort(logits)[::-1][:top_k]
    z = logits[keep].astype(np.float64) / temp  # in float64: numpy's choice wants p to sum to 1 within 1e-8
    p = np.exp(z - z.max())
    out = np.zeros_like(logits, dtype=np.float64)
    out[keep] = p / p.sum()
    return out


def _chi2_sf(x: float, k: int) -> float:
    """P(X > x) for X chi-square with k degrees of freedom: the regularized upper incomplete gamma Q(k/2, x/2)
    (its series below a + 1, its continued fraction above: Numerical Recipes' gammq)."""
    a, x = k / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    lg = math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - lg))
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
    return math.exp(-x + a * math.log(x) - lg) * h


def _chi2_p(counts: dict[int, int], p: np.ndarray) -> float:
    """The p-value of observed counts against p, categories with fewer than 5 expected pooled (Pearson)."""
    n = sum(counts.values())
    order = np.argsort(p)[::-1]
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for t in order:
        if p[t] * n >= 5:
            obs.append(counts.get(int(t), 0))
            exp.append(p[t] * n)
        else:
            pool_o += counts.get(int(t), 0)
            pool_e += p[t] * n
    obs.append(pool_o)
    exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return _chi2_sf(stat, len(obs) - 1)


def test_sampling_with_drafts_keeps_the_distribution(llm):
    """The token after a near-certain first one is drawn at a draft position; over seeds its frequencies must
    match the exact target (top-k, temperature) and so must the next token's after an accepted draft."""
    top_k, temp, n = 12, 1.6, 200
    prompt = llm.tokenize((FOX * 3 + "The quick brown fox jumps over the lazy").encode())
    dog = llm.tokenize(b" dog", add_bos=False)[0]
    S.attach(llm, "off")
    llm.reset()
    llm.eval(prompt + [dog])
    p2 = _filtered(_logits(llm), top_k, temp)
    draft = llm.tokenize(b".", add_bos=False)[0]
    assert 0.15 < p2[draft] < 0.85, p2[draft]  # the draft token is far from certain: a wrong rule shows
    llm.eval([draft])
    p3 = _filtered(_logits(llm), top_k, temp)
    S.attach(llm, "ngram")
    second, third, drafted = {}, {}, 0
    for seed in range(n):
        llm.set_seed(seed)
        out = []
        for t in llm.generate(prompt, temp=temp, top_k=top_k, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(t)
            if len(out) == 3:
                break
        if out[0] != dog:
            continue
        drafted += llm.ctxq_spec.stats.drafted > 0
        second[out[1]] = second.get(out[1], 0) + 1
        if out[1] == draft:
            third[out[2]] = third.get(out[2], 0) + 1
    S.attach(llm, "off")
    assert drafted == sum(second.values())  # every second token counted was drawn at a draft position
    assert sum(second.values()) > 0.8 * n and sum(third.values()) > 30
    p_second, p_third = _chi2_p(second, p2), _chi2_p(third, p3)
    print(f"chi-square p-values: second token {p_second:.3f} (n={sum(second.values())}, "
          f"p(draft)={p2[draft]:.3f}), third after acceptance {p_third:.3f} (n={sum(third.values())})")
    assert p_second > SIGNIFICANCE and p_third > SIGNIFICANCE
    # the same test rejects the classic mistake (accept with p(x), else draw again from all of p) at this n: in most
    # of 21 simulated samples (one seed alone can fall either side: seed 0 gave p = 0.0025)
    rng = np.random.default_rng(0)
    m = sum(second.values())
    wrongs = []
    for _ in range(21):
        wrong = np.where(rng.random(m) < p2[draft], draft, rng.choice(len(p2), size=m, p=p2))
        wrongs.append(_chi2_p(dict(zip(*np.unique(wrong, return_counts=True))), p2))
    assert float(np.median(wrongs)) < SIGNIFICANCE, wrongs


def test_json_schema_output_stays_valid_with_drafts(llm):
    from llama_cpp import LlamaGrammar

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    example = '{"name": "Alice Liddell", "age": 7}\n'
    prompt = "Records:\n" + example * 4 + "Another record, exactly like the ones above:\n"
    S.attach(llm, "ngram")
    drafted = accepted = 0
    for seed in range(3):
        out = llm.create_completion(prompt, grammar=grammar, max_tokens=48, temperature=0.7, seed=seed)
        doc = json.loads(out["choices"][0]["text"])
        assert isinstance(doc["name"], str) and isinstance(doc["age"], int)
        drafted += llm.ctxq_spec.stats.drafted
        accepted += llm.ctxq_spec.stats.accepted
    S.attach(llm, "off")
    assert accepted > 0 and drafted >= accepted


def test_recurrent_model_drafts_nothing_and_says_so_in_one_line(tmp_path):
    from ctxq.testing.hybrid_chat import tiny_chat_qwen35_gguf

    path = str(tiny_chat_qwen35_gguf(tmp_path / "chat-qwen35.gguf"))
    r = run_ctxq("run", path, "--ctx", "512", "-n", "8", "--temp", "0", "--spec", "ngram", "-p", FOX * 4)
    code, err = r.returncode, r.stderr
    assert code == 0, err
    lines = [l for l in err.splitlines() if "spec" in l]
    assert len(lines) == 1 and "recurrent state cannot drop" in lines[0], err
    assert "generated 8 tokens" in err


def test_run_reports_tokens_per_pass_and_refuses_an_unknown_mode(smollm2):
    r = run_ctxq("run", str(smollm2), "--ctx", "512", "-n", "24", "--temp", "0", "--spec", "ngram", "--chat",
                 "-p", FOX * 2 + "\nRepeat the sentence above twice.")
    code, err = r.returncode, r.stderr
    assert code == 0, err
    line = next(l for l in err.splitlines() if l.startswith("prompt "))
    tpp = float(line.split("spec ngram: ")[1].split(" tokens per pass")[0])
    assert tpp > 1.0 and "drafted accepted" in line
    r = run_ctxq("run", str(smollm2), "--ctx", "512", "--spec", "medusa", "-p", "hi")
    code, err = r.returncode, r.stderr
    assert code != 0 and "Traceback" not in err and "medusa" in err
    with pytest.raises(ctxq.CtxqError, match="spec must be one of"):
        ctxq.load(smollm2, n_ctx=512, spec="medusa")


def test_chi_square_tail_matches_known_values():
    assert math.isclose(_chi2_sf(3.841459, 1), 0.05, rel_tol=1e-4)
    assert math.isclose(_chi2_sf(18.307038, 10), 0.05, rel_tol=1e-4)
    assert math.isclose(_chi2_sf(2.0, 4), math.exp(-1) * 2, rel_tol=1e-6)  # k=4: e^(-x/2)(1 + x/2)


def test_a_cost_curve_and_agreement_steer_the_draft_length():
    cheap = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.3, 16: 1.6}
    linear = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}
    p = S.Policy(cheap, floor=0)
    p.observe(30, False)
    assert p.length() >= 8  # all agreed, batches nearly free: long drafts
    assert p.length(available=3) == 3  # never beyond the prediction
    q = S.Policy(linear, floor=0)
    q.observe(30, False)
    assert q.length() == 0  # a batch costs its tokens: no draft ever pays ...
    assert S.Policy(linear, floor=1).length() == 1  # ... but `ngram` drafts the cheapest, one token
    moderate = {1: 1.0, 2: 1.5, 4: 2.2, 8: 3.5, 16: 6.0}
    r = S.Policy(moderate, floor=0)
    for _ in range(10):
        r.observe(0, True)
    assert r.length() == 0  # the prediction keeps missing: auto stops drafting ...
    short = r.length
    for _ in range(6):
        r.observe(1, False)  # ... tokens generated one per pass that equal the prediction (nothing drafted)
    assert r.length() > 0 and r.streak == 6  # ... turn drafts back on
    r.observe(2, True)
    assert r.streak == 0 and short() <= 2
    assert math.isclose(S.cost_at(linear, 3), 3.0)


def _replay(prompt: list[int], out: list[int], draft) -> float:
    """The single-token passes `out` takes plain against the cost (DEFAULT_COST) of the passes drafting takes, when
    `draft(context)` drafts after each sampled token and a draft holds while it equals `out`."""
    pos, cost = 0, 0.0
    while pos < len(out):
        d = list(draft(np.array(prompt + out[:pos + 1], dtype=np.intc)))
        held = next((j for j, t in enumerate(d) if pos + 1 + j >= len(out) or out[pos + 1 + j] != t), len(d))
        cost += S.cost_at(S.DEFAULT_COST, len(d) + 1)
        pos += held + 1
    return len(out) / cost


def test_the_policy_replayed_on_real_answers_is_near_the_best_fixed_draft_length(llm):
    """Greedy answers of the model (a copy, an answer in its own words) replayed: `auto`'s lengths against every
    fixed length drafted from the same prediction, each pass at the measured curve's cost. On the 48-token copy auto
    gives up at most a fifth to the best fixed length in hindsight (its first tokens go one per pass while agreement
    builds: recorded 1.36x against 1.64x at 15); on prose, where long drafts lose (0.70x at 15), it stays near one
    token per pass (recorded 0.97x)."""
    from ctxq.runtime.ngram import ContextIndex

    def fixed(k):
        index = ContextIndex(S.N_GRAMS)
        return lambda ctx: (index.update(ctx), index.predict(ctx, k))[1]

    rates = {}
    for name, doc, question in (("copy", ALICE * 2, "Repeat the text above exactly."),
                                ("prose", ALICE, "What is the text above about? Answer in your own words.")):
        toks, _ = input_tokens(llm.model_path, question, document=doc, chat=True)
        S.attach(llm, "off")
        out = generate(llm, toks, n_predict=48, temp=0).tokens
        best = max(_replay(toks, out, fixed(k)) for k in (1, 2, 4, 8, 15))
        worst = min(_replay(toks, out, fixed(k)) for k in (1, 2, 4, 8, 15))
        rates[name] = (_replay(toks, out, S.Drafter("auto", S.DEFAULT_COST)), best, worst)
    print(rates)
    auto, best, _ = rates["copy"]
    assert best > 1.3 and auto >= 0.8 * best and auto > 1.25
    auto, best, worst = rates["prose"]
    assert worst < 0.8 and auto >= 0.95 and auto >= best - 0.02


def test_the_longest_indexed_match_gives_the_prediction():
    d = S.Drafter("ngram", S.DEFAULT_COST)
    head = list(range(1, 13))  # 12 tokens
    ctx = np.array(head + [100, 101] + [50, 10, 11, 12, 200, 201] + head, dtype=np.intc)
    # the 3-gram (10, 11, 12) last occurred before 200; the whole 12-gram only before 100
    assert list(d.predict(ctx)[:2]) == [100, 101]
    three = d.index.layers[0][0].indexes[-1]  # the context's layer, its 3-gram table
    assert list(three.draft(ctx, 2)) == [200, 201]


def test_auto_starts_drafting_on_a_copy_from_what_it_generates(llm):
    """`auto` with a cost where a draft pays only at high agreement: it learns from tokens generated one per pass
    that the prediction holds, then drafts, and greedy text is unchanged."""
    toks, _ = input_tokens(llm.model_path, "Repeat the text above exactly.", document=ALICE * 2, chat=True)
    S.attach(llm, "off")
    plain = generate(llm, toks, n_predict=40, temp=0).tokens
    S.attach(llm, "auto", S.DEFAULT_COST, cost_source="measured")
    r = generate(llm, toks, n_predict=40, temp=0)
    S.attach(llm, "off")
    assert r.tokens == plain
    assert 0 < r.spec["drafts"] < r.spec["passes"], r.spec  # a pass without a draft first, then drafts
    assert r.spec["accepted"] > 10 and r.tokens_per_pass > 1.5, r.spec


def test_auto_drafts_nothing_where_no_cost_was_measured(llm):
    s = S.for_plan(llm, llm.ctxq_plan, "auto")
    assert not s.active and "ctxq bench --spec" in s.note
    r = generate(llm, llm.tokenize((FOX * 3).encode()), n_predict=8, temp=0)
    assert r.spec["active"] is False and r.tokens_per_pass == 1.0
    S.attach(llm, "off")


@pytest.mark.parametrize("n_predict", [3, 9])
def test_no_draft_reaches_past_the_tokens_asked_for(llm, n_predict):
    """A copy `ngram` drafts whole (the fox sentence, repeated): the drafts of a request stop one short of its last
    token (the batch's last logits give that one), so no pass verifies tokens nobody asked for; the text as without."""
    toks = llm.tokenize((FOX * 6).encode())
    S.attach(llm, "off")
    plain = generate(llm, toks, n_predict=n_predict, temp=0).tokens
    S.attach(llm, "ngram")
    r = generate(llm, toks, n_predict=n_predict, temp=0)
    S.attach(llm, "off")
    assert r.tokens == plain and len(plain) == n_predict
    assert r.spec["drafted"] <= n_predict - 1, r.spec
    assert n_predict < 9 or r.spec["accepted"] > 0, r.spec  # drafted, and accepted
