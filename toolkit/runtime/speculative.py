"""More than one token per pass: drafts taken from the context itself, verified in one batch (issue 55).

A `Drafter` proposes the continuation that followed the context's last n-gram where it occurred before (the
document, the question and what has been generated: `ngram.NgramIndex`). llama-cpp-python's `Llama.generate` then
evaluates the sampled token and the draft in one `llama_decode` (`_verify_eval`: logits at every position), samples
each position in turn with the request's own sampler chain (top-k/top-p/min-p, temperature, grammar) and keeps the
draft while the sampled token equals it; at the first difference the sampled token replaces the draft's and the
rest is removed from the KV cache (`llama_memory_seq_rm`, its `kv_cache_seq_rm`).

Why that keeps the distribution exactly: the token t sampled at a draft position is drawn from the target p, so
P(t = x) = p(x), the draft x's acceptance probability, and given t != x, t is distributed as p with x removed and
renormalized: the speculative-sampling rule for a deterministic draft, in one draw. Every emitted token is one draw
of the chain, so a run with drafts consumes the random state as one without them. At temperature 0 the chain is
greedy: the longest prefix greedy decoding would give is kept.

The draft is what followed the latest earlier occurrence of the context's longest indexed n-gram (12, 6, then 3
tokens). Its length (`Policy`): with a the per-token agreement of that prediction with what was generated (every
generated token is compared, drafted or not, so evidence comes in while nothing is drafted) and a miss rate that
falls as a copy goes on (`STREAK`), the k with the most expected tokens per unit of cost c(k + 1), the cost of a
batch of k + 1 tokens against one, measured by `ctxq bench --spec` (`planning.speed.store`) or `DEFAULT_COST`.
`auto` drafts only where that beats one token per pass; `ngram` drafts at least one token wherever the context
has a match.
Recurrent and hybrid memory cannot drop the end of a sequence: no drafts there (`Speculation.note`).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidOption
from .ngram import NgramIndex

log = logging.getLogger(__name__)

MODES = ("ngram", "off", "auto")
N_GRAMS = (12, 6, 3)  # n-gram sizes looked up, longest first: a longer match is more often the text being copied
MAX_DRAFT = 15  # tokens per draft at most: a batch of 16, the largest `ctxq bench --spec` measures
# A batch of n tokens against one, measured with SmolLM2-135M Q4_1 on this project's 2-core CPU at 3.5k tokens of
# depth (scripts/bench_spec.py, docs/speculative.md); used by `ngram` where `ctxq bench --spec` has measured nothing.
DEFAULT_COST = {1: 1.0, 2: 1.93, 3: 2.60, 4: 3.15, 6: 4.32, 8: 5.16, 12: 7.43, 16: 9.41}
DECAY = 0.95  # weight of the evidence of one token after each later token: about 14 tokens' half-life
STREAK = 4  # tokens agreeing in a row that halve the expected miss rate (a copy goes on; bench_spec.py, tried 2-16)
PRIOR = (1.6, 0.4)  # pseudo-counts of agreeing tokens and of misses, 0.8 before any evidence, worth two tokens


def check_mode(spec: str | None) -> str:
    mode = "auto" if spec is None else spec
    if mode not in MODES:
        raise InvalidOption(f"spec must be one of {', '.join(MODES)}; got {spec!r}", option="spec", value=spec)
    return mode


def cost_at(cost: dict[int, float], n: int) -> float:
    """The cost of a batch of n tokens against one, interpolated linearly between measured sizes."""
    sizes = sorted(cost)
    if n <= sizes[0]:
        return cost[sizes[0]] * n / sizes[0]
    for lo, hi in zip(sizes, sizes[1:]):
        if n <= hi:
            return cost[lo] + (cost[hi] - cost[lo]) * (n - lo) / (hi - lo)
    lo, hi = sizes[-2:] if len(sizes) > 1 else (sizes[0], sizes[0])
    slope = (cost[hi] - cost[lo]) / (hi - lo) if hi > lo else cost[hi] / hi
    return cost[hi] + slope * (n - hi)


@dataclass
class Stats:
    """One request's decoding after its prompt: passes (llama_decode calls), draft tokens proposed and accepted."""

    passes: int = 0
    drafts: int = 0  # passes that carried a draft
    drafted: int = 0
    accepted: int = 0
    cost: float = 0.0  # the passes' cost by the policy's curve, in single-token passes (a load-free measure of time)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {"passes": self.passes, "drafts": self.drafts, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "cost": self.cost}


