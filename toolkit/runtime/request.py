"""What a caller holds for one submitted request: its stream of events and, at the end, its result.

The engine's thread writes; any thread (or an asyncio task) reads. Nothing here touches llama.cpp.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

_END = object()  # the stream's last item


@dataclass
class Event:
    """One streamed piece: the text since the last event (UTF-8 safe, stop strings held back) and
    the token that produced it (None for the text flushed at the end)."""

    text: str
    token: int | None


@dataclass
class Result:
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens shared with a resident sequence, not evaluated
    completion_tokens: int
    draft_n: int = 0  # draft tokens verified (llama-server's timings.draft_n)
    draft_n_accepted: int = 0  # of those, accepted (timings.draft_n_accepted)


class Request:
    """A submitted request (thread-safe): iterate it for events, `result()` for the whole text,
    `cancel()` when its client leaves."""

    def __init__(self, engine, n_prompt: int):
        self._engine = engine
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._parts: list[str] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = n_prompt
        self.cached_tokens = 0
        self.prompt_done = 0  # prompt tokens in its cells so far (shared or evaluated): a prefill's progress
        self.completion_tokens = 0
        self.draft_n = self.draft_n_accepted = 0  # drafted and accepted tokens (engine_spec.verify)
        self.error: Exception | None = None
        self.cancelled = False  # asked for; finish_reason says when it took effect

    # --- readers ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Event]:
        while True:
            item = self._events.get()
            if item is _END:
                self._events.put(_END)  # a second reader (or result()) also sees the end
                return
            yield item

    async def aiter(self) -> AsyncIterator[Event]:
        """The events for asyncio code: each wait runs in a worker thread, so the loop never blocks."""
        while True:
            item = await asyncio.to_thread(self._events.get)
            if item is _END:
                self._events.put(_END)
                return
            yield item

    def cancel(self) -> None:
        """The client left: the engine frees its sequence and cells before its next step."""
        self.cancelled = True
        self._engine._cancel(self)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the request has finished (for whatever reason)."""
        return self._done.wait(timeout)

    def result(self) -> Result:
        """Waits for the end; the whole text."""
        self._done.wait()
        return Result("".join(self._parts), self.finish_reason or "error", self.prompt_tokens,
                      self.cached_tokens, self.completion_tokens, self.draft_n, self.draft_n_accepted)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # --- the engine's side -------------------------------------------------------------------------

    def _emit(self, text: str, token: int | None) -> None:
        if text:
            self._parts.append(text)
        self._events.put(Event(text, token))

    def _finish(self, reason: str, error: Exception | None = None) -> None:
        if self._done.is_set():
            return
        self.finish_reason, self.error = reason, error
        self._done.set()
        self._events.put(_END)


@dataclass
class EngineStats:
    sequences_active: int
    queued: int
    n_seq_max: int
    cells_total: int
    cells_used: int
    cells_shared: int
    prompt_tokens_evaluated: int
    prompt_tokens_reused: int
    tokens_generated: int
    sequences_resident: int = 0  # idle sequences whose cells are kept for later requests
    steps: int = 0  # llama_decode calls
    tokens_drafted: int = 0  # draft tokens verified (engine_spec.py)
    tokens_draft_accepted: int = 0  # of those, accepted


# The fields of EngineStats the engine counts up as it runs (the rest are read off its state).
COUNTED = ("prompt_tokens_evaluated", "tokens_generated", "steps", "tokens_drafted", "tokens_draft_accepted")
