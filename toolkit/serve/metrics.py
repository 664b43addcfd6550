"""`ctxq serve`'s metrics and the text of `/metrics`, through `prometheus_client`.

The same quantities as llama.cpp's server with `--metrics` (tools/server: `llamacpp:prompt_tokens_total`,
`llamacpp:tokens_predicted_total`, `llamacpp:prompt_tokens_seconds`, `llamacpp:predicted_tokens_seconds`,
`llamacpp:requests_processing`, `llamacpp:requests_deferred`), under ctxq_ names, plus answers by
status, the prompt tokens taken from the KV cache instead of being evaluated again, histograms of the
time to the first token and of a request's duration, and with `--parallel` the engine's sequences and
KV cells. Token counts come from the model's own `generate` (one at a time) or the engine's request.

Each server has a registry of its own (`Metrics.registry`), never prometheus_client's global one: the
tests run several servers in one process.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Upper bounds in seconds, about x2 apart as vLLM's histograms of the same names (vllm/engine/metrics.py),
# from a short prompt on a GPU (tens of ms) to past the default request time limit (ServeLimits.timeout,
# 600 s): a long prompt's prefill on a CPU takes minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)



class Metrics:
    """The server's metrics, shared by the event loop (answers, durations) and the generation threads
    (tokens, first tokens). `watch` and `watch_engine` add what is read at each scrape."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ctxq_requests", "HTTP answers by status.", ["status"], registry=r)
        self.time_to_first_token = Histogram(
            "ctxq_time_to_first_token_seconds", "Time from a completion request's arrival (its wait for the "
            "model included) to its first generated token, streamed or not.", buckets=TTFT_BUCKETS, registry=r)
        self.request_duration = Histogram(
            "ctxq_request_duration_seconds", "Time from a completion request's arrival to the end of its answer "
            "(a stream's last event), for requests let in to the model.", buckets=DURATION_BUCKETS, registry=r)
        # token counts and times: summed here under one lock, so that a throughput is read consistently
        self._lock = threading.Lock()
        self._tokens = dict.fromkeys(("prompt", "reused", "predicted", "prompt_s", "predicted_s", "drafted",
                                      "draft_accepted"), 0)
        r.register(_Tokens(self))

    def answered(self, status: int) -> None:
        self.requests.labels(str(status)).inc()

    def generated(self, prompt: int, reused: int, predicted: int, prompt_s: float, predicted_s: float):
        with self._lock:
            t = self._tokens
            t["prompt"] += prompt
            t["reused"] += reused
            t["predicted"] += predicted
            t["prompt_s"] += prompt_s
            t["predicted_s"] += predicted_s

    def drafted(self, drafted: int, accepted: int) -> None:
        """A request's draft tokens verified, and of those accepted (`--spec`)."""
        with self._lock:
            self._tokens["drafted"] += drafted
            self._tokens["draft_accepted"] += accepted

    def tokens(self) -> dict:
        with self._lock:
            return dict(self._tokens)

    def watch(self, *, processing, queued) -> None:
        """The gauges of requests generating and waiting, read from `processing()` and `queued()`."""
        Gauge("ctxq_requests_processing", "Requests generating now.", registry=self.registry).set_function(processing)
        Gauge("ctxq_requests_queued", "Requests waiting for the model.", registry=self.registry).set_function(queued)

    def watch_engine(self, engine) -> None:
        """The engine's sequences, KV cells and prompt tokens, from `engine()` (None while it loads)."""
        self.registry.register(_Engine(engine))

    def exposition(self) -> bytes:
        """The text of `/metrics` (prometheus_client's CONTENT_TYPE_LATEST)."""
        return generate_latest(self.registry)


class _Tokens:
    """prometheus_client collector: the token counts and times, and the throughputs they give."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        t = self.metrics.tokens()
        for name, text, value in (
                ("ctxq_prompt_tokens", "Prompt tokens of all requests.", t["prompt"]),
                ("ctxq_prompt_tokens_reused",
                 "Prompt tokens found in the KV cache (prefix reuse), not evaluated again.", t["reused"]),
                ("ctxq_tokens_predicted", "Generated tokens.", t["predicted"]),
                ("ctxq_prompt_seconds", "Time spent evaluating prompts.", t["prompt_s"]),
                ("ctxq_tokens_predicted_seconds", "Time spent generating.", t["predicted_s"]),
                # summed over requests; each response says its own (timings.draft_n, timings.draft_n_accepted)
                ("ctxq_draft_tokens", "Draft tokens verified (--spec).", t["drafted"]),
                ("ctxq_draft_accepted_tokens", "Draft tokens accepted (--spec).", t["draft_accepted"])):
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily("ctxq_prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                                value=_rate(t["prompt"] - t["reused"], t["prompt_s"]))
        yield GaugeMetricFamily("ctxq_predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                                value=_rate(t["predicted"], t["predicted_s"]))


class _Engine:
    """prometheus_client collector: `Engine.stats()` at each scrape (`--parallel`)."""

    GAUGES = (("sequences_active", "sequences_active", "Sequences the engine is decoding now."),
              ("sequences_queued", "queued", "Requests waiting in the engine for KV cells."),
              ("sequences_max", "n_seq_max", "Sequences the engine's context holds (n_seq_max)."),
              ("sequences_resident", "sequences_resident", "Idle sequences whose cells are kept for later requests."),
              ("kv_cells_total", "cells_total", "KV cells of the engine's context."),
              ("kv_cells_used", "cells_used", "KV cells in use."),
              ("kv_cells_shared", "cells_shared", "KV cells in use by more than one sequence."))
    COUNTERS = (("prompt_tokens_evaluated", "prompt_tokens_evaluated", "Prompt tokens the engine evaluated."),
                ("prompt_tokens_shared", "prompt_tokens_reused",
                 "Prompt tokens taken from cells another sequence holds."))

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine = self.engine()
        if engine is None:
            return
        s = engine.stats()
        for name, field, text in self.GAUGES:
            yield GaugeMetricFamily(f"ctxq_{name}", text, value=getattr(s, field))
        for name, field, text in self.COUNTERS:
            yield CounterMetricFamily(f"ctxq_{name}", text, value=getattr(s, field))


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


def metered(llm, metrics: Metrics, current):
    """`llm.generate` counting tokens and time, telling the request generating (`current()`, the gate's
    `Run`) of its first token, and ending the generation when the request should stop (client gone,
    time limit, shutdown): the completion then ends with finish_reason "length", as llama.cpp's server
    does when a request's `t_max_predict_ms` runs out."""
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
                run = current()
                if prompt_counted:
                    metrics.generated(0, 0, 1, 0.0, now - last)
                else:  # the first token comes with the prompt's evaluation
                    metrics.generated(len(tokens), reused, 1, now - last, 0.0)
                    prompt_counted = True
                    if run is not None:
                        run.first_token()
                last = now
                yield token
                if run is not None and run.should_stop():
                    return
        finally:
            if not prompt_counted:
                metrics.generated(len(tokens), reused, 0, time.perf_counter() - last, 0.0)
            stats = getattr(getattr(llm, "ctxq_spec", None), "stats", None)  # this request's drafts
            if stats is not None:
                metrics.drafted(stats.drafted, stats.accepted)

    return wrapper
