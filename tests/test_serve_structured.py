"""Structured output and tool calls through `ctxq serve` with the embedded model (SmolLM2-135M, which
rambles): the JSON parses and matches the schema, a schema the grammar cannot honour is refused by
name, an output cut at max_tokens says "length"."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from .test_serve import KEY, MODES, serving

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PLACE = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
         "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}}}
RAMBLE = [{"role": "user", "content": "Where is the Eiffel tower? Tell me a long story about it."}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "required": ["city"],
                                                            "properties": {"city": {"type": "string",
                                                                                    "maxLength": 20}}}}}]


def json_schema(schema, name="place"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module", params=MODES)
def server(smollm2, tmp_path_factory, request):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(smollm2, log, "-c", "2048", "--api-key", KEY, "--seed", "1", *request.param) as running:
        yield running[0]


def post(base, path, body):
    return httpx.post(base + path, json=body, headers=AUTH, timeout=300)


def test_json_schema_chat_returns_json_matching_the_schema(server):
    r = post(server, CHAT, {"messages": RAMBLE, "max_tokens": 100, "temperature": 0,
                            "response_format": json_schema(PLACE)})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, PLACE)
    assert "Paris" in value["city"]


@pytest.mark.slow
def test_a_rambling_model_cannot_break_a_string(server):
    """The newline tokens pushed up (logit_bias): llama-cpp-python's own string rule lets them into
    the strings, which is not JSON; the fixed rule keeps them out. Both answers come from this server."""
    from llama_cpp.llama_grammar import SchemaConverter

    newlines = {"198": 20, "1116": 20}  # "\n" and "\n\n" in SmolLM2's vocabulary
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.visit(PLACE, "")
    theirs = post(server, CHAT, {"messages": RAMBLE, "max_tokens": 100, "temperature": 0, "logit_bias": newlines,
                                 "grammar": converter.format_grammar()})
    assert theirs.status_code == 200
    with pytest.raises(ValueError):  # a raw newline inside a string
        json.loads(theirs.json()["choices"][0]["message"]["content"])
    ours = post(server, CHAT, {"messages": RAMBLE, "max_tokens": 100, "temperature": 0, "logit_bias": newlines,
                               "response_format": json_schema(PLACE)})
    assert ours.status_code == 200, ours.text
    choice = ours.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PLACE)


def test_cut_at_max_tokens_is_length_not_valid_json(server):
    r = post(server, CHAT, {"messages": RAMBLE, "max_tokens": 4, "temperature": 0, "response_format": json_schema(PLACE)})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(choice["message"]["content"])


@pytest.mark.slow
def test_streamed_json_schema_joins_into_matching_json(server):
    chunks = []
    with httpx.stream("POST", server + CHAT, headers=AUTH, timeout=300, json={
            "messages": RAMBLE, "max_tokens": 100, "temperature": 0, "stream": True,
            "response_format": json_schema(PLACE)}) as r:
        assert r.status_code == 200
        chunks = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    jsonschema.validate(json.loads(text), PLACE)


def test_json_object_without_a_schema_is_any_object(server):
    r = post(server, CHAT, {"messages": RAMBLE, "max_tokens": 80, "temperature": 0,
                            "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_completions_take_json_object_with_a_schema(server):
    schema = {"type": "object", "required": ["name", "year"],
              "properties": {"name": {"type": "string", "maxLength": 30}, "year": {"type": "integer"}}}
    r = post(server, COMPLETIONS, {"prompt": "The Eiffel tower was built in 1889.\nAs JSON:", "max_tokens": 60,
                                   "temperature": 0, "response_format": {"type": "json_object", "schema": schema}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)


UNSUPPORTED = [  # (keyword named in the answer, schema)
    ("minimum", {"type": "integer", "minimum": 3}),
    ("multipleOf", {"type": "number", "multipleOf": 2}),
    ("pattern", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "integer"}]}),
    ("format", {"type": "string", "format": "email"}),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]}),
    ("required", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("minItems", {"type": "array", "minItems": 2}),
    ("minProperties", {"type": "object", "minProperties": 1}),
    ("$ref", {"$ref": "https://example.com/schema.json"}),
    ("maxLength", {"type": ["string", "null"], "maxLength": 4, "pattern": "^a$"}),  # pattern found first
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
    ("enum", {"enum": ["a\nb"]}),
    ("minLength", {"type": "string", "minLength": 5, "maxLength": 3}),
    ("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}),
]


@pytest.mark.parametrize("keyword,schema", UNSUPPORTED, ids=[k for k, _ in UNSUPPORTED])
def test_unsupported_schema_keyword_is_400_naming_it(server, keyword, schema):
    r = post(server, CHAT, {"messages": RAMBLE, "max_tokens": 10, "response_format": json_schema(schema)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    named = "pattern" if keyword == "maxLength" else keyword
    assert err["param"] == "response_format" and f"`{named}`" in err["message"], err


def test_huge_max_length_is_400_not_a_crash(server):
    r = post(server, CHAT, {"messages": RAMBLE, "response_format": json_schema({"type": "string", "maxLength": 5000})})
    assert r.status_code == 400 and "maxLength" in r.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ready"


@pytest.mark.slow
def test_a_nullable_typed_object_and_refs_are_accepted(server):
    schema = {"$defs": {"City": {"type": "object", "title": "City", "required": ["name"],
                                 "properties": {"name": {"type": "string", "maxLength": 20}}}},
              "type": "object", "required": ["city", "note"],
              "properties": {"city": {"$ref": "#/$defs/City", "description": "where"},
                             "note": {"type": ["string", "null"], "maxLength": 12}}}
    r = post(server, CHAT, {"messages": RAMBLE, "max_tokens": 60, "temperature": 0,
                            "response_format": json_schema(schema)})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)


@pytest.mark.slow
def test_named_tool_call_arguments_match_its_parameters(server):
    r = post(server, CHAT, {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                            "tools": WEATHER, "max_tokens": 40, "temperature": 0,
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER[0]["function"]["parameters"])
    cut = post(server, CHAT, {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                              "tools": WEATHER, "max_tokens": 3, "temperature": 0,
                              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert cut.json()["choices"][0]["finish_reason"] == "length"  # llama-cpp-python said "tool_calls"


@pytest.mark.parametrize("choice", ["auto", "required", None])
def test_tool_choice_the_template_cannot_do_is_400(server, choice):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": WEATHER, "max_tokens": 4}
    if choice is not None:
        body["tool_choice"] = choice
    r = post(server, CHAT, body)
    assert r.status_code == 400, r.text
    assert "chatml-function-calling" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def function_calling(smollm2):
    """In process: the app with llama-cpp-python's chatml-function-calling handler (SmolLM2's template
    is ChatML), which lets the model choose between answering and calling a tool."""
    from starlette.testclient import TestClient

    from ctxq.runtime import runner
    from ctxq.serve import server

    app, load = server.create_app(runner.make_plan(smollm2, 2048), chat_format="chatml-function-calling", seed=1)
    load()
    with TestClient(app) as client:
        yield client, app


@pytest.mark.slow
def test_tool_choice_auto_with_a_function_calling_chat_format(function_calling):
    client, _ = function_calling
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                                "tools": WEATHER, "tool_choice": "auto", "max_tokens": 60, "temperature": 0})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER[0]["function"]["parameters"])
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "tools": WEATHER,
                                "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_unknown_chat_format_is_refused_before_loading(smollm2):
    from ctxq.errors import InvalidOption
    from ctxq.runtime import runner
    from ctxq.serve import server

    with pytest.raises(InvalidOption) as e:
        server.create_app(runner.make_plan(smollm2, 512), chat_format="no-such-format")
    assert e.value.option == "chat_format"


def test_an_error_after_the_stream_started_ends_it_with_an_error_event(function_calling, monkeypatch, caplog):
    """A fault injected into the real model's generation after 3 tokens (nothing a request can make
    happen on purpose): the stream's status is already 200, so the error comes as OpenAI's error
    event, then [DONE]; the server serves the next request."""
    client, app = function_calling
    llm = app.state.ctxq.llm
    generate = llm.generate

    def failing(tokens, *args, **kwargs):
        for i, token in enumerate(generate(tokens, *args, **kwargs)):
            if i == 3:
                raise RuntimeError("injected fault")
            yield token

    monkeypatch.setattr(llm, "generate", failing)
    with client.stream("POST", COMPLETIONS, json={"prompt": "1, 2, 3,", "max_tokens": 20, "stream": True}) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and len(data) >= 2
    error = json.loads(data[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "injected" not in error["message"]  # the details are in the log only
    assert any("injected fault" in str(rec.exc_info) for rec in caplog.records if rec.exc_info)
    monkeypatch.setattr(llm, "generate", generate)
    r = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