class Policy:
    """The draft length from the per-token agreement a of the context's prediction with what was generated (decayed
    counts, every generated token compared, drafted or not) and the cost c(n) of a batch: the k with the most
    expected tokens per unit of cost, (1 - a^(k+1)) / (1 - a) / c(k+1), 0 where none beats a pass of one token;
    at least `floor` (`ngram`: 1) where there is a prediction."""

    def __init__(self, cost: dict[int, float], *, floor: int, max_draft: int = MAX_DRAFT):
        self.cost, self.floor, self.max_draft = cost, floor, max_draft
        self.acc, self.rej = 0.0, 0.0
        self.streak = 0  # generated tokens in a row that equalled the prediction
        self._costs = [cost_at(cost, k + 1) for k in range(max_draft + 1)]

    def alpha(self) -> float:
        return (self.acc + PRIOR[0]) / (self.acc + self.rej + PRIOR[0] + PRIOR[1])

    def length(self, available: int | None = None) -> int:
        """The k (0..max_draft, at most `available`) with the most expected tokens per unit of cost."""
        top = self.max_draft if available is None else min(available, self.max_draft)
        miss = 1 - min(self.alpha(), 0.999)
        best, best_k = 1.0, 0  # no draft: one token per pass of cost 1
        expect, reach = 1.0, 1.0  # tokens a pass gives; the chance the draft's first k tokens all agree
        for k in range(1, top + 1):
            # a copy that has gone on for r tokens is more likely to go on: the miss rate falls as r grows
            reach *= 1 - miss * STREAK / (STREAK + self.streak + k - 1)
            expect += reach
            rate = expect / self._costs[k]
            if rate > best:
                best, best_k = rate, k
        return max(best_k, min(self.floor, top))  # `ngram` where no draft pays: the cheapest, one token

    def observe(self, agreed: int, missed: bool) -> None:
        """`agreed` generated tokens equalled the prediction, then one did not (`missed`) or the prediction ended."""
        w = DECAY ** (agreed + missed)
        self.acc = self.acc * w + agreed
        self.rej = self.rej * w + missed
        self.streak = 0 if missed else self.streak + agreed


class Drafter:
    """llama-cpp-python's draft-model interface (`LlamaDraftModel.__call__`): the context so far -> draft tokens.

    Each call predicts up to `max_draft` tokens from the context's longest n-gram match (`N_GRAMS`) and hands out
    the first `Policy.length()` of them; the next call compares every token generated since with that whole
    prediction, drafted or not, so `auto` learns that a quote is being copied without paying for a draft."""

    def __init__(self, mode: str, cost: dict[int, float], grams: tuple[int, ...] = N_GRAMS,
                 max_draft: int = MAX_DRAFT):
        self.mode = mode
        self.indexes = [NgramIndex(n) for n in grams]
        self.policy = Policy(cost, floor=1 if mode == "ngram" else 0, max_draft=max_draft)
        self.stats = Stats()
        self.pending = False  # a draft was handed out; the next eval verifies it
        self._last: tuple[int, int, int, np.ndarray] | None = None  # (context length, its last token, k, prediction)
        self.end: int | None = None  # the context length where the request stops generating (Speculation.start)

    def new_request(self) -> None:
        st = self.stats
        if st.passes:  # what the request that ends here did (`ctxq -v serve` shows it)
            log.info("spec %s: a request decoded in %d passes, %d of %d drafted tokens accepted", self.mode,
                     st.passes, st.accepted, st.drafted)
        for ix in self.indexes:
            ix.reset()
        self.policy = Policy(self.policy.cost, floor=self.policy.floor, max_draft=self.policy.max_draft)
        self.stats = Stats()
        self._last = None

    def predict(self, tokens: np.ndarray) -> np.ndarray:
        """What followed the latest earlier occurrence of the context's longest indexed n-gram (maybe empty)."""
        for ix in self.indexes:
            ix.update(tokens)
        for ix in self.indexes:
            d = ix.draft(tokens, self.policy.max_draft)
            if len(d):
                return d
        return d

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        L = len(input_ids)
        if self._last is not None:
            L0, tail, k, pred = self._last
            accepted = L - L0 - 1
            if 0 <= accepted <= k and int(input_ids[L0 - 1]) == tail:
                self.stats.accepted += accepted
                got = np.asarray(input_ids[L0:L])
                m = min(len(got), len(pred))
                if m:
                    same = got[:m] == pred[:m]
                    agreed = int(m if same.all() else np.argmin(same))
                    self.policy.observe(agreed, agreed < m)
            else:  # not the continuation of the last call: another request on the same cache
                self.new_request()
        pred = self.predict(input_ids)
        if not len(pred):
            self.policy.streak = 0
        k = self.policy.length(len(pred)) if len(pred) else 0
        if self.end is not None:  # the batch's last logits sample one more token: drafts up to the request's end - 1
            k = max(0, min(k, self.end - L - 1))
        draft = pred[:k]
        self._last = (L, int(input_ids[L - 1]), k, pred)
        self.stats.cost += self.policy._costs[k]
        if k:
            self.stats.drafts += 1
            self.stats.drafted += k
        self.pending = True
        return draft


