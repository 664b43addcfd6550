"""A bounded n-gram index over a context: where the last n tokens occurred before, and what followed them.

In the manner of llama.cpp's ngram-map (common/ngram-map.cpp, PR 18471) and ngram-mod (PR 19164): each n-gram is
hashed into a fixed table that keeps the position right after its latest occurrence, so memory stays constant
(`TABLE_BITS`) whatever the context's length, and a draft is the context's own continuation from there. A
collision only loses an n-gram: every hit is checked against the tokens before it is used.
"""

from __future__ import annotations

import numpy as np

TABLE_BITS = 20  # 2^20 int32 slots, 4 MiB: few collisions up to a few hundred thousand tokens of context
_MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing's multiplier (golden ratio times 2^64)


class NgramIndex:
    """The context's n-grams of `n` tokens, each pointing at what followed its latest occurrence."""

    def __init__(self, n: int = 3, bits: int = TABLE_BITS):
        self.n = n
        self.bits = bits
        self.table = np.full(1 << bits, -1, dtype=np.int32)
        self.indexed = 0  # n-grams followed by a position below this are in the table

    def reset(self) -> None:
        self.table.fill(-1)
        self.indexed = 0

    def _slots(self, windows: np.ndarray) -> np.ndarray:
        """Table slots of n-grams given as rows of `n` tokens."""
        h = np.zeros(len(windows), dtype=np.uint64)
        with np.errstate(over="ignore"):  # wrapping uint64 arithmetic is the hash
            for j in range(self.n):
                h = (h ^ windows[:, j].astype(np.uint64)) * _MUL
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def update(self, tokens: np.ndarray) -> None:
        """Index every n-gram of `tokens` that has a token after it (the context only grows between calls)."""
        L = len(tokens)
        first = max(self.indexed, self.n)  # the position after the first n-gram not yet indexed
        if L - 1 < first:
            return
        t = np.asarray(tokens[first - self.n:L - 1], dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(t, self.n)
        # positions in increasing order: numpy's assignment keeps the last of repeated slots, the latest occurrence
        self.table[self._slots(windows)] = np.arange(first, L, dtype=np.int32)
        self.indexed = L

    def lookup(self, tokens: np.ndarray) -> int | None:
        """The position right after an earlier occurrence of the last `n` tokens, or None."""
        if len(tokens) <= self.n:
            return None
        tail = np.asarray(tokens[-self.n:], dtype=np.int64)
        p = int(self.table[self._slots(tail[None, :])[0]])
        if p < self.n or p >= len(tokens) or not np.array_equal(tokens[p - self.n:p], tail):
            return None
        return p

    def draft(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """Up to `k` tokens that followed the last n-gram's earlier occurrence (empty when there is none)."""
        p = self.lookup(tokens) if k > 0 else None
        if p is None:
            return np.empty(0, dtype=np.intc)
        return np.asarray(tokens[p:min(p + k, len(tokens))], dtype=np.intc)
