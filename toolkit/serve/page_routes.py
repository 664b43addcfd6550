"""The page `ctxq serve` answers at `/` (issue 62) and the routes it calls, behind the same gate as the API.

- `/` and `/page/files/NAME`: the page's own files (package data in `page/`), public like `/health` (a browser
  loads a module script without the API key); every answer of this module carries a Content-Security-Policy that
  allows the page's own files only, so nothing a document or a model says can load or run anything.
- `/page/plan`: the served plan as the page draws it (`page_plan.view`); POST plans the served model again with
  another context, KV type or set of cards (`--gpus`' words) without touching the loaded model.
- `/page/document`: POST a document (text, bounded by `--max-body` in the gate) to read it: its tokens as the chat
  template puts them at the start of a user turn are evaluated once and held, so a question sent after it
  (`/v1/chat/completions`, the document then a blank line then the question) reads only its own tokens: on the
  engine (`--parallel`) the document's sequence stays resident and is shared (`Engine.prefill`), one at a time the
  `Llama` keeps it as the prefix llama-cpp-python reuses. GET gives the job's state (a reloaded page finds it),
  `/page/document/events` streams it as server-sent events until the reading ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace

from ..errors import CtxqError
from .http_errors import INTERNAL, reject
from .page_plan import page_file, page_files, view

# the page's own files and fetches only: no inline script or style, nothing from another origin
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
FILES = "/page/files/"
log = logging.getLogger(__name__)
TICK_S = 0.25  # how often the progress stream looks at the job: a few updates a second, as a person reads them


def document_tokens(llm, fmt, text: str) -> list[int]:
    """The tokens every question about `text` starts with: the chat template's start of a user turn holding the
    document, cut where the tokens of the turn with a question after a blank line stop agreeing with the cut text's
    (a merge across the cut differs; `runtime.generate.input_tokens` cuts a session's document the same way)."""
    if fmt is None:
        raise reject(400, "this model has no chat template (tokenizer.chat_template); the page asks questions "
                     "through /v1/chat/completions", code="invalid_value")
    probe = text + "\n\nQ"
    result = fmt(messages=[{"role": "user", "content": probe}])
    at = result.prompt.rfind(probe)
    add_bos = not result.added_special
    whole = llm.tokenize(result.prompt.encode("utf-8"), add_bos=add_bos, special=True)
    cut = llm.tokenize(result.prompt[:at + len(text)].encode("utf-8"), add_bos=add_bos, special=True)
    n = next((i for i, (a, b) in enumerate(zip(whole, cut)) if a != b), min(len(whole), len(cut)))
    return whole[:n]


class Reading:
    """The one document the page reads: its text and the job's state, kept by the server so that a page that
    reloads finds it (`state`: idle, reading, read, failed)."""

    def __init__(self):
        self.text, self.state, self.error, self.version = "", "idle", None, 0
        self.total = self.done = self.start_done = 0
        self.started = self.ended = 0.0
        self.task = None  # the running job (held: asyncio keeps only a weak reference)

    def begin(self, text: str, total: int) -> None:
        self.text, self.state, self.error, self.total = text, "reading", None, total
        self.done = self.start_done = 0
        self.started, self.ended = time.monotonic(), 0.0
        self.version += 1

    def progress(self, done: int, held: int | None = None) -> None:
        """`done` tokens of the document are in the cells; `held` of them were there already (a document read
        before, shared): not part of this reading's rate."""
        if held is not None:
            self.start_done = held
        if done != self.done:
            self.done = done
            self.version += 1

    def end(self, error: str | None = None) -> None:
        self.state, self.error, self.ended = ("failed", error, time.monotonic()) if error else \
            ("read", None, time.monotonic())
        if not error:
            self.done = self.total
        self.version += 1

    def snapshot(self, with_text: bool = False) -> dict:
        now = self.ended or time.monotonic()
        elapsed = max(0.0, now - self.started) if self.started else 0.0
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 and self.state == "reading" else None
        out = {"state": self.state, "tokens": self.total, "done": self.done, "reused": self.start_done,
               "rate": round(rate, 1), "eta_s": None if left is None else round(left, 1),
               "elapsed_s": round(elapsed, 2), "error": self.error, "version": self.version}
        if with_text:
            out["text"] = self.text
        return out


async def _read_engine(backend, tokens: list[int], reading: Reading) -> None:
    """`--parallel`: the engine evaluates the document into a sequence that stays resident for the questions."""
    req = backend.engine.prefill(tokens)
    while not req.done:
        reading.progress(req.prompt_done, held=req.cached_tokens)  # cached: shared from a resident sequence
        await asyncio.sleep(TICK_S / 2)
    if req.finish_reason not in ("length", "stop"):
        raise CtxqError(f"the engine ended the reading: {req.finish_reason}")


def _read_llama(llm, tokens: list[int], reading: Reading, stopping) -> None:
    """One at a time: the `Llama` evaluates the document in n_batch chunks after the prefix it already holds, and
    keeps it; llama-cpp-python's own prefix reuse then starts each question after it (`Llama.generate`)."""
    from .metrics import reused_prefix

    held = reused_prefix(llm, tokens) if llm.n_tokens else 0
    llm.n_tokens = held  # Llama.eval drops the cells from n_tokens on before it evaluates
    reading.progress(held, held=held)
    for i in range(held, len(tokens), llm.n_batch):  # the chunks Llama.eval would cut, one progress step each
        if stopping():
            raise CtxqError("the server is shutting down")
        llm.eval(tokens[i:i + llm.n_batch])
        reading.progress(min(i + llm.n_batch, len(tokens)))


def install(app, service, plan, options, backend=None) -> None:
    """The page's routes on `app`; `plan` is the served plan, `options` the PlanOptions it was made with (the
    re-plan changes only what the form gives), `backend` the engine's (`--parallel`) or None."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, Response, StreamingResponse

    from ..runtime.runner import make_plan
    from .openai_shapes import formatter

    reading, replanning = Reading(), asyncio.Lock()
    served = view(plan)
    names = set(page_files())

    def answer(body: dict, status: int = 200):
        return JSONResponse(body, status_code=status, headers=HEADERS)

    async def index(request):
        return Response(page_file("index.html"), media_type=TYPES[".html"], headers=HEADERS)

    async def files(request):
        name = request.path_params["name"]
        suffix = name[name.rfind("."):] if "." in name else ""
        if name not in names or suffix not in TYPES:
            raise reject(404, f"the page has no file {name!r}", code="not_found")
        return Response(page_file(name), media_type=TYPES[suffix], headers=HEADERS)

    async def get_plan(request):
        return answer({"plan": served, "served": True, "n_ctx": service.n_ctx, "max_body": service.limits.max_body,
                       "parallel": backend is not None, "status": service.status})

    async def post_plan(request):
        data = _json_object(await request.body())
        given = {k: data.get(k) for k in ("n_ctx", "kv", "gpus")}
        if given["n_ctx"] is not None and (isinstance(given["n_ctx"], bool) or not isinstance(given["n_ctx"], int)):
            raise reject(400, "`n_ctx` must be a whole number of tokens", param="n_ctx", code="invalid_value")
        for key in ("kv", "gpus"):
            if given[key] is not None and not isinstance(given[key], str):
                raise reject(400, f"`{key}` must be text", param=key, code="invalid_value")
        opts = options.updated(n_ctx=given["n_ctx"], kv=given["kv"] or None)
        if given["gpus"]:  # another set of cards, as `--gpus` describes them: the served devices are not asked
            opts = replace(opts, gpus=given["gpus"], rpc=None, simulate=None, profile=None)
        async with replanning:  # one at a time: each plan runs llama.cpp's dry runs in child processes
            try:
                p = await run_in_threadpool(make_plan, plan.model, options=opts)
            except CtxqError as e:  # the plan's own one line (a setting that does not fit says why)
                raise reject(400, str(e), param=getattr(e, "option", None), code="plan_failed") from None
        return answer({"plan": view(p), "served": False})

    async def post_document(request):
        if reading.state == "reading":
            raise reject(409, "a document is being read; wait for it to finish", code="busy")
        try:
            text = (await request.body()).decode("utf-8")
        except UnicodeDecodeError:
            raise reject(400, "the document is not UTF-8 text", code="invalid_value") from None
        if not text.strip():
            raise reject(400, "the document is empty", code="invalid_value")
        llm = backend.llm if backend is not None else service.llm
        fmt = backend.fmt if backend is not None else formatter(llm)
        tokens = await run_in_threadpool(document_tokens, llm, fmt, text)
        if len(tokens) >= service.n_ctx:  # refused before anything is evaluated, with both numbers
            raise reject(400, f"the document is {len(tokens):,} tokens and the context holds {service.n_ctx:,} "
                         "(--ctx), with room needed for a question and its answer; send a shorter document or "
                         "serve a larger context", code="context_length_exceeded", prompt_tokens=len(tokens),
                         n_ctx=service.n_ctx)
        if reading.state == "reading":  # another came in while this one was tokenized
            raise reject(409, "a document is being read; wait for it to finish", code="busy")
        reading.begin(text, len(tokens))
        reading.task = asyncio.create_task(_job(tokens))
        return answer(reading.snapshot(), 202)

    async def _job(tokens):
        try:
            if backend is not None:
                await _read_engine(backend, tokens, reading)
            else:
                async with service.slot:  # between two generations, never during one
                    await run_in_threadpool(_read_llama, service.llm, tokens, reading,
                                            lambda: service.status == "stopping")
        except CtxqError as e:  # told to the page; the server goes on
            reading.end(str(e))
        except Exception:  # a real fault: logged with its traceback, the page told no library's text
            log.exception("reading the page's document failed")
            reading.end(INTERNAL)
        else:
            reading.end()

    async def get_document(request):
        return answer(reading.snapshot(with_text=reading.state in ("reading", "read")))

    async def events(request):
        async def stream():
            seen = -1
            while True:
                if reading.version != seen:
                    seen = reading.version
                    yield f"data: {json.dumps(reading.snapshot())}\n\n".encode()
                if reading.state != "reading" or service.status == "stopping":
                    return
                await asyncio.sleep(TICK_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={**HEADERS, "X-Accel-Buffering": "no"})

    app.router.add_route("/", index, methods=["GET"])
    app.router.add_route(FILES + "{name}", files, methods=["GET"])
    app.router.add_route("/page/plan", get_plan, methods=["GET"])
    app.router.add_route("/page/plan", post_plan, methods=["POST"])
    app.router.add_route("/page/document", get_document, methods=["GET"])
    app.router.add_route("/page/document", post_document, methods=["POST"])
    app.router.add_route("/page/document/events", events, methods=["GET"])


def _json_object(body: bytes) -> dict:
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        raise reject(400, "the body is not JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise reject(400, "the body must be a JSON object", code="invalid_value")
    return data

