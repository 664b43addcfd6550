"""`ctxq serve`'s per-request limits with a real model: a client that leaves frees the model at
once, a request's time limit ends its generation, /health shows the busy model and its queue."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .test_serve import KEY, MODES, metrics, serving

pytestmark = pytest.mark.slow

TIMEOUT = 4  # s: the time-limit server's --timeout
AUTH = {"Authorization": f"Bearer {KEY}"}
# A random-weight model (fast on any CPU) that never stops by itself: its end-of-generation tokens
# (<|endoftext|> 0, <|im_end|> 2 in SmolLM2's vocabulary) are banned.
# every end-of-generation token of the SmolLM2 vocabulary: <|endoftext|>, <|im_end|> and <reponame> (FIM REP,
# which llama.cpp also ends on: a random tiny model sampled it 188 tokens into a stream in CI)
ENDLESS = {"prompt": "1, 2, 3,", "max_tokens": 4000, "logit_bias": {"0": -100, "2": -100, "4": -100}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ctxq.testing.models import tiny_chat_llama_gguf

    return tiny_chat_llama_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")


@pytest.fixture(params=MODES)
def server(tiny, tmp_path, request):
    with serving(tiny, tmp_path / "serve.log", "-c", "4096", "--api-key", KEY, *request.param) as running:
        yield running


# --parallel 1: one sequence, so the second request waits in the queue as it does one at a time. A 64k context
# (32 MiB of KV for the tiny model) for a request the time limit must end: 4000 tokens took under 4 s in CI.
@pytest.fixture(params=[MODES[0], pytest.param(("--parallel", "1"), id="parallel")])
def limited(tiny, tmp_path, request):
    with serving(tiny, tmp_path / "serve.log", "-c", "65536", "--api-key", KEY, "--timeout", str(TIMEOUT),
                 *request.param) as running:
        yield running


def _health(base):
    return httpx.get(base + "/health", timeout=10).json()


def test_client_disconnect_mid_stream_frees_the_model(server):
    base = server[0]
    before = metrics(base)["ctxq_tokens_predicted_total"]
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator closes the connection
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data: ")
        assert _health(base)["status"] == "busy"
    left = time.monotonic()  # the connection is closed here
    while _health(base)["status"] != "ready":
        assert time.monotonic() - left < 10, "the model was not freed after the client left"
        time.sleep(0.05)
    predicted = metrics(base)["ctxq_tokens_predicted_total"] - before
    assert 3 <= predicted < ENDLESS["max_tokens"] / 2  # stopped when the client left, not at max_tokens


def test_time_limit_ends_the_generation_and_health_shows_the_queue(limited):
    base = limited[0]
    healths, answers, done = [], {}, threading.Event()

    def watch():
        while not done.is_set():
            healths.append(_health(base))
            time.sleep(0.1)

    def ask(name, body):
        answers[name] = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=60)

    t0 = time.monotonic()
    endless = {**ENDLESS, "max_tokens": 60000}  # more than any CPU makes in TIMEOUT seconds
    watcher, long = threading.Thread(target=watch), threading.Thread(target=ask, args=("long", endless))
    watcher.start()
    long.start()
    time.sleep(1)
    ask("queued", {"prompt": "Hi", "max_tokens": 2})  # waits behind the long one, within its own limit
    long.join()
    elapsed = time.monotonic() - t0
    done.set()
    watcher.join()
    body = answers["long"].json()
    assert answers["long"].status_code == 200 and body["choices"][0]["finish_reason"] == "length"
    assert 0 < body["usage"]["completion_tokens"] < endless["max_tokens"]
    assert TIMEOUT - 0.5 < elapsed < TIMEOUT + 10
    assert answers["queued"].status_code == 200
    assert any(h["status"] == "busy" and h["queue"] == 1 and h["processing"] == 1 for h in healths), healths
    assert _health(base)["status"] == "ready"


def test_client_gone_during_a_plain_request_frees_the_model(server):
    base = server[0]
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(base + "/v1/completions", json=ENDLESS, headers=AUTH, timeout=1.5)
    left = time.monotonic()
    while _health(base)["status"] != "ready":
        assert time.monotonic() - left < 10, "the model was not freed after the client left"
        time.sleep(0.05)
