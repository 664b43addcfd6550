"""The loss-for-bytes front: the configurations no other beats in both loss and bytes."""

from __future__ import annotations


def front(rows: list[tuple[object, int, float]]) -> list:
    """The names of `rows` ((name, bytes, loss), ...) that no other row dominates (bytes and loss both at most
    its own, one of them less), in the order given."""
    kept = []
    for name, size, loss in rows:
        if not any(b <= size and lo <= loss and (b < size or lo < loss) for _, b, lo in rows):
            kept.append(name)
    return kept
