"""`ctxq serve` answers bad requests in OpenAI's error shape, with the right status, and without
a traceback, a file path or a library's internals in the body (a real server, a real model)."""

from __future__ import annotations

import json

import httpx
import pytest

from .test_serve import KEY, MODES, serving

N_CTX = 512
MAX_BODY_MIB = 0.01  # 10,485 bytes: an oversized body is cheap to send
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
BODY_ROUTES = [CHAT, COMPLETIONS, "/v1/engines/copilot-codex/completions", "/extras/tokenize",
               "/extras/tokenize/count", "/extras/detokenize"]
SURROGATE_BODIES = {  # each route's own text field, where one has text
    CHAT: b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
    COMPLETIONS: b'{"prompt": "\\udc00"}',
    "/v1/engines/copilot-codex/completions": b'{"prompt": "\\ud800 x"}',
    "/extras/tokenize": b'{"input": "\\udc00"}',
    "/extras/tokenize/count": b'{"input": "a\\udfff"}',
    "/extras/detokenize": b'{"tokens": [1], "model": "\\udc00"}',
}
BAD = "invalid_request_error"

# (id, method, path, body (dict: JSON; bytes: sent as is), headers, status, type, param or code)
CASES = [
    ("messages-not-a-list", "POST", CHAT, {"messages": "notalist"}, AUTH, 400, BAD, "messages"),
    ("messages-missing", "POST", CHAT, {"max_tokens": 2}, AUTH, 400, BAD, "messages"),
    ("messages-empty", "POST", CHAT, {"messages": []}, AUTH, 400, BAD, "messages"),
    ("message-without-role", "POST", CHAT, {"messages": [{"content": "x"}]}, AUTH, 400, BAD, "messages"),
    ("message-unknown-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400, BAD,
     "messages"),
    ("prompt-a-number", "POST", COMPLETIONS, {"prompt": 5, "max_tokens": -3}, AUTH, 400, BAD, "prompt"),
    ("max-tokens-negative", "POST", COMPLETIONS, {"prompt": "Hi", "max_tokens": -3}, AUTH, 400, BAD, "max_tokens"),
    ("chat-max-tokens-zero", "POST", CHAT, {"messages": HI, "max_tokens": 0}, AUTH, 400, BAD, "max_tokens"),
    ("max-tokens-a-string", "POST", CHAT, {"messages": HI, "max_tokens": "many"}, AUTH, 400, BAD, "max_tokens"),
    ("max-tokens-huge", "POST", COMPLETIONS, {"prompt": "Hi", "max_tokens": 10**9}, AUTH, 400, BAD, "max_tokens"),
    ("max-tokens-beyond-int", "POST", COMPLETIONS, {"prompt": "Hi", "max_tokens": 1e30}, AUTH, 400, BAD,
     "max_tokens"),
    # max_completion_tokens, OpenAI's current name for max_tokens, is checked as max_tokens is
    ("chat-max-completion-tokens-zero", "POST", CHAT, {"messages": HI, "max_completion_tokens": 0}, AUTH, 400, BAD,
     "max_completion_tokens"),
    ("max-completion-tokens-negative", "POST", COMPLETIONS, {"prompt": "Hi", "max_completion_tokens": -3}, AUTH,
     400, BAD, "max_completion_tokens"),
    ("max-completion-tokens-a-string", "POST", CHAT, {"messages": HI, "max_completion_tokens": "many"}, AUTH, 400,
     BAD, "max_completion_tokens"),
    ("max-completion-tokens-a-fraction", "POST", CHAT, {"messages": HI, "max_completion_tokens": 2.5}, AUTH, 400,
     BAD, "max_completion_tokens"),
    ("max-completion-tokens-huge", "POST", CHAT, {"messages": HI, "max_completion_tokens": 10**9}, AUTH, 400, BAD,
     "max_completion_tokens"),
    ("both-output-limits", "POST", CHAT, {"messages": HI, "max_tokens": 2, "max_completion_tokens": 2}, AUTH, 400,
     BAD, "invalid_parameter_combination"),
    ("temperature-a-word", "POST", CHAT, {"messages": HI, "temperature": "hot"}, AUTH, 400, BAD, "temperature"),
    ("top-p-above-one", "POST", COMPLETIONS, {"prompt": "Hi", "top_p": 5}, AUTH, 400, BAD, "top_p"),
    ("stop-a-number", "POST", COMPLETIONS, {"prompt": "Hi", "stop": 5}, AUTH, 400, BAD, "stop"),
    ("stream-a-list", "POST", CHAT, {"messages": HI, "stream": [1]}, AUTH, 400, BAD, "stream"),
    ("n-above-one", "POST", CHAT, {"messages": HI, "n": 3}, AUTH, 400, BAD, "n"),
    ("two-prompts", "POST", COMPLETIONS, {"prompt": ["a", "b"]}, AUTH, 400, BAD, "prompt"),
    ("bad-grammar", "POST", COMPLETIONS, {"prompt": "Hi", "grammar": "not a grammar"}, AUTH, 400, BAD, "grammar"),
    ("logit-bias-not-ids", "POST", COMPLETIONS, {"prompt": "Hi", "logit_bias": {"abc": 1}}, AUTH, 400, BAD,
     "logit_bias"),
    ("logit-bias-beyond-vocab", "POST", COMPLETIONS, {"prompt": "Hi", "logit_bias": {"99999999": 1}}, AUTH, 400,
     BAD, "logit_bias"),
    ("logprobs", "POST", COMPLETIONS, {"prompt": "Hi", "logprobs": 5}, AUTH, 400, BAD, "logprobs"),
    ("chat-top-logprobs", "POST", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 5}, AUTH, 400, BAD,
     "logprobs"),
    ("lone-surrogate", "POST", COMPLETIONS, b'{"prompt": "\\udc00"}', AUTH, 400, BAD, "invalid_value"),
    ("prompt-over-context", "POST", COMPLETIONS, {"prompt": "word " * (N_CTX + 50)}, AUTH, 400, BAD, "prompt"),
    ("malformed-json", "POST", CHAT, b"{bad json", AUTH, 400, BAD, "invalid_json"),
    ("empty-body", "POST", COMPLETIONS, b"", AUTH, 400, BAD, "invalid_json"),
    ("json-array", "POST", COMPLETIONS, b"[1, 2]", AUTH, 400, BAD, "invalid_value"),
    ("tokenize-number", "POST", "/extras/tokenize", {"input": 5}, AUTH, 400, BAD, "input"),
    ("tokenize-malformed", "POST", "/extras/tokenize", b"{bad", AUTH, 400, BAD, "invalid_json"),
    ("oversized-body", "POST", CHAT, {"messages": [{"role": "user", "content": "x" * 20000}]}, AUTH, 413, BAD,
     "request_too_large"),
    ("tokenize-oversized", "POST", "/extras/tokenize", {"input": "x" * 20000}, AUTH, 413, BAD, "request_too_large"),
    ("unknown-model", "POST", CHAT, {"model": "gpt-4", "messages": HI}, AUTH, 404, BAD, "model"),
    ("unknown-route", "GET", "/v1/nothing", None, AUTH, 404, BAD, "not_found"),
    ("embeddings", "POST", "/v1/embeddings", {"input": "Hi"}, AUTH, 404, BAD, "not_found"),
    ("get-a-post-route", "GET", CHAT, None, AUTH, 405, BAD, "method_not_allowed"),
    ("delete-models", "DELETE", "/v1/models", None, AUTH, 405, BAD, "method_not_allowed"),
    ("no-key", "POST", CHAT, {"messages": HI}, {}, 401, BAD, "invalid_api_key"),
    ("wrong-key", "POST", COMPLETIONS, {"prompt": "Hi"}, {"Authorization": "Bearer nope"}, 401, BAD,
     "invalid_api_key"),
    ("basic-scheme", "GET", "/v1/models", None, {"Authorization": f"Basic {KEY}"}, 401, BAD, "invalid_api_key"),
    ("no-key-malformed", "POST", CHAT, b"{bad", {}, 401, BAD, "invalid_api_key"),  # the key comes first
    ("no-key-metrics", "GET", "/metrics", None, {}, 401, BAD, "invalid_api_key"),
    # found beyond the first table: nesting, surrogates on every route, token ids llama.cpp cannot take
    *[(f"nested-5000{path.replace('/', '-')}", "POST", path, b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", AUTH,
       400, BAD, "invalid_json") for path in BODY_ROUTES],
    ("nested-1000-objects", "POST", CHAT, b'{"a":' * 1000 + b"1" + b"}" * 1000, AUTH, 400, BAD, "invalid_json"),
    ("nested-129", "POST", COMPLETIONS, b'{"prompt": "Hi", "x": ' + b"[" * 128 + b"]" * 128 + b"}", AUTH, 400, BAD,
     "invalid_json"),
    *[(f"lone-surrogate{path.replace('/', '-')}", "POST", path, SURROGATE_BODIES[path], AUTH, 400, BAD,
       "invalid_value") for path in BODY_ROUTES],
    ("detokenize-beyond-vocab", "POST", "/extras/detokenize", {"tokens": [99999999]}, AUTH, 400, BAD, "tokens"),
    ("detokenize-negative", "POST", "/extras/detokenize", {"tokens": [-5]}, AUTH, 400, BAD, "tokens"),
    ("detokenize-not-a-list", "POST", "/extras/detokenize", {"tokens": "x"}, AUTH, 400, BAD, "tokens"),
    ("head-no-key", "HEAD", "/v1/models", None, {}, 401, BAD, "invalid_api_key"),
    ("head-a-post-route", "HEAD", CHAT, None, AUTH, 405, BAD, "method_not_allowed"),
    ("json-schema-unsupported", "POST", CHAT, {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 3}}}}, AUTH, 400,
     BAD, "response_format"),
    ("response-format-unknown", "POST", CHAT, {"messages": HI, "response_format": {"type": "xml"}}, AUTH, 400, BAD,
     "response_format"),
    ("tool-choice-auto-without-handler", "POST", CHAT, {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "auto"},
     AUTH, 400, BAD, "tool_choice"),
]


