"""`ctxq serve --parallel --spec` against one request at a time without drafts (issue 63): min_tokens, stop,
max_tokens, a JSON schema and a tool call give the same answer; a response and /metrics count the drafted and
accepted tokens."""

from __future__ import annotations

import httpx
import pytest

from .test_serve import KEY, serving
from .test_serve_structured import PLACE, RAMBLE, WEATHER, json_schema

ALICE = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
         "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
         "in it.")
COPY = [{"role": "user", "content": ALICE * 2 + "\n\nRepeat the text above exactly."}]
CHAT = "/v1/chat/completions"
REQUESTS = {  # greedy; the copy is drafted from the document, the rest barely
    "min_tokens": {"messages": [{"role": "user", "content": "Name three fruits, one per line."}], "max_tokens": 60,
                   "min_tokens": 35},
    # the copy ends by itself at 49 tokens, with drafts of its second copy in flight
    "copy min_tokens": {"messages": COPY, "max_tokens": 70, "min_tokens": 58},
    "stop": {"messages": COPY, "max_tokens": 40, "stop": ["her sister was"]},
    "max_tokens": {"messages": COPY, "max_tokens": 6},
    "json schema": {"messages": RAMBLE, "max_tokens": 60, "response_format": json_schema(PLACE)},
    "tool call": {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": WEATHER,
                  "max_tokens": 40, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}
# one at a time with drafts is tests/test_spec_cli.py's (and test_engine_spec.py's, in process)
SERVERS = {"off": ("--spec", "off"), "parallel ngram": ("--parallel", "2", "--spec", "ngram")}


@pytest.fixture(scope="module")
def answers(smollm2, tmp_path_factory):
    out = {}
    for name, args in SERVERS.items():
        log = tmp_path_factory.mktemp("serve") / "serve.log"
        with serving(smollm2, log, "-c", "2048", "--api-key", KEY, *args) as (base, _):
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as c:
                got = {}
                for key, body in REQUESTS.items():
                    r = c.post(CHAT, json={**body, "temperature": 0})
                    assert r.status_code == 200, (name, key, r.text)
                    got[key] = r.json()
                got["/metrics"] = c.get("/metrics").text
        out[name] = got
    return out


def _said(answer: dict) -> tuple:
    choice = answer["choices"][0]
    return (choice["message"]["content"], choice["message"].get("tool_calls") and
            [t["function"] for t in choice["message"]["tool_calls"]], choice["finish_reason"],
            answer["usage"]["completion_tokens"])


@pytest.mark.parametrize("key", list(REQUESTS))
def test_the_same_answer_with_drafts_and_without_on_either_path(answers, key):
    ref = _said(answers["off"][key])
    assert _said(answers["parallel ngram"][key]) == ref
    if "min_tokens" in REQUESTS[key]:
        assert ref[3] >= REQUESTS[key]["min_tokens"]


def _metric(text: str, name: str) -> float:
    return float(next(l.split()[-1] for l in text.splitlines() if l.startswith(name + " ")))


def test_a_response_and_the_metrics_count_drafted_and_accepted_tokens(answers):
    par = answers["parallel ngram"]
    times = [par[k]["timings"] for k in REQUESTS]
    assert all(0 <= t["draft_n_accepted"] <= t["draft_n"] for t in times)
    copy = par["copy min_tokens"]["timings"]
    assert copy["draft_n_accepted"] >= 30  # the second copy drafted from the first
    assert _metric(par["/metrics"], "ctxq_draft_tokens_total") == sum(t["draft_n"] for t in times)
    assert _metric(par["/metrics"], "ctxq_draft_accepted_tokens_total") == sum(t["draft_n_accepted"] for t in times)
    assert _metric(answers["off"]["/metrics"], "ctxq_draft_tokens_total") == 0
    assert "timings" not in answers["off"]["copy min_tokens"]
