"""Drafts on the engine (`engine.py`): each generating sequence's draft verified in the same batch as the other
sequences' single tokens (issue 63).

Each step, a sequence with a drafter proposes a draft after its sampled token (`drafts.SeqDrafter`, its own policy:
`auto` decides per sequence) from its n-gram view (`ngram.ContextIndex` on its `prefix.Slot`: the document's layer
shared with every sequence that forked from it). The batch then holds its token and the draft, logits at each; its
chain samples position after position while the sampled token equals the draft's (the same rule as one sequence's,
`speculative.py`), emitting each through the engine as one token, so stop strings, max_tokens, min_tokens, grammars
and penalties see accepted tokens only. What the first difference leaves is removed from that sequence's cells
alone (`llama_memory_seq_rm(seq, p, -1)` from the first rejected position): a draft sits past every shared cell,
so a document's cells are never touched.

Memory: a draft's logits are outputs of the batch; the engine's context reserves DRAFT_OUTPUTS more output rows than
one per sequence (n_vocab x 4 bytes each in the output buffer, and as much in the compute buffer's last tensor),
only when it drafts, and the sequences share them step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .drafts import DEFAULT_COST, LONGEST_DRAFT, N_GRAMS, SeqDrafter, check_mode, draft_cap, no_drafts, plan_cost

DRAFT_OUTPUTS = LONGEST_DRAFT  # output rows for drafts, shared by the sequences of one step


@dataclass
class EngineSpec:
    """What the engine drafts: the mode, the cost curve (None: nothing), and why not (one line)."""

    mode: str = "off"
    cost: dict | None = None
    note: str | None = None
    cost_source: str = ""

    @property
    def active(self) -> bool:
        return self.cost is not None

    @property
    def grams(self) -> tuple[int, ...] | None:
        return N_GRAMS if self.active else None

    def drafter(self, end: int, n_batch: int) -> SeqDrafter | None:
        """A new sequence's drafter; `end`: its prompt and max_tokens (drafts stop one short of it)."""
        if not self.active:
            return None
        d = SeqDrafter(self.mode, self.cost, max_draft=min(draft_cap(self.cost), DRAFT_OUTPUTS, n_batch - 1))
        d.end = end
        return d


def configure(spec: str | None, cost: dict | None, recurrent: bool, cost_source: str = "") -> EngineSpec:
    """The engine's drafting for `spec` (ngram, off, auto; None: off), as `speculative.attach` decides a Llama's."""
    mode = check_mode(spec or "off")
    s = EngineSpec(mode, cost_source=cost_source)
    if mode == "off":
        return s
    s.note = no_drafts(mode, cost, recurrent)
    if s.note is None:
        s.cost = cost or DEFAULT_COST
    return s


def for_plan(plan, spec: str | None) -> tuple[str, dict | None, str]:
    """(mode, cost, its source) for an engine on `plan`: the cost `ctxq bench --spec` measured there, if any."""
    mode = check_mode(spec)
    if mode == "off" or plan is None:
        return mode, None, ""
    return (mode, *plan_cost(plan))


def propose(active, store, room: int) -> int:
    """Give each generating sequence with a drafter its draft (`Seq.draft`), `room` tokens at most in all (the batch
    and the output rows left); the tokens drafted."""
    used = 0
    for s in active:
        s.draft = []
        d = s.drafter
        if d is None or s.next_token is None or room - used <= 0:
            continue
        slot = store.slots[s.seq_id]
        toks = slot.tokens
        toks.append(s.next_token)  # the context the draft follows: the evaluated tokens and the one just sampled
        try:
            if not d.follows(toks):
                d.restart()
            slot.index.update(toks)
            draft = d.propose(toks, slot.index, room - used)
        finally:
            toks.pop()
        s.draft = [int(t) for t in draft]
        used += len(s.draft)
    return used


def verify(engine, s, i: int) -> None:
    """Sample `s` at batch rows i, i + 1, ... while the sampled token equals its draft's; remove the rejected
    draft's cells (this sequence's only)."""
    draft, s.draft = s.draft, []
    h = len(engine._store.slots[s.seq_id].tokens) - len(draft) - 1  # the sampled token's position
    accepted = 0
    for j in range(len(draft) + 1):
        tok = s.chain.sample(engine._ctx, i + j)
        agreed = j < len(draft) and tok == draft[j]
        accepted += agreed
        engine._token(s, tok)
        if not agreed or s.next_token is None:  # a difference, or the request ended (stop, EOG, max_tokens)
            break
    s.drafter.stats.passes += 1
    s.req.draft_n += len(draft)
    s.req.draft_n_accepted += accepted
    engine._counters["tokens_drafted"] += len(draft)
    engine._counters["tokens_draft_accepted"] += accepted
    keep = h + 1 + accepted
    slot = engine._store.slots[s.seq_id]
    if len(slot.tokens) > keep:  # still its cells (a sequence freed at its end holds none)
        engine._rm(s.seq_id, keep)
        engine._store.rollback(s.seq_id, keep)
