"""Bounded n-gram indexes over a context: where the last n tokens occurred before, and what followed them.

In the manner of llama.cpp's ngram-map (common/ngram-map.cpp, PR 18471) and ngram-mod (PR 19164): each n-gram is
hashed into a table that keeps the position right after its latest occurrence, and a draft is the context's own
continuation from there. A collision only loses an n-gram: every hit is checked against the tokens before use.

`ContextIndex` is one sequence's view: layers of tables, each indexing one span of positions. A document's layer is
built while the document is evaluated and shared, never copied, by every sequence that starts with it (a fork cuts
the view at the shared length); what a sequence appends goes into layers of its own. Memory: a layer's tables
grow with what it indexes, 4 to 8 int32 slots per token and n-gram size (at most 96 bytes a token for the three
sizes `drafts.N_GRAMS`), at least 2^MIN_BITS slots (12 KiB for three) and at most 2^TABLE_BITS (12 MiB for three);
a layer lives as long as a sequence whose context holds its span, so the engine's layers index at most its KV
cells' tokens.
"""

from __future__ import annotations

import numpy as np

TABLE_BITS = 20  # 2^20 int32 slots, 4 MiB, at most: few collisions up to a few hundred thousand tokens of context
MIN_BITS = 10  # a layer's smallest tables (a question's few tokens): 4 KiB each
LOAD = 4  # slots per indexed n-gram (a table one quarter full keeps most n-grams through collisions)
_MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing's multiplier (golden ratio times 2^64)


class NgramIndex:
    """The n-grams of `n` tokens followed by positions in [start, indexed), each pointing at what followed its latest
    occurrence. `bits`: a fixed table of 2^bits slots; None: it grows with the tokens indexed (up to TABLE_BITS)."""

    def __init__(self, n: int = 3, bits: int | None = TABLE_BITS, start: int = 0):
        self.n, self.grow = n, bits is None
        self.start = start
        self.bits = MIN_BITS if bits is None else bits
        self.table = np.full(1 << self.bits, -1, dtype=np.int32)
        self.indexed = start  # n-grams followed by a position in [start, indexed) are in the table

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def reset(self) -> None:
        self.table.fill(-1)
        self.indexed = self.start

    def _slots(self, windows: np.ndarray) -> np.ndarray:
        """Table slots of n-grams given as rows of `n` tokens."""
        h = np.zeros(len(windows), dtype=np.uint64)
        with np.errstate(over="ignore"):  # wrapping uint64 arithmetic is the hash
            for j in range(self.n):
                h = (h ^ windows[:, j].astype(np.uint64)) * _MUL
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def _put(self, tokens, first: int, last: int) -> None:
        """Index the n-grams followed by positions first..last-1 (in increasing order: numpy's assignment keeps the
        last of repeated slots, the latest occurrence)."""
        first = max(first, self.n)
        if last <= first:
            return
        t = np.asarray(tokens[first - self.n:last - 1], dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(t, self.n)
        self.table[self._slots(windows)] = np.arange(first, last, dtype=np.int32)

    def update(self, tokens, end: int | None = None) -> None:
        """Index every n-gram of `tokens[:end]` that has a token after it and is not indexed yet (the context only
        grows between calls)."""
        L = len(tokens) if end is None else min(end, len(tokens))
        if L <= self.indexed:
            return
        if self.grow and (L - self.start) * LOAD > len(self.table) and self.bits < TABLE_BITS:
            while (L - self.start) * LOAD > (1 << self.bits) and self.bits < TABLE_BITS:
                self.bits += 1
            self.table = np.full(1 << self.bits, -1, dtype=np.int32)
            self._put(tokens, self.start, L)  # a larger table: the span again, in one vectorized pass
        else:
            self._put(tokens, self.indexed, L)
        self.indexed = L

    def lookup(self, tokens, lo: int = 0, hi: int | None = None) -> int | None:
        """The position right after an earlier occurrence of the last `n` tokens (lo <= it <= hi), or None."""
        if len(tokens) <= self.n:
            return None
        tail = np.asarray(tokens[-self.n:], dtype=np.int64)
        p = int(self.table[self._slots(tail[None, :])[0]])
        if p < max(self.n, lo) or p >= len(tokens) or (hi is not None and p > hi):
            return None
        if not np.array_equal(np.asarray(tokens[p - self.n:p], dtype=np.int64), tail):
            return None
        return p

    def draft(self, tokens, k: int) -> np.ndarray:
        """Up to `k` tokens that followed the last n-gram's earlier occurrence (empty when there is none)."""
        p = self.lookup(tokens) if k > 0 else None
        if p is None:
            return np.empty(0, dtype=np.intc)
        return np.asarray(tokens[p:min(p + k, len(tokens))], dtype=np.intc)


class Layer:
    """Tables (one per n-gram size) over the positions one writer indexed, from `start` on."""

    def __init__(self, grams: tuple[int, ...], start: int):
        self.start = start
        self.indexes = [NgramIndex(n, bits=None, start=start) for n in grams]

    @property
    def indexed(self) -> int:
        return self.indexes[0].indexed

    def update(self, tokens, end: int | None = None) -> None:
        for ix in self.indexes:
            ix.update(tokens, end)

    @property
    def nbytes(self) -> int:
        return sum(ix.nbytes for ix in self.indexes)


class ContextIndex:
    """One sequence's n-gram view of its context: shared layers, each cut where this context stops sharing it, and
    the layer it writes itself (the last). Lookups take the latest layer first: the most recent occurrence."""

    def __init__(self, grams: tuple[int, ...], layers: list[tuple[Layer, int | None]] | None = None, start: int = 0):
        self.grams = grams
        self.layers: list[tuple[Layer, int | None]] = list(layers or [])  # (layer, the position it is cut at)
        self.own = Layer(grams, start)
        self.layers.append((self.own, None))

    def update(self, tokens, end: int | None = None) -> None:
        """Index what this context has appended (up to `end`)."""
        self.own.update(tokens, end)

    def seal(self) -> None:
        """Later tokens go into a new layer: the one so far stays as it is for those who share it (a document's,
        a prompt's)."""
        if self.own.indexed > self.own.start:
            self.layers[-1] = (self.own, self.own.indexed)
            self.own = Layer(self.grams, self.own.indexed)
            self.layers.append((self.own, None))

    def fork(self, n: int) -> "ContextIndex":
        """The view of a context that shares this one's first `n` tokens and goes on with its own."""
        kept = []
        for layer, cut in self.layers:
            if layer.start >= n:
                break
            kept.append((layer, n if cut is None else min(cut, n)))
        return ContextIndex(self.grams, kept, start=n)

    def predict(self, tokens, k: int) -> np.ndarray:
        """Up to `k` tokens that followed the latest earlier occurrence of the context's longest indexed n-gram."""
        if k > 0:
            for g in range(len(self.grams)):
                for layer, cut in reversed(self.layers):
                    ix = layer.indexes[g]
                    p = ix.lookup(tokens, ix.start, cut)
                    if p is not None:
                        return np.asarray(tokens[p:min(p + k, len(tokens))], dtype=np.intc)
        return np.empty(0, dtype=np.intc)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer, _ in self.layers)
