"""Which sequences run, where each one starts, and what goes into the next batch.

The engine's thread is the only caller. A request is admitted when a sequence id and the cells it
may still need are free (idle resident sequences are evicted least recently used first). It starts
from the longest prefix it shares: with a resident sequence (forked at once), or with one still
evaluating its prompt (it waits, and forks when that sequence has evaluated the common part: requests
that arrive together evaluate their document once). Recurrent state is shared only whole and at the
exact point: a prompt that others wait on stops its chunks there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .prefix import PrefixStore, _common
from .request import Request
from .sampling import Chain, SamplingParams
from .text import TextStream


@dataclass(eq=False)
class Seq:
    """One admitted (or queued) request and its sequence's progress."""

    req: Request
    tokens: list[int]  # the prompt
    params: SamplingParams
    chain: Chain | None  # None: a prefill, evaluated and kept resident, never sampled
    seq_id: int | None = None
    n_done: int = 0  # prompt tokens in its cells (shared or evaluated)
    wait_for: "Seq | None" = None  # an in-flight prompt it forks from at wait_n
    wait_n: int = 0
    children: list["Seq"] = field(default_factory=list)  # those waiting on it
    breaks: set[int] = field(default_factory=set)  # recurrent: positions its chunks stop at (a fork is due)
    next_token: int | None = None  # sampled, evaluated in the next step
    generated: list[int] = field(default_factory=list)
    zombie: bool = False  # its client has gone; it evaluates on only for those waiting on it
    share_limit: int | None = None  # share at most this many of its first tokens
    keep_cells: bool = False  # once released, its cells stay resident for later requests
    stream: TextStream = None  # type: ignore[assignment]

    def __post_init__(self):
        self.stream = TextStream(self.params.stop)

    @property
    def need(self) -> int:
        """The cells its positions can reach: the prompt and every token it may generate."""
        return len(self.tokens) + self.params.max_tokens

    @property
    def prefilling(self) -> bool:
        return self.n_done < len(self.tokens)


@dataclass
class BatchPlan:
    entries: list[tuple[Seq, int, int, bool]] = field(default_factory=list)  # (seq, token, pos, output)
    outputs: list[tuple[int, Seq]] = field(default_factory=list)  # (batch index, seq)
    n_prompt: int = 0


Rm = Callable[[int, int], None]
Cp = Callable[[int, int, int], None]


