"""The prefix store: which token runs are resident in which sequence of a unified KV cache.

In a unified cache `llama_memory_seq_cp(src, dst, 0, n)` adds `dst` to the cells of `src` that hold
positions [0, n) (`llama_kv_cache::seq_cp`: metadata only), and a cell is freed when no sequence holds
it any more (`llama_kv_cells::seq_rm`). The store mirrors that bookkeeping so the engine knows its free
cells without asking llama.cpp: a sequence's tokens are a list of segments, each a prefix of a `Run` of
cells that one sequence wrote; a run holds as many cells as the longest prefix any sequence still uses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .ngram import ContextIndex


@dataclass(eq=False)
class Run:
    """Cells one sequence wrote one after another; `length` is its writer's tip (it grows there only)."""

    length: int = 0


@dataclass
class Slot:
    """One sequence id: the tokens its cells hold (position i holds tokens[i]), in segments of runs."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    segments: list[list] = field(default_factory=list)  # [run, n used of it]
    busy: bool = False  # a request is using it (never evicted)
    last_used: int = 0  # the store's clock at the last use
    _own: Run | None = None  # the run this slot writes at the tip of, while it may still grow
    index: ContextIndex | None = None  # its n-gram view, when the engine drafts (forked as its cells are)


class PrefixStore:
    """Resident token runs of `n_seq` sequence ids, least recently used first out."""

    def __init__(self, n_seq: int, grams: tuple[int, ...] | None = None):
        self.slots = [Slot(i) for i in range(n_seq)]
        self.grams = grams  # n-gram sizes each slot's tokens are indexed by (None: no index)
        self._clock = itertools.count()

    # --- what is resident ------------------------------------------------------------------------

    def match(self, tokens: list[int], *, whole: bool = False, limit: int | None = None) -> tuple[int | None, int]:
        """(seq_id, n): the sequence whose tokens share the longest prefix with `tokens` (at most
        `limit` of them), idle ones first among equals. `whole`: only sequences whose every token is
        in that prefix (recurrent state cannot be cut part-way)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        best, best_n = None, 0
        for s in self.slots:
            if not s.tokens:
                continue
            n = _common(s.tokens, tokens, limit)
            if whole and n != len(s.tokens):
                continue
            if n > best_n or (n == best_n and n and best is not None and best.busy and not s.busy):
                best, best_n = s, n
        return (best.seq_id, best_n) if best is not None else (None, 0)

    def cells_used(self) -> int:
        """Cells held by at least one sequence."""
        return sum(max(ns) for ns in self._refs().values())

    def cells_shared(self) -> int:
        """Cells held by more than one sequence."""
        return sum(sorted(ns)[-2] for ns in self._refs().values() if len(ns) > 1)

    def cells_freed_by(self, seq_id: int) -> int:
        """Cells that clearing `seq_id` would free (those no other sequence holds)."""
        refs = self._refs()
        freed = 0
        for run, n in self.slots[seq_id].segments:
            others = [m for m in refs[run]]
            others.remove(n)
            freed += max(0, n - max(others, default=0))
        return freed

    def _refs(self) -> dict[Run, list[int]]:
        refs: dict[Run, list[int]] = {}
        for s in self.slots:
            for run, n in s.segments:
                refs.setdefault(run, []).append(n)
        return refs

    def free_slot(self) -> int | None:
        """A sequence id that holds nothing."""
        return next((s.seq_id for s in self.slots if not s.busy and not s.tokens), None)

    def lru_idle(self, exclude: set[int] = frozenset()) -> int | None:
        """The idle resident sequence used least recently (the next to evict)."""
        idle = [s for s in self.slots if not s.busy and s.tokens and s.seq_id not in exclude]
        return min(idle, key=lambda s: s.last_used).seq_id if idle else None

    # --- changes (the engine makes the same ones in llama.cpp) -----------------------------------

    def touch(self, seq_id: int) -> None:
        self.slots[seq_id].last_used = next(self._clock)  # an order, not a time

    def fork(self, src: int, dst: int, n: int) -> None:
        """`dst` (empty) holds the first `n` cells of `src`, shared (llama_memory_seq_cp(src, dst, 0, n))."""
        s, d = self.slots[src], self.slots[dst]
        assert not d.tokens and n <= len(s.tokens)
        d.tokens = s.tokens[:n]
        d.segments = _cut(s.segments, n)
        d._own = None
        if s.index is not None:  # the shared tokens' n-grams are shared too, indexed once
            s.index.update(s.tokens, n)
            d.index = s.index.fork(n)

    def append(self, seq_id: int, tokens: list[int]) -> None:
        """`seq_id` wrote `tokens` into new cells after its last one."""
        if not tokens:
            return
        s = self.slots[seq_id]
        s.tokens.extend(tokens)
        if self.grams is not None and s.index is None:
            s.index = ContextIndex(self.grams)
        last = s.segments[-1] if s.segments else None
        if last is not None and last[0] is s._own and last[1] == s._own.length:
            last[1] += len(tokens)  # still the tip of its own run: the run grows
        else:
            s._own = Run()
            last = [s._own, len(tokens)]
            s.segments.append(last)
        s._own.length = last[1]

    def truncate(self, seq_id: int, n: int) -> None:
        """`seq_id` keeps its first `n` cells (llama_memory_seq_rm(seq_id, n, -1))."""
        s = self.slots[seq_id]
        s.tokens = s.tokens[:n]
        s.segments = _cut(s.segments, n)
        if s.index is not None:
            s.index = s.index.fork(n)

    def rollback(self, seq_id: int, n: int) -> None:
        """`seq_id` keeps its first `n` cells, the tip of its own run (a rejected draft, which nobody shares):
        the run ends there and grows on from there."""
        s = self.slots[seq_id]
        s.tokens = s.tokens[:n]
        s.segments = _cut(s.segments, n)
        if s.segments and s.segments[-1][0] is s._own:
            s._own.length = s.segments[-1][1]

    def clear(self, seq_id: int) -> None:
        """`seq_id` holds nothing (llama_memory_seq_rm(seq_id, -1, -1))."""
        s = self.slots[seq_id]
        s.tokens, s.segments, s._own, s.busy, s.index = [], [], None, False, None


def _common(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _cut(segments: list[list], n: int) -> list[list]:
    """The segments that hold the first `n` tokens."""
    out, left = [], n
    for run, m in segments:
        if left <= 0:
            break
        out.append([run, min(m, left)])
        left -= m
    return out
