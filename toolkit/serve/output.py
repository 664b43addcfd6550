"""The answer of a structured-output request, checked on its way out: the generated text (or a tool
call's arguments) must be JSON matching the request's schema.

An output that stopped at `max_tokens` (or at the server's time limit) before the JSON closed keeps
`finish_reason: "length"`, which tells the client the JSON is incomplete; one that finished and
still fails the schema (a stop string met inside the text, a schema whose parts contradict each
other) is not passed on as a success: a plain answer becomes a 422 `invalid_output`, a stream ends
with an error event. In a stream, an error event is OpenAI's shape (`data: {"error": {...}}`), which
OpenAI's client libraries raise as an APIError, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging

from .http_errors import error_body, error_headers
from .json_schema import mismatch

log = logging.getLogger(__name__)


def error_event(message: str, code: str, status: int = 500) -> bytes:
    """An SSE error event and the stream's end, in OpenAI's streaming shape."""
    return b"data: " + error_body(status, message, code=code) + b"\n\ndata: [DONE]\n\n"


class Expected:
    """What a request's output must be: `schema` for the text, or `tools` ({name: parameters schema})
    for a tool call's arguments; `max_tokens` tells a tool call cut short (llama-cpp-python reports
    finish_reason "tool_calls" even then)."""

    def __init__(self, schema=None, tools: dict | None = None, max_tokens: int | None = None):
        self.schema, self.tools, self.max_tokens = schema, tools or {}, max_tokens
        self.stopped = lambda: False  # the gate's: the generation was ended (time limit, shutdown)

    def problem(self, choice: dict, text: str, calls: list[tuple[str, str]], completion_tokens: int | None):
        """(why the output is wrong, or None; the finish_reason to report)."""
        finish = choice.get("finish_reason")
        if finish == "length":
            return None, finish
        if calls:
            for name, arguments in calls:
                schema = self.tools.get(name)
                why = mismatch(arguments, schema if schema is not None else {}) if name in self.tools else \
                    f"the model called `{name}`, which is not among the tools"
                if why:
                    cut = self.stopped() or self.max_tokens is not None and completion_tokens is not None and \
                        completion_tokens >= self.max_tokens
                    return (None, "length") if cut else (why, finish)
            return None, finish
        if self.schema is not None:
            return mismatch(text, self.schema), finish
        return None, finish


def _parts(choice: dict) -> tuple[str, list[tuple[str, str]]]:
    """(text, [(tool name, arguments)]) of a choice, a chat message or delta or a completion."""
    message = choice.get("message") or choice.get("delta") or {}
    text = choice.get("text") if "text" in choice else message.get("content")
    calls = [((c.get("function") or {}).get("name") or "", (c.get("function") or {}).get("arguments") or "")
             for c in message.get("tool_calls") or []]
    return text or "", calls


class CheckedSend:
    """ASGI `send` that checks a completion's answer against `expected` (see the module's docstring).
    A plain answer is held until complete; a stream passes event by event, its text gathered from
    the deltas and checked at the chunk that carries the finish_reason (sse-starlette sends one event
    per message)."""

    def __init__(self, send, expected: Expected):
        self.send, self.expected = send, expected
        self.held, self.body, self.ended = None, [], False
        self.text, self.names, self.calls, self.events = "", {}, {}, 0  # a stream's output so far

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            stream = dict(message.get("headers") or []).get(b"content-type", b"").startswith(b"text/event-stream")
            if message["status"] != 200:
                self.expected = None  # an error answer passes as it is
            elif not stream:
                self.held = message
                return None
            return await self.send(message)
        if message["type"] != "http.response.body" or self.expected is None:
            return await self.send(message)
        body, more = message.get("body", b""), message.get("more_body", False)
        if self.held is not None:
            self.body.append(body)
            return None if more else await self._finish_plain(b"".join(self.body))
        if self.ended:  # after an error event: only the stream's end passes
            return None if more else await self.send({"type": "http.response.body", "body": b""})
        if body.startswith(b"data: {"):
            return await self._event(message)
        return await self.send(message)

    async def _finish_plain(self, body: bytes):
        start, self.held = self.held, None
        try:
            answer = json.loads(body)
            choice = answer["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return await self._pass(start, body)
        text, calls = _parts(choice)
        why, finish = self.expected.problem(choice, text, calls, (answer.get("usage") or {}).get("completion_tokens"))
        if why is not None:
            log.warning("structured output failed its schema: %s; output: %r", why, text or calls)
            out = error_body(422, f"{why}; the model finished but its output does not match the request's "
                                  "schema", code="invalid_output")
            await self.send({"type": "http.response.start", "status": 422, "headers": error_headers(out)})
            return await self.send({"type": "http.response.body", "body": out})
        if finish != choice.get("finish_reason"):
            choice["finish_reason"] = finish
            body = json.dumps(answer).encode()
        await self._pass(start, body)

    async def _pass(self, start, body: bytes):
        headers = [(k, v) for k, v in start.get("headers") or [] if k != b"content-length"]
        await self.send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body})

    async def _event(self, message):
        try:
            chunk = json.loads(message["body"][len(b"data: "):])
            choice = chunk["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return await self.send(message)
        self.text += _parts(choice)[0]
        self.events += 1
        for call in (choice.get("delta") or {}).get("tool_calls") or []:
            i, fn = call.get("index", 0), call.get("function") or {}
            self.names[i] = fn.get("name") or self.names.get(i, "")
            self.calls[i] = self.calls.get(i, "") + (fn.get("arguments") or "")
        if choice.get("finish_reason") is None:
            return await self.send(message)
        calls = [(self.names[i], self.calls[i]) for i in sorted(self.calls)]
        # a stream has no usage: one chunk per generated token (llama-cpp-python's streams) counts them
        why, finish = self.expected.problem(choice, self.text, calls, self.events)
        if why is None and finish == choice.get("finish_reason"):
            return await self.send(message)
        if why is None:  # a tool call cut at max_tokens
            choice["finish_reason"] = finish
            return await self.send({**message, "body": b"data: " + json.dumps(chunk).encode() + b"\n\n"})
        log.warning("structured output failed its schema: %s; output: %r", why, self.text or calls)
        self.ended = True  # the stream's own [DONE] is dropped: error_event ends it
        await self.send({"type": "http.response.body", "more_body": True, "body": error_event(
            f"{why}; the model finished but its output does not match the request's schema", "invalid_output",
            422)})


def checked(send, expected: Expected | None):
    """`send` checking the answer against `expected`, or `send` itself when nothing is expected."""
    return send if expected is None else CheckedSend(send, expected)
