"""`ctxq serve`'s gate: what every request passes before llama-cpp-python's routes.

The model generates for one request at a time (llama-cpp-python serves one sequence per `Llama`),
or for P at once with `--parallel P` (ctxq's engine, `parallel.py`); the gate keeps the others in
a bounded queue, answers what cannot be served at once with an
error in OpenAI's shape, and tells the generation when to stop: its client is gone, its time is up,
or the server is shutting down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from . import checks
from .body import parse
from .http_errors import INTERNAL, reject, send_error, send_rejection
from .limits import ServeLimits
from .output import checked, error_event
from .tools import check_tools

log = logging.getLogger(__name__)

# answered without the API key: a load balancer's probe has none, nor does a browser loading the page's files (the
# page then asks for the key and sends it on every call: page_routes.py)
PUBLIC = ("/health", "/")
PUBLIC_PREFIX = "/page/files/"
# answered while the model loads and while the server stops (the page draws the plan before the model is loaded)
ALWAYS = ("/metrics", "/v1/models", "/page/plan")
GENERATE = (checks.CHAT, *checks.COMPLETIONS)
# every route that reads a JSON body: it is parsed here first (nesting, surrogates), never by a route
BODIES = (*GENERATE, "/extras/tokenize", "/extras/tokenize/count", "/extras/detokenize")


class Run:
    """A request let in to the model (it came at `start`, time.monotonic()): when its generation must
    stop, and when its first token came (`first_token`, told by whoever generates it)."""

    def __init__(self, start: float, service: Service):
        self.start, self.service, self.gone = start, service, False
        self.deadline = start + service.limits.timeout
        self.first = None

    def should_stop(self) -> bool:
        return self.gone or time.monotonic() > min(self.deadline, self.service.shutdown_deadline)

    def first_token(self) -> None:
        if self.first is None:
            self.first = time.monotonic()
            self.service.metrics.time_to_first_token.observe(self.first - self.start)


class Service:
    """State shared by the gate, /health, /metrics and the generation thread."""

    def __init__(self, alias: str, names: set[str], n_ctx: int, limits: ServeLimits, metrics, concurrency: int = 1):
        self.alias, self.names, self.n_ctx, self.limits, self.metrics = alias, names, n_ctx, limits, metrics
        self.llm = None  # set by `ready` once the model is loaded
        # FIFO: asyncio wakes waiters in arrival order; `concurrency` requests generate at once
        self.slot = asyncio.Lock() if concurrency == 1 else asyncio.Semaphore(concurrency)
        self.waiting, self.current, self.active = 0, None, 0
        self.shutdown_deadline = math.inf
        self._waiters: set = set()
        self._loop = None
        self.started = int(time.time())  # /v1/models' `created`
        self._seconds = 1.0  # running mean of a request's time on the model (s), for Retry-After
        metrics.watch(processing=lambda: self.active, queued=lambda: self.waiting)

    def ready(self, llm, metered_generate: bool = True) -> None:
        """The model is loaded; `metered_generate`: count and stop llama-cpp-python's generations
        (the engine counts its own)."""
        from .metrics import metered

        if metered_generate:
            llm.generate = metered(llm, self.metrics, lambda: self.current)
        self.llm = llm

    @property
    def status(self) -> str:
        if self.shutdown_deadline < math.inf:
            return "stopping"
        if self.llm is None:
            return "loading"
        return "busy" if self.active else "ready"

    def retry_after(self) -> int:
        """Seconds until the queue ahead has likely drained (1 to 60)."""
        return max(1, min(60, math.ceil(self._seconds * (self.waiting + 1))))

    def begin_shutdown(self) -> None:
        """Called from the signal handler: stop admitting, answer the queue 503, give the running
        generation until the shutdown bound."""
        self.shutdown_deadline = time.monotonic() + self.limits.shutdown_timeout
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: [scope.cancel() for scope in list(self._waiters)])

    async def take(self, start: float) -> Run:
        """The model for a request that came at `start`, after waiting in the queue at most until
        its time limit; `give_back` it."""
        import anyio

        self._loop = asyncio.get_running_loop()
        if self.status == "stopping":  # the signal came while this request was being read
            raise _stopping()
        if self.slot.locked() and self.waiting >= self.limits.max_queue:
            raise reject(503, f"the server is busy: {self.waiting} requests are waiting (max_queue); try again "
                         "later", retry_after=self.retry_after(), code="server_overloaded")
        self.waiting += 1
        try:
            with anyio.move_on_after(max(0.0, start + self.limits.timeout - time.monotonic())) as waited:
                self._waiters.add(waited)
                await self.slot.acquire()
        finally:
            self.waiting -= 1
            self._waiters.discard(waited)
        if waited.cancelled_caught:
            if self.status == "stopping":
                raise _stopping()
            raise reject(503, f"the request waited {self.limits.timeout:g} s for the model, its time limit "
                         "(timeout)", retry_after=self.retry_after(), code="server_overloaded")
        self.current = Run(start, self)
        self.active += 1
        return self.current

    def give_back(self, start: float) -> None:
        self.current = None
        self.active -= 1
        self.slot.release()
        took = time.monotonic() - start
        self._seconds = 0.8 * self._seconds + 0.2 * took
        self.metrics.request_duration.observe(took)


class Gate:
    """ASGI middleware: API key, answers by status, and for completions the checks, the queue and
    the time limit."""

    def __init__(self, app, service: Service, api_key: str | None = None):
        self.app, self.service, self.api_key = app, service, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if scope["method"] == "HEAD":  # answered as GET without the body, wherever GET is
                await self._route({**scope, "method": "GET"}, receive, _without_body(counted))
            else:
                await self._route(scope, receive, counted)
        finally:  # an exception is answered 500 by the app's error handler, outside this middleware
            self.service.metrics.answered(status)

    async def _route(self, scope, receive, send):
        from starlette.exceptions import HTTPException

        svc = self.service
        if scope["path"] in PUBLIC or scope["path"].startswith(PUBLIC_PREFIX):
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await send_error(send, 401, "missing or wrong API key (send it as `Authorization: Bearer KEY`)",
                                    code="invalid_api_key")
        if svc.status in ("loading", "stopping") and scope["path"] not in ALWAYS:
            msg = "the model is loading" if svc.status == "loading" else "the server is shutting down"
            return await send_error(send, 503, f"{msg}; try again later", retry_after=5, code=f"server_{svc.status}")
        limit = svc.limits.max_body
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await send_rejection(send, _too_large(limit))
        receive = _bounded(receive, limit)  # a body sent without its length (chunked) is counted
        if scope["method"] == "POST" and scope["path"] in BODIES:
            try:
                return await self._with_body(scope, receive, send)
            except HTTPException as exc:
                if isinstance(exc.detail, dict):  # reject(...)
                    return await send_rejection(send, exc)
                raise
        return await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        if self.api_key is None:
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode(errors="replace")
        scheme, _, credentials = auth.partition(" ")
        return scheme.lower() == "bearer" and credentials.strip() == self.api_key

    async def _with_body(self, scope, receive, send):
        from starlette.concurrency import run_in_threadpool

        start = time.monotonic()
        body = await self._body(receive)
        if body is None:
            return  # the client left while sending
        data = await run_in_threadpool(parse, body)  # a large body is not parsed on the event loop
        if scope["path"] not in GENERATE:
            return await self.app(scope, _replay(body, receive), send)
        path, svc = scope["path"], self.service
        checks.is_object(data)
        limit = checks.output_limit(path, data)
        expected = checks.structured(path, data)
        checks.validate(path, data)
        checks.check_model(data, svc.alias, svc.names)
        if path == checks.CHAT:
            expected = await run_in_threadpool(check_tools, svc.llm, data) or expected
        n = await run_in_threadpool(checks.prompt_tokens, svc.llm, data, path, expected)
        checks.check_context(n, data, svc.n_ctx, limit)
        run = await svc.take(start)
        if expected is not None:
            expected.stopped = run.should_stop
        try:
            # "ctxq.run": for the engine's routes, which stop their own request (parallel.py)
            await self._run({**scope, "ctxq.run": run}, receive, checked(send, expected),
                            json.dumps(data).encode(), run)
        finally:
            svc.give_back(start)

    @staticmethod
    async def _body(receive) -> bytes | None:
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        return b"".join(chunks)

    async def _run(self, scope, receive, send, body: bytes, run: Run):
        """The app on the checked body; a client that disconnects ends the generation. One task
        reads the connection and tells every reader of a disconnect (two readers would race)."""
        import anyio

        gone = anyio.Event()
        replayed = False

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            run.gone = True
            gone.set()

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            if not run.gone:  # starlette polls with a cancelled scope: answer a disconnect only once it came
                await gone.wait()
            return {"type": "http.disconnect"}

        streaming, last = False, None

        async def tracked(message):
            nonlocal streaming, last
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if streaming and message["type"] == "http.response.body" and not message.get("more_body", False):
                last = message  # sse-starlette ends the stream before the error reaches here: held
                return
            await send(message)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            try:
                await self.app(scope, replay, tracked)
                if last is not None:
                    await send(last)
            except Exception as exc:  # a group from sse-starlette's task group, too
                if not streaming:
                    raise
                # the status went out with the stream's start: the error ends the stream instead
                log.error("%s %s failed in its stream", scope["method"], scope["path"], exc_info=exc)
                if last is not None and last.get("body"):
                    await send({**last, "more_body": True})
                if not run.gone:
                    await send({"type": "http.response.body", "body": error_event(INTERNAL, "internal_error")})
            finally:
                tg.cancel_scope.cancel()


def _stopping():
    return reject(503, "the server is shutting down; try again later", retry_after=5, code="server_stopping")


def _too_large(limit: int):
    return reject(413, f"the request body is over {limit} bytes, this server's limit (max_body)",
                  code="request_too_large")


def _replay(body: bytes, receive):
    """`receive` that gives the body read already, then what the connection says."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _without_body(send):
    """`send` for a HEAD request: the GET answer's status and headers, no body (RFC 9110 9.3.2)."""

    async def head(message):
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return head


def _bounded(receive, limit: int):
    """`receive` that answers 413 (raises it) once the body grows past `limit` bytes."""
    size = 0

    async def bounded():
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > limit:
            raise _too_large(limit)
        return message

    return bounded
