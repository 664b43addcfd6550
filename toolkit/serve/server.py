"""`ctxq serve`: llama-cpp-python's OpenAI-compatible routes over the plan's model, as a service.

The routes are llama-cpp-python's own (`llama_cpp.server.app.router`: chat and text completions,
streaming, embeddings, tokenize), registered again with FastAPI's plain route class so that every
error reaches ctxq's handlers (`http_errors.py`: OpenAI's shape, no tracebacks or paths); the model is
loaded by `runtime.runner.load_plan`, exactly as `ctxq run` loads it, in `create_app`'s `load`. ctxq adds:

- `gate.Gate`: the API key, request checks (fields, model name, prompt and max_tokens
  against the context), a bounded queue, a time limit per request, stopping a generation whose
  client left, and a graceful shutdown;
- `/health` (loading / ready / busy / stopping, with the queue; no key needed), `/metrics`
  (`metrics.py`: prometheus_client's text of the server's own registry), and `/v1/models`
  answered without waiting for the model.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..errors import InvalidOption
from ..planning.planner import Plan
from ..runtime import speculative
from ..runtime.runner import check_vocabulary, engine_memory, load_plan
from ..runtime.session import restore_session
from .gate import Gate, Service
from .http_errors import reject, validation_error
from .limits import ServeLimits
from .metrics import Metrics

# answered by ctxq: llama-cpp-python's /v1/models waits for the model's lock, its /v1/embeddings
# needs a model loaded with embedding=True, which a plan for generation is not, and its
# /extras/detokenize hands llama.cpp any token id (one outside the vocabulary aborts the process:
# std::out_of_range in llama_vocab::token_get_attr) and decodes half a UTF-8 character strictly
OWN_ROUTES = {"/v1/models", "/v1/embeddings", "/extras/detokenize"}


def _proxy(llm, alias: str):
    """llama-cpp-python's LlamaProxy holding the model ctxq loaded (its own constructor would load
    the model again from ModelSettings, which lacks some of the plan's parameters, e.g. swa_full)."""
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings

    class PlannedProxy(LlamaProxy):
        def __init__(self):
            settings = ModelSettings(model=llm.model_path, model_alias=alias)
            self._model_settings_dict = {alias: settings}
            self._default_model_settings = settings
            self._default_model_alias = self._current_model_alias = alias
            self._current_model = llm

    return PlannedProxy()


def _fixed_schema_grammars() -> None:
    """llama-cpp-python's chat handlers compile a tool's parameters (and json_object's schema) with
    `LlamaGrammar.from_json_schema`; in the server's process it uses `json_schema.compile_schema`, the
    converter with JSON's string rule (the gate has already refused the schemas it cannot honour)."""
    import json

    from llama_cpp.llama_grammar import LlamaGrammar

    from .json_schema import compile_schema

    def from_json_schema(cls, json_schema: str, verbose: bool = True):
        return cls.from_string(compile_schema(json.loads(json_schema)), verbose=verbose)

    LlamaGrammar.from_json_schema = classmethod(from_json_schema)


