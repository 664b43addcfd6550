"""`ctxq serve`: llama-cpp-python's OpenAI-compatible server app, configured from a plan.

The routes are llama-cpp-python's own (`llama_cpp.server.app.router`: chat and text completions,
streaming, models, tokenize); the model is loaded by `runner.load_plan`, exactly as `ctxq run` loads
it, and ctxq adds:

- `/health`: 200 with the model and context once the model is loaded (no API key needed);
- a context check: a completion or chat request whose prompt does not fit is answered 400 with
  both numbers before it reaches the model. llama-cpp-python raises only inside the handler, and
  for a streaming request that happens after the 200 has been sent;
- requests are served one at a time in arrival order (`interrupt_requests=False`: by default a new
  request would cut a streaming one short).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..planning.planner import Plan
from .runner import chat_prompt, load_plan
from .session import restore_session
from ..units import MiB

log = logging.getLogger(__name__)

CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions")
MAX_BODY = 64 * MiB  # bytes: a full 128k-token prompt is well under this


def _prompt_tokens(llm, body: dict, path: str) -> int | None:
    """Tokens the request's prompt will take, as llama-cpp-python will build it; None if unknown."""
    if path.endswith("/chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return None
        try:  # the GGUF's template; a model without one is measured on its plain text
            prompt, has_bos = chat_prompt(llm, msgs)
        except Exception:
            prompt, has_bos = "\n".join(str(m.get("content") or "") for m in msgs if isinstance(m, dict)), False
        return len(llm.tokenize(prompt.encode("utf-8"), add_bos=not has_bos, special=True))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    if isinstance(prompt, list):  # already token ids
        return len(prompt)
    if not isinstance(prompt, str):
        return None
    return len(llm.tokenize(prompt.encode("utf-8"), special=True)) + (1 if body.get("suffix") else 0)


class ContextGuard:
    """ASGI middleware: a 400 with the numbers for prompts that do not fit in the context."""

    def __init__(self, app, get_llm, n_ctx: int, api_key: str | None = None):
        self.app, self.get_llm, self.n_ctx, self.api_key = app, get_llm, n_ctx, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in CHECKED_PATHS:
            return await self.app(scope, receive, send)
        if self.api_key is not None:  # unauthenticated requests get the app's own 401, not our numbers
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode(errors="replace")
            scheme, _, credentials = auth.partition(" ")
            if scheme.lower() != "bearer" or credentials.strip() != self.api_key:
                return await self.app(scope, receive, send)
        chunks, more, size = [], True, 0
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > MAX_BODY:
                return await _error(send, 413, f"request body over {MAX_BODY} bytes", "request_too_large")
        body = b"".join(chunks)
        n = None
        try:
            data = json.loads(body or b"{}")
            if isinstance(data, dict):
                from starlette.concurrency import run_in_threadpool

                n = await run_in_threadpool(_prompt_tokens, self.get_llm(), data, scope["path"])
        except (ValueError, TypeError, AttributeError):
            n = None  # malformed bodies get llama-cpp-python's own 422
        if n is not None and n >= self.n_ctx:
            return await _error(send, 400, f"this request's prompt is {n} tokens but the context holds "
                                f"{self.n_ctx}; shorten it, or restart the server with a larger n_ctx",
                                "context_length_exceeded", extra={"prompt_tokens": n, "n_ctx": self.n_ctx})
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _error(send, status: int, message: str, code: str, extra: dict | None = None):
    err = {"message": message, "type": "invalid_request_error", "param": None, "code": code, **(extra or {})}
    payload = json.dumps({"error": err}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


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


def create_app(p: Plan, *, api_key: str | None = None, rpc=None, n_threads: int | None = None,
               seed: int | None = None, alias: str | None = None, session=None):
    """(app, memory report): llama-cpp-python's server routes over the plan's model, loaded as
    `ctxq run` loads it. One app per process: llama-cpp-python keeps the model in a module global.
    `session`: a saved session file to start from (restored when it matches this model and plan)."""
    from fastapi import FastAPI
    from fastapi.middleware import Middleware
    from llama_cpp.server import app as server_app
    from llama_cpp.server.settings import ServerSettings
    from starlette_context.middleware import RawContextMiddleware
    from starlette_context.plugins import RequestIdPlugin

    llm, memory, _ = load_plan(p, rpc=rpc, n_threads=n_threads, seed=seed)
    if session is not None:
        restore_session(llm, session, p)
    alias = alias or Path(p.model).name
    # The same assembly as llama_cpp.server.app.create_app, with ctxq's model instead of a second load.
    server_app.set_server_settings(ServerSettings(api_key=api_key, interrupt_requests=False))
    app = FastAPI(middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))],
                  title="ctxq (llama-cpp-python server)", version=server_app.llama_cpp.__version__)
    app.include_router(server_app.router)
    server_app._llama_proxy = _proxy(llm, alias)

    @app.get("/health")
    def health():
        return {"status": "ok", "model": alias, "n_ctx": llm.n_ctx(), "plan": p.llama_flags()}

    app.add_middleware(ContextGuard, get_llm=lambda: llm, n_ctx=p.n_ctx, api_key=api_key)
    return app, memory
