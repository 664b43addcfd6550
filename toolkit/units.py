"""Units and small arithmetic shared by every stage. Sizes are integer bytes inside ctxq;
GiB and MiB appear only where a person reads or types a number."""

from __future__ import annotations

import os

MiB = 1024**2
GiB = 1024**3


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (GGML_PAD, GGUF alignment, KV cells of 256)."""
    return -(-n // multiple) * multiple


def default_threads() -> int:
    """Every CPU this process may use. llama-cpp-python's default halves cpu_count() for decoding,
    which leaves one of two cores idle here; llama.cpp's own CLI uses the physical cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def last_error_line(lines: list[str], default: str = "run with CTXQ_DEBUG=1 for llama.cpp's log") -> str:
    """The last line of a llama.cpp log that reports an error or a failure (for one-line errors)."""
    for line in reversed(lines):
        low = line.lower()
        if "error" in low or "failed" in low:
            return line.strip()
    return default