def _routes(app, service: Service, plan_flags: str) -> None:
    """ctxq's routes, then llama-cpp-python's with the plain APIRoute: its RouteErrorHandler would
    answer a malformed request 500 with the exception's text (a traceback line, its file path)."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, Response
    from llama_cpp.server import app as server_app
    from llama_cpp.server.types import DetokenizeInputRequest
    from prometheus_client import CONTENT_TYPE_LATEST
    from pydantic import ValidationError

    @app.get("/health")
    def health():
        status = service.status
        body = {"status": status, "model": service.alias, "n_ctx": service.n_ctx, "plan": plan_flags,
                "processing": service.active, "queue": service.waiting}
        return JSONResponse(body, status_code=503 if status in ("loading", "stopping") else 200)

    @app.get("/metrics")
    def metrics():
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": service.alias, "object": "model", "created": service.started,
                                            "owned_by": "ctxq", "n_ctx": service.n_ctx}]}

    @app.post("/v1/embeddings")
    def embeddings():
        raise reject(404, "this server generates text; it does not compute embeddings", code="not_found")

    async def detokenize(request):  # a plain Starlette endpoint: the gate has checked the JSON
        try:
            tokens = DetokenizeInputRequest.model_validate(await request.json()).tokens
        except ValidationError as e:
            message, param = validation_error(e.errors(include_url=False, include_input=False))
            raise reject(400, message, param=param, code="invalid_value") from None
        llm = service.llm
        outside = [t for t in tokens if not 0 <= t < llm.n_vocab()]
        if outside:
            raise reject(400, f"`tokens` holds {outside[0]}, outside the vocabulary (0 to {llm.n_vocab() - 1})",
                         param="tokens", code="invalid_value")
        # a token may hold part of a UTF-8 character: shown as U+FFFD, as llama.cpp's server does
        return JSONResponse({"text": llm.detokenize(tokens).decode("utf-8", errors="replace")})

    app.router.add_route("/extras/detokenize", detokenize, methods=["POST"])

    router = APIRouter()
    for r in server_app.router.routes:
        if r.path not in OWN_ROUTES:
            router.add_api_route(r.path, r.endpoint, methods=list(r.methods), name=r.name,
                                 dependencies=r.dependencies, response_model=r.response_model,
                                 summary=r.summary, tags=r.tags, include_in_schema=r.include_in_schema)
    app.include_router(router)


def create_app(p: Plan, *, api_key: str | None = None, rpc=None, n_threads: int | None = None,
               seed: int | None = None, alias: str | None = None, limits: ServeLimits | None = None,
               session=None, chat_format: str | None = None, parallel: int | None = None, spec: str | None = None,
               options=None):
    """(app, load): the app answers at once (`/health` "loading", the API 503 with Retry-After) and
    serves the plan's model once `load()` has run; `load()` loads it as `ctxq run` does and returns
    the memory report. One app per process: llama-cpp-python keeps the model in a module global.
    `session`: a saved session file to start from (restored when it matches this model and plan);
    `chat_format`: llama-cpp-python's chat format to answer chat with instead of the model's template
    (e.g. "chatml-function-calling", for tool_choice "auto"); `parallel`: serve completions on ctxq's
    engine, that many sequences decoded together (0: the default from the plan, `parallel.py`);
    `load()` then returns (memory, the number of sequences, why). `spec`: drafts from the context for the
    one-at-a-time path (`runtime.speculative`; the engine decodes without them). `options`: the PlanOptions `p`
    was made with, which the page's re-plan starts from (`page_routes.py`; default: `p`'s context alone)."""
    from fastapi import FastAPI
    from fastapi.middleware import Middleware
    from llama_cpp.server import app as server_app
    from llama_cpp.server.settings import ServerSettings
    from starlette_context.middleware import RawContextMiddleware
    from starlette_context.plugins import RequestIdPlugin

    from . import http_errors

    check_vocabulary(p.model)  # every request is tokenized: a model llama.cpp cannot tokenize is refused before listening
    if parallel is not None:
        _check_parallel(parallel, chat_format, session)
    if chat_format is not None:
        from llama_cpp.llama_chat_format import LlamaChatCompletionHandlerRegistry

        known = LlamaChatCompletionHandlerRegistry()._chat_handlers
        if chat_format not in known:
            raise InvalidOption(f"`chat_format` {chat_format!r} is not one of llama-cpp-python's: "
                                f"{', '.join(sorted(known))}", option="chat_format", value=chat_format)
    name = Path(p.model).name
    alias = alias or name  # never the path: a client has no business knowing the server's disk
    service = Service(alias, {alias, name}, p.n_ctx, limits or ServeLimits(), Metrics())
    # The same assembly as llama_cpp.server.app.create_app, with ctxq's model instead of a second load.
    server_app.set_server_settings(ServerSettings(api_key=api_key, interrupt_requests=False))
    app = FastAPI(middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))],
                  title="ctxq (llama-cpp-python server)", version=server_app.llama_cpp.__version__)
    http_errors.install(app)
    _fixed_schema_grammars()
    backend = None
    if parallel is not None:  # the engine's completion routes come first: they answer those paths
        from .parallel import Backend, install

        backend = Backend(service, seed)
        install(app, backend)
    _routes(app, service, p.llama_flags())
    from ..planning.options import PlanOptions
    from .page_routes import install as install_page

    install_page(app, service, p, options or PlanOptions(n_ctx=p.n_ctx), backend)
    app.add_middleware(Gate, service=service, api_key=api_key)
    app.state.ctxq = service
    app.state.ctxq_backend = backend

    def load():
        """The model, loaded as planned; the API serves it from the moment this returns."""
        if backend is not None:
            return _load_engine(p, parallel, backend, alias, rpc=rpc, n_threads=n_threads)
        llm, memory, _ = load_plan(p, rpc=rpc, n_threads=n_threads, seed=seed)
        speculative.for_plan(llm, p, spec)
        if session is not None:  # before the first request is let in
            restore_session(llm, session, p)
        if chat_format is not None:
            llm.chat_format, llm.chat_handler = chat_format, None
        server_app._llama_proxy = _proxy(llm, alias)
        service.ready(llm)
        return memory

    return app, load


def _check_parallel(parallel: int, chat_format, session) -> None:
    from ..errors import InvalidOption

    if not isinstance(parallel, int) or not 0 <= parallel <= 256:  # LLAMA_MAX_SEQ (llama-cparams.h)
        raise InvalidOption(f"`parallel` is {parallel!r}; it must be 1 to 256 sequences (0: the default)",
                            option="parallel", value=parallel, limit=256)
    for name, value in (("chat_format", chat_format), ("session", session)):
        if value is not None:
            raise InvalidOption(f"`{name}` is not served with `parallel` yet; leave one of them out",
                                option=name, value=value)


def _load_engine(p: Plan, parallel: int, backend, alias: str, **load_kwargs):
    """The plan's model in ctxq's engine with `parallel` sequences (0: the plan's own P when it was made for
    several, else parallel.default_parallel);
    (memory report, sequences, why that many)."""
    from llama_cpp.server import app as server_app

    from ..runtime import engine as engine_mod
    from .parallel import default_parallel

    llm, memory, _ = load_plan(p, **load_kwargs)
    try:
        if parallel:
            n, why = parallel, f"{parallel} sequences share the {p.n_ctx:,} KV cells (--parallel)"
        elif p.parallel:  # a plan made for P sequences (PlanOptions.parallel) answers the default
            n, why = p.n_seq_max, f"{p.n_seq_max} sequences share the {p.n_ctx:,} KV cells (the plan's)"
        else:
            n, why = default_parallel(p, llm.n_vocab())
        # the engine's context replaces the Llama's, so the plan's KV memory is held once (as
        # engine.from_plan does; the model, its tokenizer and template stay in `llm`)
        llm._ctx.close()
        engine = engine_mod.Engine(llm, n_seq_max=n, n_ctx=p.n_ctx, own_llm=True)
        memory = engine_memory(p, llm, engine)  # the engine's context replaced the one load_plan measured
    except BaseException:
        llm.close()
        raise
    service = backend.service
    service.slot = asyncio.Semaphore(n)  # before any request is let in
    backend.ready(engine, llm)
    server_app._llama_proxy = _proxy(llm, alias)  # /extras/tokenize and its kin
    service.ready(llm, metered_generate=False)
    return memory, n, why


def serve(app, load, *, host: str, port: int, on_ready=None) -> None:
    """Run the app with uvicorn while `load()` runs on a thread (the server answers "loading" until
    it returns; `on_ready(its result)` then), until SIGTERM or Ctrl-C. Then stop gracefully: no new
    connections, queued requests answered 503, the running generation given `shutdown_timeout`
    seconds (it then ends as if it had reached max_tokens), and return normally: uvicorn would
    re-raise the signal, killing the process instead of letting it exit 0. An error of `load()` is
    raised here once the server has stopped."""
    import threading

    import uvicorn
    from sse_starlette.sse import AppStatus

    service: Service = app.state.ctxq
    # sse-starlette cuts every stream at the first signal; ctxq lets them finish within the bound.
    AppStatus.disable_automatic_graceful_drain()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                service.begin_shutdown()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    # uvicorn cancels what is left a little after ctxq's own bound, which ends generations itself.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=service.limits.shutdown_timeout + 2)
    server, failed = Server(config), []

    def loading():
        try:
            result = load()
        except BaseException as e:  # raised below, in the caller's thread
            failed.append(e)
            server.should_exit = True
            return
        if on_ready is not None:
            on_ready(result)

    loader = threading.Thread(target=loading, name="ctxq-load", daemon=True)
    loader.start()
    server.run()
    loader.join()  # a stop during the load waits for it: llama.cpp cannot drop a half-loaded model
    backend = getattr(app.state, "ctxq_backend", None)
    if backend is not None and backend.engine is not None:  # its thread and context, after the last answer
        backend.engine.close()
    if failed:
        raise failed[0]
