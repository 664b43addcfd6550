"""`ctxq serve`'s errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

The status says who is at fault (4xx the request, 503 the server's capacity, 500 a real fault);
`type` follows OpenAI's API (invalid_request_error, server_error) and llama.cpp's server, which
answers bad requests the same way. A body never carries a traceback, a file path or a library's
exception text: a real fault is logged on the server with its traceback and answered with a
fixed message.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger(__name__)

# OpenAI's `type` by status: its API calls every client error an invalid_request_error (401 too,
# with code invalid_api_key) and every server-side one a server_error.
_TYPES = {500: "server_error", 503: "server_error"}
# pydantic's loc names the branch of a union it tried (`prompt.str`, `messages.0.ChatCompletion...`)
_BRANCH = re.compile(r"^[A-Z]|[\[\-]|^(str|int|float|bool|list|dict|none)$")
INTERNAL = "the server failed on this request; the details are in its log"


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               **extra) -> bytes:
    """The JSON body of an error answer."""
    kind = _TYPES.get(status, "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code,
                                 **extra}}).encode()


def error_headers(body: bytes, retry_after: int | None = None) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return headers


async def send_error(send, status: int, message: str, *, retry_after: int | None = None, **fields):
    """Answer an ASGI request with an error (for middleware, before the app sees the request)."""
    body = error_body(status, message, **fields)
    await send({"type": "http.response.start", "status": status, "headers": error_headers(body, retry_after)})
    await send({"type": "http.response.body", "body": body})


def reject(status: int, message: str, *, retry_after: int | None = None, **fields):
    """An HTTP error answer to raise (Starlette's HTTPException: an answer, not a ctxq error);
    `fields` are the body's param, code and extras."""
    from starlette.exceptions import HTTPException

    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return HTTPException(status, detail={"message": message, **fields}, headers=headers)


async def send_rejection(send, exc) -> None:
    """Answer with a `reject(...)` error."""
    fields = dict(exc.detail)
    retry = (exc.headers or {}).get("Retry-After")
    await send_error(send, exc.status_code, fields.pop("message"), retry_after=int(retry) if retry else None,
                     **fields)


def _response(status: int, message: str, headers=None, **fields):
    from starlette.responses import Response

    return Response(error_body(status, message, **fields), status_code=status, headers=headers,
                    media_type="application/json")


def validation_error(errors) -> tuple[str, str | None]:
    """(message, param) for pydantic's or FastAPI's list of errors: the first one, by its field.
    The error's `input` and `url` are left out: the message names the field and what it should be."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _BRANCH.search(str(x))]
    if first.get("type") == "json_invalid":
        return "the body is not valid JSON", None
    if not loc:
        return f"the body is not a JSON object of this request's fields ({first.get('msg', 'invalid')})", None
    return f"`{'.'.join(loc)}`: {first.get('msg', 'invalid value')}", loc[0]


def install(app) -> None:
    """Exception handlers that answer every error raised inside the app in OpenAI's shape."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        message, param = validation_error(exc.errors())
        code = "invalid_json" if param is None and "JSON" in message else "invalid_value"
        return _response(400, message, param=param, code=code)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        if isinstance(exc.detail, dict):  # reject(...)
            fields = dict(exc.detail)
            return _response(exc.status_code, fields.pop("message"), headers=exc.headers, **fields)
        if exc.status_code == 404:
            message, code = f"no such route: {request.method} {request.url.path}", "not_found"
        elif exc.status_code == 405:
            message, code = f"{request.url.path} does not take {request.method}", "method_not_allowed"
        elif exc.status_code == 401:
            message, code = "missing or wrong API key (send it as `Authorization: Bearer KEY`)", "invalid_api_key"
        else:  # llama-cpp-python's own HTTPExceptions carry short fixed texts ("Client closed request")
            message, code = str(exc.detail), None
        return _response(exc.status_code, message, headers=exc.headers, code=code)

    @app.exception_handler(Exception)
    async def fault(request, exc):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _response(500, INTERNAL, code="internal_error")