@pytest.fixture(scope="module", params=MODES)
def server(smollm2, tmp_path_factory, request):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(smollm2, log, "-c", str(N_CTX), "--api-key", KEY, "--max-body", str(MAX_BODY_MIB),
                 *request.param) as running:
        yield running


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, smollm2, case):
    _, method, path, body, headers, status, kind, where = case
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    r = httpx.request(method, server[0] + path, content=content, timeout=60,
                      headers={**headers, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    if method == "HEAD":  # the GET answer's status and headers, no body
        assert r.content == b"" and int(r.headers["content-length"]) > 0
        assert httpx.request("GET", server[0] + path, headers=headers, timeout=60).status_code == status
        return
    err = r.json()["error"]
    assert err["type"] == kind and err["message"]
    assert where in (err["param"], err["code"]), err
    for leak in ("Traceback", 'File "', ".py", "site-packages", str(smollm2.parent), "llama_cpp"):
        assert leak not in r.text, f"{leak!r} in {r.text}"


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics"])
def test_head_works_wherever_get_does(server, path):
    head = httpx.head(server[0] + path, headers=AUTH, timeout=60)
    get = httpx.get(server[0] + path, headers=AUTH, timeout=60)
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


def test_detokenize_half_a_character_is_replaced_not_a_500(server, smollm2):
    """A byte-level token may hold part of a UTF-8 character; llama-cpp-python decoded it strictly."""
    import llama_cpp

    llm = llama_cpp.Llama(str(smollm2), vocab_only=True, verbose=False)
    partial = next(t for t in range(llm.n_vocab()) if _invalid_utf8(llm.detokenize([t])))
    r = httpx.post(server[0] + "/extras/detokenize", json={"tokens": [partial]}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and "\ufffd" in r.json()["text"]
    r = httpx.post(server[0] + "/extras/detokenize", json={"tokens": llm.tokenize(b"Hello there", add_bos=False)},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["text"].strip() == "Hello there"


def _invalid_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_numbers_in_context_errors_and_server_healthy_after(server):
    base = server[0]
    r = httpx.post(base + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 10**9}, headers=AUTH, timeout=60)
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == N_CTX and err["max_tokens"] == 10**9
    assert f"leaves {N_CTX - err['prompt_tokens']} tokens" in err["message"]
    assert httpx.get(base + "/health").json()["status"] == "ready"
    r = httpx.post(base + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    # the body limit reached through a streamed (chunked) upload too
    for path in (CHAT, "/extras/tokenize"):
        r = httpx.post(base + path, content=iter([b'{"input": "', b"x" * 20000, b'"}']), headers=AUTH, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_while_loading_health_and_api_answer_503(smollm2):
    """In process, on the real app before and after its load (the console script's window is short)."""
    from starlette.testclient import TestClient

    from ctxq.runtime import runner
    from ctxq.serve import server

    app, load = server.create_app(runner.make_plan(smollm2, N_CTX), api_key=KEY, alias="tiny-chat")
    with TestClient(app) as client:
        h = client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = client.post(COMPLETIONS, json={"prompt": "Hi"}, headers=AUTH)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert r.json()["error"]["code"] == "server_loading"
        assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny-chat"
        load()
        assert client.get("/health").json()["status"] == "ready"
        r = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200 and r.json()["model"] == "tiny-chat"
