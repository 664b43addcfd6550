"""What to draft and how long: the policy shared by a Llama's one sequence (`speculative`) and the engine's many
(`engine_spec`).

The prediction is what followed the latest earlier occurrence of the context's longest indexed n-gram (12, 6, then 3
tokens; `ngram.ContextIndex`). Its length (`Policy`): with a the per-token agreement of that prediction with what was
generated (every generated token is compared, drafted or not, so evidence comes in while nothing is drafted) and a
miss rate that falls as a copy goes on (`STREAK`), the k with the most expected tokens per unit of cost c(k + 1), the
cost of a batch of k + 1 tokens against one: the caller's curve (`ctxq bench --spec`'s measurement, a plan's
estimate) or `DEFAULT_COST`. `auto` drafts only where that beats one token per pass; `ngram` drafts at least one
token wherever the context has a match. A draft never reaches past the request's last token (`Drafter.end`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidOption

log = logging.getLogger(__name__)

MODES = ("ngram", "off", "auto")
N_GRAMS = (12, 6, 3)  # n-gram sizes looked up, longest first: a longer match is more often the text being copied
MAX_DRAFT = 15  # tokens per draft on DEFAULT_COST: a batch of 16, the largest `ctxq bench --spec` measures
LONGEST_DRAFT = 64  # where c(n) is flat: llama.cpp's ngram-mod drafts up to 64 (its --draft-max 64, PR 19164)
FLAT = 0.1  # passes a token of a batch adds beyond the largest measured size, at most, for c(n) to count as flat
# A batch of n tokens against one, measured with SmolLM2-135M Q4_1 on this project's 2-core CPU at 3.5k tokens of
# depth (scripts/bench_spec.py, docs/speculative.md); used by `ngram` where `ctxq bench --spec` has measured nothing.
DEFAULT_COST = {1: 1.0, 2: 1.93, 3: 2.60, 4: 3.15, 6: 4.32, 8: 5.16, 12: 7.43, 16: 9.41}
DECAY = 0.95  # weight of the evidence of one token after each later token: about 14 tokens' half-life
STREAK = 4  # tokens agreeing in a row that halve the expected miss rate (a copy goes on; bench_spec.py, tried 2-16)
PRIOR = (1.6, 0.4)  # pseudo-counts of agreeing tokens and of misses, 0.8 before any evidence, worth two tokens


def plan_cost(plan) -> tuple[dict[int, float] | None, str]:
    """(c(n), its source) for drafts on `plan`: what `ctxq bench --spec` measured on these devices, else the plan's own
    estimate for its GPUs (speed.verify_cost, `speed.read.draft_cost`: flat on a card that holds the model, dear from
    32 tokens where weights sit in host memory), else None (DEFAULT_COST, measured on a 2-core CPU, is the caller's)."""
    from ..planning.speed import store as speed_store

    cost = speed_store.spec_cost(plan)
    if cost:
        return cost, "measured"
    estimated = ((plan.speed or {}).get("read") or {}).get("draft_cost")
    if estimated and any(g.device.kind == "gpu" for g in plan.gpus):
        return {int(n): float(c) for n, c in estimated.items()}, "estimated for the plan's GPUs"
    return None, "default"


def no_drafts(mode: str, cost, recurrent: bool) -> str | None:
    """Why `mode` drafts nothing here, in one line (run and serve print it), or None."""
    if recurrent:
        return ("no drafts: this model's recurrent state cannot drop rejected tokens (llama_memory_seq_rm "
                "removes only whole sequences there); decoding one token per pass")
    if mode == "auto" and not cost:
        return ("no drafts: `ctxq bench --spec` has not measured a draft's cost for this model on these devices "
                "(a plan for GPUs estimates its own); decoding one token per pass")
    return None


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


def draft_cap(cost: dict[int, float]) -> int:
    """The longest draft the curve speaks for: its largest batch less the sampled token, or LONGEST_DRAFT where
    c(n) is flat at its end (each further token adds at most FLAT of a pass: a GPU at depth, where a batch of 16
    costs about one pass), so that extrapolating it stays safe."""
    sizes = sorted(cost)
    top = sizes[-1]
    if len(sizes) > 1 and (cost[top] - cost[sizes[-2]]) / (top - sizes[-2]) <= FLAT:
        return max(top - 1, LONGEST_DRAFT)
    return max(1, min(top - 1, LONGEST_DRAFT))


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

    def __init__(self, cost: dict[int, float], *, floor: int, max_draft: int | None = None):
        self.cost, self.floor = cost, floor
        self.max_draft = draft_cap(cost) if max_draft is None else max_draft
        self.acc, self.rej = 0.0, 0.0
        self.streak = 0  # generated tokens in a row that equalled the prediction
        self._costs = [cost_at(cost, k + 1) for k in range(self.max_draft + 1)]

    def fresh(self) -> "Policy":
        return Policy(self.cost, floor=self.floor, max_draft=self.max_draft)

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


class SeqDrafter:
    """One sequence's drafting: given its context (the last token sampled, not yet evaluated) and its n-gram view,
    the draft to verify with that token. Each call first compares every token generated since the last call with
    that call's whole prediction, drafted or not, so `auto` learns that a quote is being copied without paying for
    a draft. `end`: the context length at which the request stops (its prompt and every token it may generate;
    None: until the context is full): the batch's last logits sample one more token, so drafts stop at end - 1."""

    def __init__(self, mode: str, cost: dict[int, float], max_draft: int | None = None):
        self.mode = mode
        self.policy = Policy(cost, floor=1 if mode == "ngram" else 0, max_draft=max_draft)
        self.stats = Stats()
        self.end: int | None = None
        self._last: tuple[int, int, int, np.ndarray] | None = None  # (context length, its last token, k, prediction)

    def follows(self, tokens) -> bool:
        """Whether `tokens` continue the context of the last call (its last token, then accepted drafts and one)."""
        if self._last is None:
            return True
        L0, tail, k, _ = self._last
        return 0 <= len(tokens) - L0 - 1 <= k and int(tokens[L0 - 1]) == tail

    def restart(self) -> None:
        """A new request on the same sequence: fresh agreement and counts."""
        st = self.stats
        if st.passes:  # what the request that ends here did (`ctxq -v serve` shows it)
            log.info("spec %s: a request decoded in %d passes, %d of %d drafted tokens accepted", self.mode,
                     st.passes, st.accepted, st.drafted)
        self.policy = self.policy.fresh()
        self.stats = Stats()
        self._last = None

    def propose(self, tokens, index, room: int | None = None) -> np.ndarray:
        """The draft after `tokens` (the caller checked `follows`), from `index` (a `ngram.ContextIndex`), `room`
        tokens at most."""
        L = len(tokens)
        if self._last is not None:
            L0, _, k, pred = self._last
            self.stats.accepted += L - L0 - 1
            got = np.asarray(tokens[L0:L])
            m = min(len(got), len(pred))
            if m:
                same = got[:m] == pred[:m]
                agreed = int(m if same.all() else np.argmin(same))
                self.policy.observe(agreed, agreed < m)
        pred = index.predict(tokens, self.policy.max_draft)
        if not len(pred):
            self.policy.streak = 0
        k = self.policy.length(len(pred)) if len(pred) else 0
        if self.end is not None:
            k = max(0, min(k, self.end - L - 1))
        if room is not None:
            k = min(k, room)
        self._last = (L, int(tokens[L - 1]), k, pred)
        self.stats.cost += self.policy._costs[k]
        if k:
            self.stats.drafts += 1
            self.stats.drafted += k
        return pred[:k]
