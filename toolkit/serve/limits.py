"""`ctxq serve`'s limits, one object (`ServeLimits`); the gate that enforces them is `gate.py`.
Its defaults are the command line's (`ctxq serve --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidOption
from ..units import MiB


@dataclass(frozen=True)
class ServeLimits:
    """max_body: bytes of a request body (a 128k-token prompt is a few MiB of JSON);
    max_queue: requests waiting for the model behind the one generating; beyond them, 503;
    timeout: seconds a request may take, waiting included (llama.cpp's server: `--timeout` 600);
    shutdown_timeout: seconds in-flight requests get to finish after SIGTERM or Ctrl-C, below
    Kubernetes' default 30 s grace period, so that the exit is ctxq's own."""

    max_body: int = 64 * MiB
    max_queue: int = 32
    timeout: float = 600.0
    shutdown_timeout: float = 20.0

    def __post_init__(self):
        for key in ("max_body", "max_queue", "timeout", "shutdown_timeout"):
            value = getattr(self, key)
            least = 0 if key in ("max_queue", "shutdown_timeout") else 1
            if not isinstance(value, (int, float)) or value < least:
                raise InvalidOption(f"`{key}` is {value!r}; it must be a number, {least} or more",
                                    option=key, value=value, limit=least)
