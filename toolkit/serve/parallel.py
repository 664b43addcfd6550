"""`ctxq serve --parallel P`: /v1/chat/completions and /v1/completions answered by ctxq's engine
(`ctxq.runtime.engine`: one llama.cpp context, P sequences decoded together, prompts that start alike
sharing their KV cells), behind the same gate as the one-at-a-time server (`gate.py`: API key,
checks, limits, queue, time limit, shutdown; `output.py`: structured output checked).

The gate lets P requests in at once; the engine admits each while the KV cells it may need are free
and queues it otherwise. A request that can never fit (its prompt and max_tokens over all the cells)
is refused by the engine with both numbers, answered here as a 400. A request whose time is up, or
whose client left, is cancelled in the engine, which frees its sequence and cells at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from . import openai_shapes as oa
from .http_errors import reject

log = logging.getLogger(__name__)

ANSWER_CELLS = 512  # the private cells counted for one sequence's question and answer (default P)
MAX_DEFAULT_P = 16


def auto_plan(make) -> tuple:
    """(plan, P, why) for `--parallel auto`: the most sequences, at most MAX_DEFAULT_P and as many as the n_ctx
    cells hold ANSWER_CELLS-cell answers of, halving from there, whose plan (its output rows, states and
    compute for P sequences: `PlanOptions.parallel`) fits without moving a layer off the GPUs that the
    one-sequence plan keeps there. `make(P)` plans for P sequences (None: one, llama.cpp's defaults)."""
    from ..errors import DoesNotFit

    one = make(None)
    n = max(1, min(MAX_DEFAULT_P, one.n_ctx // ANSWER_CELLS))
    while True:
        try:
            p = make(n)
        except DoesNotFit:
            p = None
        if n == 1 or (p is not None and p.n_gpu_layers >= one.n_gpu_layers):
            break
        n //= 2
    if p is None:  # one sequence in the engine's context needs less than the plan for llama.cpp's defaults
        p = make(1)
    free = min((d.free for d in p.devices if d.layers or d is p.host), default=0)
    why = (f"{n} sequences share the {p.n_ctx:,} KV cells ({ANSWER_CELLS} cells of answer each, at most "
           f"{MAX_DEFAULT_P}; the plan for {n} leaves {free / 2**20:,.0f} MiB free)")
    return p, n, why


def default_parallel(p, n_vocab: int, state_per_seq: int = 0) -> tuple[int, str]:
    """(P, why) when --parallel is given without a number: as many sequences as the plan's n_ctx
    cells hold 512-cell answers of (the document's cells are shared), at most 16, and no more than
    the plan's free memory holds their own buffers: llama.cpp's output row (n_vocab x 4 B a sequence,
    `llama_context::output_reserve`) and, for a recurrent model, one state each."""
    per_seq = 4 * n_vocab + state_per_seq
    free = min((d.free for d in p.devices if d.layers or d is p.host), default=0)
    by_memory = max(1, free // per_seq) if per_seq else MAX_DEFAULT_P
    n = max(1, min(MAX_DEFAULT_P, p.n_ctx // ANSWER_CELLS, by_memory))
    why = (f"{n} sequences share the {p.n_ctx:,} KV cells ({ANSWER_CELLS} cells of answer each, at most "
           f"{MAX_DEFAULT_P}; the plan leaves {free / 2**20:,.0f} MiB free, {per_seq / 2**20:.2f} MiB a sequence)")
    return n, why


class Backend:
    """The engine and what the routes need from the model (its tokenizer and chat template)."""

    def __init__(self, service, seed: int | None = None, spec: str | None = None):
        self.service, self.seed, self.spec = service, seed, spec
        self.engine = self.llm = self.fmt = None  # set by `ready`, before the gate lets a request in
        self._count = 0

    def ready(self, engine, llm) -> None:
        import anyio

        self.engine, self.llm, self.fmt = engine, llm, oa.formatter(llm)
        self.limiter = anyio.CapacityLimiter(engine.n_seq_max + self.service.limits.max_queue + 8)

    def spec_settings(self, plan) -> dict:
        """The engine's drafting (`Engine(spec=, spec_cost=)`) for `--spec` on `plan`: `auto` with the cost `ctxq
        bench --spec` measured there, and it decides per sequence."""
        from ..runtime import engine_spec

        mode, cost, _ = engine_spec.for_plan(plan, self.spec)
        return {"spec": mode, "spec_cost": cost}

    def next_seed(self) -> int | None:
        """The server's --seed, a different one per request (as one Llama's RNG would move on)."""
        if self.seed is None:
            return None
        self._count += 1
        return self.seed + self._count


async def _events(req, run, limiter):
    """The engine's events for a request; its time limit, a shutdown or its client leaving cancel it.
    Each wait runs in a thread of `limiter` (one per sequence and queued request): `Request.aiter`
    waits in asyncio's default executor, cpu_count + 4 threads, which 8 waiting requests would fill."""
    import anyio

    async def watch():
        while not run.should_stop():
            await asyncio.sleep(0.05)
        req.cancel()

    watcher = asyncio.create_task(watch())
    events = iter(req)
    try:
        while (ev := await anyio.to_thread.run_sync(next, events, None, abandon_on_cancel=True,
                                                    limiter=limiter)) is not None:
            yield ev
    finally:
        watcher.cancel()
        if req.finish_reason is None:  # left before the end (the stream was cancelled)
            req.cancel()


def _reason(req) -> str:
    """The finish_reason to report; an engine error is raised (a 500, or a stream's error event)."""
    reason = req.finish_reason
    if reason == "error":
        raise req.error or RuntimeError("the engine failed on this request")
    # cancelled by its time limit or a shutdown: the answer so far, as a generation cut short
    return "length" if reason == "cancelled" else reason


def _submit(backend: Backend, prompt: oa.Prompt):
    from ..errors import DoesNotFit, InvalidOption

    try:
        return backend.engine.submit(prompt.tokens, prompt.params)
    except InvalidOption as e:  # a sampling value llama.cpp's samplers cannot take (SamplingParams.check)
        raise reject(400, str(e), param=e.option, code="invalid_value") from None
    except DoesNotFit as e:
        raise reject(400, f"this request needs {e.value:,} KV cells (its {len(prompt.tokens):,}-token prompt and "
                     f"max_tokens {prompt.params.max_tokens:,}) but the server holds {e.limit:,}; shorten it or "
                     "ask for fewer tokens", code="context_length_exceeded", cells_needed=e.value,
                     cells_total=e.limit, prompt_tokens=len(prompt.tokens)) from None


def endpoint(backend: Backend, path: str):
    """The Starlette endpoint for `path` (chat or text completions)."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, StreamingResponse

    svc = backend.service

    async def complete(request):
        run = request.scope["ctxq.run"]  # the gate's: when this request must stop
        data = json.loads(await request.body())
        prompt = await run_in_threadpool(oa.read, backend.llm, backend.fmt, data, path, svc.n_ctx,
                                         backend.next_seed())
        start = time.perf_counter()
        req = _submit(backend, prompt)
        if prompt.stream:
            return StreamingResponse(_stream(backend, prompt, req, run, start), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts, first = [], None
        async for ev in _events(req, run, backend.limiter):
            first = first or _first(run)
            parts.append(ev.text)
        reason = _reason(req)
        _count(svc, req, start, first)
        use = oa.usage(req.prompt_tokens, req.cached_tokens, req.completion_tokens)
        return JSONResponse(oa.answer(prompt, svc.alias, "".join(parts), reason, use, _timings(backend, req)))

    return complete


async def _stream(backend: Backend, prompt: oa.Prompt, req, run, start: float):
    svc, first = backend.service, None
    try:
        if prompt.chat:
            yield oa.chunk(prompt, svc.alias, None, first=True)
        async for ev in _events(req, run, backend.limiter):
            first = first or _first(run)
            if ev.text:
                yield oa.chunk(prompt, svc.alias, ev.text)
        yield oa.chunk(prompt, svc.alias, None, _reason(req), times=_timings(backend, req))
        if prompt.include_usage:
            yield oa.usage_chunk(prompt, svc.alias, oa.usage(req.prompt_tokens, req.cached_tokens,
                                                             req.completion_tokens))
        yield oa.DONE
    finally:
        _count(svc, req, start, first)


def _timings(backend: Backend, req) -> dict | None:
    """The response's `timings` (drafted and accepted tokens) when the engine drafts."""
    return oa.timings(req) if backend.engine.spec.active else None


def _first(run) -> float:
    """At a request's first event, which comes with its first token: tell the gate's `Run` (the time to
    the first token is counted as the event reaches this route); the time for `_count`."""
    run.first_token()
    return time.perf_counter()


def _count(svc, req, start: float, first: float | None) -> None:
    now = time.perf_counter()
    first = first or now
    svc.metrics.generated(req.prompt_tokens or 0, req.cached_tokens or 0, req.completion_tokens or 0,
                          first - start, now - first)
    svc.metrics.drafted(req.draft_n, req.draft_n_accepted)


def install(app, backend: Backend) -> None:
    """The two completion routes on the engine (before any other route with their paths)."""
    from .checks import CHAT, COMPLETIONS

    for path in (CHAT, *COMPLETIONS):
        app.router.add_route(path, endpoint(backend, path), methods=["POST"])
    backend.service.metrics.watch_engine(lambda: backend.engine)
