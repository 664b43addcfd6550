"""`ctxq serve`'s counters and the Prometheus text of `/metrics`.

The same quantities as llama.cpp's server with `--metrics` (tools/server: `llamacpp:prompt_tokens_total`,
`llamacpp:tokens_predicted_total`, `llamacpp:prompt_tokens_seconds`, `llamacpp:predicted_tokens_seconds`,
`llamacpp:requests_processing`, `llamacpp:requests_deferred`), under ctxq_ names, plus answers by
status and the prompt tokens taken from the KV cache instead of being evaluated again.
Token counts come from the model's own `generate`, which every completion runs through.
"""

from __future__ import annotations

import threading
import time
from collections import Counter


class Metrics:
    """Counters shared by the event loop (answers) and the generation thread (tokens)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = Counter()  # status -> answers
        self.prompt_tokens = self.prompt_reused = self.predicted_tokens = 0
        self.prompt_seconds = self.predicted_seconds = 0.0
        self.extra = lambda: []  # more rows (name, type, help, samples): the engine's, with --parallel

    def answered(self, status: int) -> None:
        with self._lock:
            self.requests[status] += 1

    def generated(self, prompt: int, reused: int, predicted: int, prompt_s: float, predicted_s: float):
        with self._lock:
            self.prompt_tokens += prompt
            self.prompt_reused += reused
            self.predicted_tokens += predicted
            self.prompt_seconds += prompt_s
            self.predicted_seconds += predicted_s

    def render(self, *, processing: int, queued: int) -> str:
        """Prometheus text exposition format 0.0.4."""
        with self._lock:
            rows = [
                ("requests_total", "counter", "HTTP answers by status.",
                 [({"status": str(s)}, n) for s, n in sorted(self.requests.items())]),
                ("requests_processing", "gauge", "Requests generating now.", [({}, processing)]),
                ("requests_queued", "gauge", "Requests waiting for the model.", [({}, queued)]),
                ("prompt_tokens_total", "counter", "Prompt tokens of all requests.", [({}, self.prompt_tokens)]),
                ("prompt_tokens_reused_total", "counter",
                 "Prompt tokens found in the KV cache (prefix reuse), not evaluated again.", [({}, self.prompt_reused)]),
                ("tokens_predicted_total", "counter", "Generated tokens.", [({}, self.predicted_tokens)]),
                ("prompt_seconds_total", "counter", "Time spent evaluating prompts.", [({}, self.prompt_seconds)]),
                ("tokens_predicted_seconds_total", "counter", "Time spent generating.", [({}, self.predicted_seconds)]),
                ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
                 [({}, _rate(self.prompt_tokens - self.prompt_reused, self.prompt_seconds))]),
                ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
                 [({}, _rate(self.predicted_tokens, self.predicted_seconds))]),
            ]
        out = []
        for name, kind, text, samples in rows + self.extra():
            out += [f"# HELP ctxq_{name} {text}", f"# TYPE ctxq_{name} {kind}"]
            for labels, value in samples:
                tags = ",".join(f'{k}="{v}"' for k, v in labels.items())
                out.append(f"ctxq_{name}{{{tags}}} {value:g}" if tags else f"ctxq_{name} {value:g}")
        return "\n".join(out) + "\n"


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def reused_prefix(llm, tokens: list[int]) -> int:
    """Prompt tokens llama-cpp-python will keep from the KV cache: the common prefix of the tokens in
    the cache and the new prompt, one less when it is the whole prompt (`Llama.generate` decodes
    that one again to refresh the logits)."""
    cached = llm._input_ids[:llm.n_tokens]
    n = 0
    for a, b in zip(cached, tokens):
        if a != b:
            break
        n += 1
    return n - 1 if n and n == len(tokens) else n


def metered(llm, metrics: Metrics, should_stop):
    """`llm.generate` counting tokens and time, and ending the generation when `should_stop()` says
    so (client gone, time limit, shutdown): the completion then ends with finish_reason "length",
    as llama.cpp's server does when a request's `t_max_predict_ms` runs out."""
    generate = llm.generate

    def wrapper(tokens, *args, **kwargs):
        # counted as the tokens come: a stream whose client left is never resumed, and its
        # generator may be closed (running a `finally`) only at the next garbage collection
        tokens = list(tokens)
        reused = reused_prefix(llm, tokens) if llm.n_tokens else 0
        last = time.perf_counter()
        prompt_counted = False
        try:
            for token in generate(tokens, *args, **kwargs):
                now = time.perf_counter()
                if prompt_counted:
                    metrics.generated(0, 0, 1, 0.0, now - last)
                else:  # the first token comes with the prompt's evaluation
                    metrics.generated(len(tokens), reused, 1, now - last, 0.0)
                    prompt_counted = True
                last = now
                yield token
                if should_stop():
                    return
        finally:
            if not prompt_counted:
                metrics.generated(len(tokens), reused, 0, time.perf_counter() - last, 0.0)

    return wrapper
