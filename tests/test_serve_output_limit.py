"""`max_completion_tokens`, OpenAI's current name for the output limit, bounds what `ctxq serve` generates
on both paths (issue 39): sent by the official `openai` client, and by LangChain's ChatOpenAI, which
turns its max_tokens into max_completion_tokens on every request (a real server, a real model)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from .test_serve import KEY, MODES, serving

N_CTX = 1024
LIMIT = 6
STORY = [{"role": "user", "content": "Tell me a long story about a dragon who lives in a castle by the sea."}]


@pytest.fixture(scope="module", params=MODES)
def server(smollm2, tmp_path_factory, request):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(smollm2, log, "-c", str(N_CTX), "--api-key", KEY, "--seed", "1", *request.param) as running:
        yield running[0]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_chat_stops_at_max_completion_tokens(client, model):
    r = client.chat.completions.create(model=model, messages=STORY, max_completion_tokens=LIMIT, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == LIMIT
    # the same request unbounded runs on: the limit, not the story, ended it
    longer = client.chat.completions.create(model=model, messages=STORY, max_completion_tokens=4 * LIMIT,
                                            temperature=0)
    assert longer.usage.completion_tokens > LIMIT and longer.choices[0].message.content.startswith(
        r.choices[0].message.content)


def test_streamed_chat_stops_at_max_completion_tokens(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=STORY, max_completion_tokens=LIMIT,
                                                 temperature=0, stream=True))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert reasons == ["length"] and 1 <= len(pieces) <= LIMIT  # a piece per token, or fewer


def test_completions_take_max_completion_tokens(client, model):
    # OpenAI's legacy route knows only max_tokens; llama.cpp's server takes both there, and so does ctxq
    r = client.completions.create(model=model, prompt="Once upon a time, in a land far away,", temperature=0,
                                  extra_body={"max_completion_tokens": LIMIT})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == LIMIT


def test_both_limits_at_once_is_400_as_openai_answers_it(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=STORY, max_tokens=LIMIT, max_completion_tokens=LIMIT)
    err = e.value.body
    assert err["code"] == "invalid_parameter_combination" and err["param"] == "max_tokens"
    assert "max_completion_tokens" in err["message"]


def test_max_completion_tokens_over_the_context_is_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=STORY, max_completion_tokens=N_CTX)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_completion_tokens"
    assert err["message"].startswith(f"max_completion_tokens is {N_CTX} but the context leaves ")


# --- LangChain ---------------------------------------------------------------------------------


class Place(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


@pytest.fixture
def chat_openai(server, model):
    """LangChain's ChatOpenAI on this server, and the JSON bodies it sent (read from the wire by an httpx
    event hook, so the test sees what reached the server, not what LangChain meant to send)."""
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extra: "
                                           "pip install -e '.[test]'")
    sent = []

    def record(request: httpx.Request):
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.read()))

    def make(max_tokens: int):
        return langchain_openai.ChatOpenAI(base_url=server + "/v1", api_key=KEY, model=model, max_tokens=max_tokens,
                                           temperature=0, max_retries=0,
                                           http_client=httpx.Client(event_hooks={"request": [record]}, timeout=300))

    return make, sent


def test_langchain_max_tokens_bounds_the_answer(chat_openai):
    make, sent = chat_openai
    msg = make(LIMIT).invoke(STORY[0]["content"])
    assert [(b.get("max_completion_tokens"), "max_tokens" in b) for b in sent] == [(LIMIT, False)]
    assert msg.response_metadata["finish_reason"] == "length"
    assert msg.usage_metadata["output_tokens"] == LIMIT


def test_langchain_structured_output_is_parsed_within_the_limit(chat_openai):
    make, sent = chat_openai
    limit = 48  # {"city": ..., "country": ...}: the grammar caps each string at 16 characters
    out = make(limit).with_structured_output(Place, method="json_schema", include_raw=True).invoke(
        "Where is the Eiffel Tower? Answer with its city and country.")
    assert sent[-1]["max_completion_tokens"] == limit and "max_tokens" not in sent[-1]
    assert sent[-1]["response_format"]["type"] == "json_schema"
    assert out["parsing_error"] is None and isinstance(out["parsed"], Place), out
    assert out["parsed"].city and out["parsed"].country
    assert out["raw"].usage_metadata["output_tokens"] <= limit
    assert out["raw"].response_metadata["finish_reason"] == "stop"