@dataclass
class Speculation:
    """What a Llama was given: the mode asked for, whether it drafts, and why not (one line)."""

    mode: str
    drafter: Drafter | None = None
    note: str | None = None
    cost_source: str = ""
    _orig: dict = field(default_factory=dict, repr=False)

    @property
    def active(self) -> bool:
        return self.drafter is not None

    @property
    def stats(self) -> Stats | None:
        return self.drafter.stats if self.drafter else None

    def start(self, end: int | None = None) -> None:
        """A new request begins (its prompt evaluated by the caller): fresh index, acceptance and counts. `end`: the
        context length at which it stops (its prompt and the tokens it may generate; None: until the context is
        full): drafts never reach past it."""
        if self.drafter:
            self.drafter.new_request()
            self.drafter.end = end

    def to_dict(self) -> dict:
        return {"mode": self.mode, "active": self.active, "note": self.note,
                **(self.stats.to_dict() if self.stats else {})}


def _verify_eval(llm, tokens) -> None:
    """`Llama.eval` with logits at every position of a draft's batch (one llama_decode); a prompt evaluates as
    llama-cpp-python evaluates it and starts a new request."""
    spec: Speculation = llm.ctxq_spec
    d = spec.drafter
    if d is None or not d.pending or len(tokens) > llm.n_batch:
        if d is not None and not d.pending:
            d.new_request()
        return type(llm).eval(llm, tokens)
    d.pending = False
    llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)  # what a rejection left beyond the accepted tokens
    n_past = llm.n_tokens
    llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
    llm._ctx.decode(llm._batch)
    llm.input_ids[n_past:n_past + len(tokens)] = tokens
    llm.n_tokens += len(tokens)
    llm._requires_eval = False
    d.stats.passes += 1


def partial_rollback(llm) -> bool:
    """Whether the model's memory can drop the end of a sequence (attention-only KV: yes; recurrent or hybrid: no)."""
    return not (getattr(llm, "_is_recurrent", False) or getattr(llm, "_is_hybrid", False))


def attach(llm, spec: str | None, cost: dict[int, float] | None = None, *, cost_source: str = "") -> Speculation:
    """Give `llm` (a llama_cpp.Llama with one sequence) drafts from its context, per `spec` (ngram, off, auto;
    None = auto). `cost`: the measured cost of a batch of n tokens against one (`ctxq bench --spec`), which `auto`
    needs. The result is also `llm.ctxq_spec`; its `note` says in one line why nothing is drafted."""
    mode = check_mode(spec)
    detach(llm)
    s = Speculation(mode, cost_source=cost_source)
    if mode == "off":
        pass
    elif not partial_rollback(llm):
        s.note = ("no drafts: this model's recurrent state cannot drop rejected tokens (llama_memory_seq_rm "
                  "removes only whole sequences there); decoding one token per pass")
    elif mode == "auto" and not cost:
        s.note = ("no drafts: `ctxq bench --spec` has not measured a draft's cost for this model on these devices; "
                  "decoding one token per pass")
    else:
        if llm.n_batch < 2:
            raise InvalidOption("speculative decoding verifies a draft in one batch: n_batch must be 2 or more",
                                option="n_batch", value=llm.n_batch)
        s.drafter = Drafter(mode, cost or DEFAULT_COST, max_draft=min(MAX_DRAFT, llm.n_batch - 1))
        s._orig = {"draft_model": llm.draft_model}
        llm.draft_model = s.drafter
        llm.eval = types.MethodType(_verify_eval, llm)
    if s.note:
        log.info("%s", s.note)
    llm.ctxq_spec = s
    return s


def detach(llm) -> None:
    """Back to one token per pass."""
    s = getattr(llm, "ctxq_spec", None)
    if s is not None and s.drafter is not None:
        llm.draft_model = s._orig.get("draft_model")
        llm.__dict__.pop("eval", None)
    llm.ctxq_spec = None


def for_plan(llm, plan, spec: str | None) -> Speculation:
    """`attach` with the cost `ctxq bench --spec` measured for `plan` on these devices (None: not measured)."""
    from ..planning.speed import store as speed_store

    mode = check_mode(spec)
    cost = speed_store.spec_cost(plan) if mode != "off" and plan is not None else None
    return attach(llm, mode, cost, cost_source="measured" if cost else "default")