class Scheduler:
    def __init__(self, store: PrefixStore, n_ctx: int, recurrent: bool):
        self.store, self.n_ctx, self.recurrent = store, n_ctx, recurrent
        self.active: list[Seq] = []
        self.reused = 0  # prompt tokens shared instead of evaluated
        self.ending: list[tuple[Request, str, Exception | None]] = []  # finished, not yet told

    @property
    def _ending(self) -> set[Request]:
        return {r for r, _, _ in self.ending}

    def tell(self) -> None:
        """Finish the requests that ended in this step."""
        for req, reason, error in self.ending:
            req._finish(reason, error)
        self.ending.clear()

    def _held(self, s: Seq) -> int:
        return len(self.store.slots[s.seq_id].tokens)

    def reserved(self) -> int:
        """Cells the active sequences may still add (a waiting one's shared part is its parent's)."""
        return sum(self._reserve(s) for s in self.active)

    def _reserve(self, s: Seq) -> int:
        if s.zombie:  # it evaluates on only as far as those waiting on it fork
            return max(0, max(c.wait_n for c in s.children) - self._held(s))
        return s.need - (s.wait_n if s.wait_for is not None else self._held(s))

    # --- admission ----------------------------------------------------------------------------------

    def admit(self, s: Seq, cells_free: Callable[[], int], rm: Rm, cp: Cp) -> bool:
        """Start `s` if a sequence id and its cells are free (evicting idle ones); False: not yet."""
        st = self.store
        limit = len(s.tokens) - 1  # the last prompt token is always evaluated: its logits start the answer
        if s.share_limit is not None:
            limit = min(limit, s.share_limit)
        src, n = st.match(s.tokens, whole=self.recurrent, limit=limit)
        parent, m = self._in_flight(s, limit, n)
        shared = m if parent is not None else n
        dst, takeover = st.free_slot(), False
        if dst is None:  # every id holds something: the least recently used idle one makes room
            dst = st.lru_idle()
            if dst is None:
                return False
            takeover = dst == src and parent is None
            if takeover:  # it holds this request's prefix: continue in it, without the rest
                if n < len(st.slots[dst].tokens):
                    rm(dst, n)
                    st.truncate(dst, n)
            else:
                self._evict(dst, rm)
        keep = {dst} | ({src} if src is not None and parent is None else set())
        while cells_free() < s.need - shared:
            # the least recently used idle sequence that frees cells (one whose cells others share frees none)
            victim = st.lru_idle(exclude=keep | {i for i, sl in enumerate(st.slots) if sl.tokens and
                                                 st.cells_freed_by(i) == 0})
            victim = st.lru_idle(exclude=keep) if victim is None else victim
            if victim is None and src in keep and src != dst and parent is None and not st.slots[src].busy \
                    and len(st.slots[src].tokens) > n:
                # the idle sequence this request shares a prefix with (a chat template's start, BOS) holds
                # the cells it needs: it keeps only that prefix (recurrent state is matched whole, never cut)
                rm(src, n)
                st.truncate(src, n)
                continue
            if victim is None:
                return False
            self._evict(victim, rm)
        s.seq_id = dst
        st.slots[dst].busy = True
        st.touch(dst)
        if parent is not None:
            s.wait_for, s.wait_n = parent, m
            parent.children.append(s)
            # its chunks stop there: recurrent state must be forked at that exact point, and the
            # shared part is then evaluated in the same batches as a single run over it would be
            parent.breaks.add(m)
        elif not takeover and n:
            cp(src, dst, n)
            st.fork(src, dst, n)
            st.touch(src)
        if parent is None:
            s.n_done = s.req.prompt_done = n
            self.reused += n
        s.req.cached_tokens = shared
        self.active.append(s)
        return True

    def _in_flight(self, s: Seq, limit: int, n: int) -> tuple[Seq | None, int]:
        """The active prompt that will hold more of `s`'s prefix than any resident sequence does now."""
        best, best_m = None, n
        for a in self.active:
            if a.zombie or not a.prefilling and a.wait_for is None:
                continue
            held = a.wait_n if a.wait_for is not None else self._held(a)
            k = _common(a.tokens, s.tokens, limit)
            if k > best_m and k > held:
                best, best_m = a, k
        return best, best_m

    def _evict(self, seq_id: int, rm: Rm) -> None:
        rm(seq_id, -1)
        self.store.clear(seq_id)

    # --- each step ----------------------------------------------------------------------------------

    def fork_waiting(self, cp: Cp, rm: Rm) -> None:
        """Fork every waiting sequence whose parent now holds the shared part."""
        for s in list(self.active):
            p = s.wait_for
            if p is None:
                continue
            held = self._held(p)
            if held < s.wait_n or (self.recurrent and held != s.wait_n):
                continue
            cp(p.seq_id, s.seq_id, s.wait_n)
            self.store.fork(p.seq_id, s.seq_id, s.wait_n)
            s.n_done, s.wait_for = s.wait_n, None
            s.req.prompt_done = s.wait_n
            self.reused += s.wait_n
            p.children.remove(s)
            if not any(c.wait_n == s.wait_n for c in p.children):
                p.breaks.discard(s.wait_n)
            if p.zombie and not p.children:
                self._release(p, keep=p.keep_cells, rm=rm)

    def build(self, n_batch: int) -> BatchPlan:
        """The next batch: every generating sequence's token first, then prompt chunks in admission order."""
        plan = BatchPlan()
        for s in self.active:
            if s.next_token is not None:
                plan.outputs.append((len(plan.entries), s))
                plan.entries.append((s, s.next_token, self._held(s), True))
                s.next_token = None
        for s in self.active:
            budget = n_batch - len(plan.entries)
            if budget <= 0:
                break
            if s.wait_for is not None or not s.prefilling:
                continue
            end = len(s.tokens) if not s.zombie else max(c.wait_n for c in s.children)
            end = min([end] + [b for b in s.breaks if b > s.n_done])
            stop = min(end, s.n_done + budget)
            for pos in range(s.n_done, stop):
                out = pos == len(s.tokens) - 1 and not s.zombie and s.chain is not None
                if out:
                    plan.outputs.append((len(plan.entries), s))
                plan.entries.append((s, s.tokens[pos], pos, out))
            plan.n_prompt += stop - s.n_done
        return plan

    def evaluated(self, plan: BatchPlan, rm: Rm) -> None:
        """The batch was decoded: its tokens are in the cells of their sequences."""
        by_seq: dict[Seq, list[int]] = {}
        for s, tok, _, _ in plan.entries:
            by_seq.setdefault(s, []).append(tok)
        for s, toks in by_seq.items():
            self.store.append(s.seq_id, toks)
            if s.prefilling:
                s.n_done = s.req.prompt_done = min(len(s.tokens), s.n_done + len(toks))
                if not s.prefilling and s.chain is None and not s.zombie:
                    self.finish(s, "length", rm)

    # --- the end of a sequence ------------------------------------------------------------------------

    def finish(self, s: Seq, reason: str, rm: Rm, error: Exception | None = None) -> None:
        """Tell its client; free its chain; keep its cells resident for later requests unless it was
        cancelled or failed (then freed at once, or once those waiting on it have forked)."""
        if not s.req.done and s.req not in self._ending:
            tail = s.stream.finish()
            if tail:
                s.req._emit(tail, None)
            # told after the engine's stats include the end (a caller reading stats() then sees it)
            self.ending.append((s.req, reason, error))
        s.next_token = None
        if s.chain is not None:
            s.chain.close()
        if error is not None:
            for c in s.children:  # they evaluate the shared part themselves
                c.wait_for, c.wait_n, c.req.cached_tokens = None, 0, 0
            s.children.clear()
        s.keep_cells = reason in ("stop", "length")
        if s.children:
            s.zombie = True
            return
        self._release(s, keep=s.keep_cells, rm=rm)

    def cancel(self, req: Request, rm: Rm) -> None:
        s = next((a for a in self.active if a.req is req), None)
        if s is not None:
            self.finish(s, "cancelled", rm)

    def _release(self, s: Seq, keep: bool, rm: Rm | None = None) -> None:
        self.active.remove(s)
        p = s.wait_for
        if p is not None:  # cancelled before its fork: nothing of it is in the cells yet
            p.children.remove(s)
            s.wait_for = None
            if not any(c.wait_n == s.wait_n for c in p.children):
                p.breaks.discard(s.wait_n)
            if p.zombie and not p.children:
                self._release(p, keep=p.keep_cells, rm=rm)
        slot = self.store.slots[s.seq_id]
        if keep:
            slot.busy = False
            self.store.touch(s.seq_id)
        else:
            if rm is not None:
                rm(s.seq_id, -1)
            self.store.clear(s.seq_id)
