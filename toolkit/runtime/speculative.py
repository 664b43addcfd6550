"""More than one token per pass: drafts taken from the context itself, verified in one batch (issue 55).

A `Drafter` proposes the continuation that followed the context's last n-gram where it occurred before (the
document, the question and what has been generated: `ngram.ContextIndex`). llama-cpp-python's `Llama.generate` then
evaluates the sampled token and the draft in one `llama_decode` (`_verify_eval`: logits at every position), samples
each position in turn with the request's own sampler chain (top-k/top-p/min-p, temperature, grammar) and keeps the
draft while the sampled token equals it; at the first difference the sampled token replaces the draft's and the
rest is removed from the KV cache (`llama_memory_seq_rm`, its `kv_cache_seq_rm`).

Why that keeps the distribution exactly: the token t sampled at a draft position is drawn from the target p, so
P(t = x) = p(x), the draft x's acceptance probability, and given t != x, t is distributed as p with x removed and
renormalized: the speculative-sampling rule for a deterministic draft, in one draw. Every emitted token is one draw
of the chain, so a run with drafts consumes the random state as one without them. At temperature 0 the chain is
greedy: the longest prefix greedy decoding would give is kept.

What to draft and how long is `drafts.py`'s (shared with the engine's sequences, `engine_spec.py`). Logits
processors, grammars and stopping criteria see the accepted tokens only (`_sample_accepted`), and no draft reaches
past the request's max_tokens on any path (`Speculation.expect`: `create_completion` and `generate.generate` say it).
Recurrent and hybrid memory cannot drop the end of a sequence: no drafts there (`Speculation.note`).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidOption
from .drafts import (DEFAULT_COST, DECAY, LONGEST_DRAFT, MAX_DRAFT, MODES, N_GRAMS, PRIOR, STREAK,  # noqa: F401
                     Policy, SeqDrafter, Stats, check_mode, cost_at, draft_cap, no_drafts, plan_cost)
from .ngram import ContextIndex

log = logging.getLogger(__name__)


class Drafter(SeqDrafter):
    """llama-cpp-python's draft-model interface (`LlamaDraftModel.__call__`): the context so far -> draft tokens.

    Its n-gram view (`ngram.ContextIndex`) outlives a request: the next one, on the same cache, shares the layers of
    the tokens the two have in common (a document asked about again is not indexed again) and indexes the rest."""

    def __init__(self, mode: str, cost: dict[int, float], grams: tuple[int, ...] = N_GRAMS,
                 max_draft: int | None = None):
        super().__init__(mode, cost, max_draft)
        self.index = ContextIndex(grams)
        self.pending = False  # a draft was handed out; the next eval verifies it
        self.limit: int | None = None  # tokens the next request may generate (Speculation.expect)
        self._fresh = True  # the next call starts a request
        self._seen = np.empty(0, dtype=np.intc)  # the context the index was last given

    def new_request(self) -> None:
        self.restart()
        self._fresh = True

    def predict(self, tokens: np.ndarray) -> np.ndarray:
        """What followed the latest earlier occurrence of the context's longest indexed n-gram (maybe empty)."""
        self._start(tokens, len(tokens))
        return self.index.predict(tokens, self.policy.max_draft)

    def _start(self, tokens, prompt: int) -> None:
        """Index a new request's `prompt` first tokens, sharing what the last context had in common with them."""
        seen = self._seen[:min(len(self._seen), prompt)]
        diff = np.flatnonzero(seen != np.asarray(tokens[:len(seen)]))
        self.index = self.index.fork(int(diff[0]) if len(diff) else len(seen))
        self.index.update(tokens, prompt)
        self.index.seal()  # the prompt's layer stays as it is for the next request that starts with it
        self.end = prompt + self.limit if self.limit else None
        self.limit, self._fresh = None, False

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        L = len(input_ids)
        if self._fresh or not self.follows(input_ids):  # a new request (or another one on the same cache)
            if not self._fresh:
                self.restart()
            self._start(input_ids, L - 1)  # its prompt: all but the token just sampled
        self._seen = np.array(input_ids, dtype=np.intc)
        self.index.update(input_ids)
        draft = self.propose(input_ids, self.index)
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

    def expect(self, max_tokens: int | None) -> None:
        """The next request generates at most `max_tokens` (None or 0: until the context is full): its drafts never
        reach past its last token. `create_completion` says so itself (`_completion`); `generate.generate` too."""
        if self.drafter:
            self.drafter.new_request()
            self.drafter.limit = max_tokens if max_tokens and max_tokens > 0 else None

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


def _sample_accepted(llm, *args, idx: int | None = None, **kwargs) -> int:
    """`Llama.sample` at position `idx` of a draft's batch with its logits processors seeing the accepted tokens
    only: `Llama._input_ids` (what a processor is given) ends at n_tokens, past the drafts still unverified, so
    llama-cpp-python's MinTokensLogitsProcessor would count them as generated and let the end token through early.
    The row is the same (idx - n_tokens counts back from the batch's last); only the view ends at idx."""
    n = llm.n_tokens
    if idx is None or idx >= n - 1 or llm._sampler is None:
        return type(llm).sample(llm, *args, idx=idx, **kwargs)
    llm.n_tokens = idx + 1
    try:
        return llm._sampler.sample(llm._ctx, idx - n)
    finally:
        llm.n_tokens = n


def _completion(llm, *args, **kwargs):
    """`Llama._create_completion` telling the drafter the request's max_tokens first (the end rule); a generator,
    as the original, so it says so when the completion starts, not when it is created."""
    spec = getattr(llm, "ctxq_spec", None)
    if spec is not None:
        spec.expect(kwargs.get("max_tokens", 16))  # 16: _create_completion's default
    return (yield from type(llm)._create_completion(llm, *args, **kwargs))


_OVERRIDES = {"eval": _verify_eval, "sample": _sample_accepted, "_create_completion": _completion}


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
    s.note = None if mode == "off" else no_drafts(mode, cost, not partial_rollback(llm))
    if mode != "off" and s.note is None:
        if llm.n_batch < 2:
            raise InvalidOption("speculative decoding verifies a draft in one batch: n_batch must be 2 or more",
                                option="n_batch", value=llm.n_batch)
        curve = cost or DEFAULT_COST
        s.drafter = Drafter(mode, curve, max_draft=min(draft_cap(curve), llm.n_batch - 1))
        s._orig = {"draft_model": llm.draft_model}
        llm.draft_model = s.drafter
        for name, fn in _OVERRIDES.items():
            setattr(llm, name, types.MethodType(fn, llm))
    if s.note:
        log.info("%s", s.note)
    llm.ctxq_spec = s
    return s


def detach(llm) -> None:
    """Back to one token per pass."""
    s = getattr(llm, "ctxq_spec", None)
    if s is not None and s.drafter is not None:
        llm.draft_model = s._orig.get("draft_model")
        for name in _OVERRIDES:
            llm.__dict__.pop(name, None)
    llm.ctxq_spec = None


def for_plan(llm, plan, spec: str | None) -> Speculation:
    """`attach` with the plan's cost curve (`drafts.plan_cost`: measured by `ctxq bench --spec`, else estimated for
    its GPUs, else none)."""
    mode = check_mode(spec)
    cost, source = plan_cost(plan) if mode != "off" and plan is not None else (None, "default")
    return attach(llm, mode, cost, cost_source=source)
