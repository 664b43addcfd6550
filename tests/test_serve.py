"""`ctxq serve` end to end: the real console script on a free local port, a real HTTP client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

KEY = "test-key"
N_CTX = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc, base: str, log: Path, seconds: float = 120) -> None:
    """Until /health says the model is loaded (it answers 503 "loading" before)."""
    deadline = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            pytest.fail(f"ctxq serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"ctxq serve did not become ready within {seconds} s: {log.read_text()[-2000:]}")
        time.sleep(0.2)


def start(model: Path, log: Path, *args: str):
    """(process, base URL): `ctxq serve MODEL ARGS` on a free port of 127.0.0.1, not yet ready."""
    port = _free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("ctxq")), "serve", str(model),
                                 "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT,
                                env={k: v for k, v in os.environ.items() if k != "CTXQ_DEBUG"})
    return proc, f"http://127.0.0.1:{port}"


def stop(proc) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("ctxq serve did not stop within 30 s of Ctrl-C")


@contextlib.contextmanager
def serving(model: Path, log: Path, *args: str):
    """(base URL, log) of a ready `ctxq serve`, stopped with Ctrl-C afterwards."""
    proc, base = start(model, log, *args)
    try:
        wait_ready(proc, base, log)
        yield base, log
    finally:
        if proc.poll() is None:
            code = stop(proc)
            assert code == 0, f"ctxq serve exited {code} after Ctrl-C: {log.read_text()[-2000:]}"


# Every server test runs on today's serve and on ctxq's engine (`--parallel`, issue 29).
MODES = [pytest.param((), id="one-at-a-time"), pytest.param(("--parallel", "4"), id="parallel")]


@pytest.fixture(scope="module", params=MODES)
def server(smollm2, tmp_path_factory, request):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(smollm2, log, "-c", str(N_CTX), "--api-key", KEY, "--seed", "1", *request.param) as running:
        yield running


def _client(base):
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)


def test_health_and_startup_report(server):
    base, log = server
    h = httpx.get(base + "/health").json()  # no key needed
    assert h["status"] == "ready" and h["n_ctx"] == N_CTX and f"-c {N_CTX}" in h["plan"]
    assert h["queue"] == 0 and h["processing"] == 0
    text = log.read_text()
    assert "serving on http://127.0.0.1:" in text and "planned" in text and "llama.cpp" in text


def test_chat_completion(server):
    with _client(server[0]) as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] > 10


def test_streaming_completion(server):
    chunks = []
    with _client(server[0]) as c, c.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Count from one to five."}],
            "max_tokens": 12, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: "):])
    assert chunks[-1] == "[DONE]"
    deltas = [json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]]
    assert len([d for d in deltas if d]) >= 3 and "".join(deltas).strip()


@pytest.mark.parametrize("stream", [False, True])
def test_overlong_request_is_400_with_numbers(server, stream):
    prompt = "word " * (N_CTX + 200)
    with _client(server[0]) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["n_ctx"] == N_CTX
        assert err["prompt_tokens"] > N_CTX and f"{err['prompt_tokens']} tokens" in err["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                 "stream": stream})
        assert r.status_code == 400 and str(N_CTX) in r.json()["error"]["message"]
        # the server is still there
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_api_key_is_required(server):
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 401
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": "word " * 3000}, timeout=60)
    assert r.status_code == 401  # an unauthenticated caller learns nothing about the context


@pytest.mark.slow
def test_16_concurrent_requests_all_answered(server):
    def ask(i):
        with _client(server[0]) as c:
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": 4,
                "temperature": 0})
            return r.status_code, r.json()

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(16)))
    assert [s for s, _ in results] == [200] * 16
    assert all(b["choices"][0]["message"]["content"] for _, b in results)
    assert len({b["id"] for _, b in results}) == 16


def metrics(base: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}, the Prometheus text parsed line by line."""
    from prometheus_client import CONTENT_TYPE_LATEST

    r = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_model_is_named_by_the_files_name_never_its_path(server, smollm2):
    with _client(server[0]) as c:
        listed = c.get("/v1/models").json()
        plain = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        named = c.post("/v1/chat/completions", json={"model": smollm2.name, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert [m["id"] for m in listed["data"]] == [smollm2.name]
    assert plain.json()["model"] == smollm2.name and named.json()["model"] == smollm2.name
    for r in (plain, named):
        assert str(smollm2.parent) not in r.text


def test_metrics_count_requests_tokens_and_reused_prefix(server):
    before = metrics(server[0])
    prompt = "The history of the Roman Empire begins with the founding of the city. " * 4
    with _client(server[0]) as c:
        for _ in range(2):  # the second finds the first's prompt in the KV cache
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3,
                                                   "temperature": 0}).status_code == 200
    after = metrics(server[0])

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    assert grew('ctxq_requests_total{status="200"}') == 3  # the completions and the first /metrics
    assert grew("ctxq_prompt_tokens_total") > 2 * 40  # 4 x 13 words
    assert grew("ctxq_prompt_tokens_reused_total") >= 40
    assert 2 <= grew("ctxq_tokens_predicted_total") <= 6
    assert after["ctxq_predicted_tokens_seconds"] > 0 and after["ctxq_prompt_tokens_seconds"] > 0
    assert after["ctxq_requests_queued"] == 0 and after["ctxq_requests_processing"] == 0


HISTOGRAMS = ("ctxq_time_to_first_token_seconds", "ctxq_request_duration_seconds")


def test_metrics_histograms_observe_plain_and_streamed_requests(server, request):
    """prometheus_client's text: each completion, answered whole or streamed, is one observation of the time to
    its first token and of its duration; the counters and gauges are there beside them."""
    base = server[0]
    asks = [("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4,
                                      "temperature": 0, "stream": True})]
    for path, body in asks:
        before = metrics(base)
        with _client(base) as c, c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            text = r.read().decode()
        assert text.endswith("data: [DONE]\n\n") if body.get("stream") else json.loads(text)["choices"]
        deadline = time.monotonic() + 10  # the gate observes the duration just after the answer's last byte
        while (after := metrics(base))["ctxq_request_duration_seconds_count"] == \
                before.get("ctxq_request_duration_seconds_count", 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        for name in HISTOGRAMS:
            assert after[f"{name}_count"] - before.get(f"{name}_count", 0) == 1, (path, name)
            assert after[f"{name}_sum"] > before.get(f"{name}_sum", 0)
            assert after[f'{name}_bucket{{le="+Inf"}}'] == after[f"{name}_count"]
        assert after["ctxq_time_to_first_token_seconds_sum"] - before.get("ctxq_time_to_first_token_seconds_sum", 0) \
            <= after["ctxq_request_duration_seconds_sum"] - before.get("ctxq_request_duration_seconds_sum", 0)
    for name in ('ctxq_requests_total{status="200"}', "ctxq_prompt_tokens_total", "ctxq_prompt_tokens_reused_total",
                 "ctxq_tokens_predicted_total", "ctxq_prompt_seconds_total", "ctxq_tokens_predicted_seconds_total",
                 "ctxq_requests_processing", "ctxq_requests_queued", "ctxq_prompt_tokens_seconds",
                 "ctxq_predicted_tokens_seconds"):
        assert name in after, name
    engine = {"ctxq_sequences_active", "ctxq_sequences_max", "ctxq_kv_cells_used", "ctxq_kv_cells_shared",
              "ctxq_prompt_tokens_evaluated_total"}
    # the engine's gauges with --parallel only
    assert engine <= set(after) if "--parallel" in request.node.callspec.params["server"] else not engine & set(after)


def _plumbing(monkeypatch, key: str):
    """(invoke, seen): `invoke(*args)` runs `ctxq serve m.gguf ARGS` with the library calls patched to
    record what reaches `create_app` as `key` (option plumbing only)."""
    from click.testing import CliRunner

    from ctxq.cli import cli
    from ctxq.runtime import runner
    from ctxq.serve import server

    seen = []

    def create_app(p, **kwargs):
        seen.append(kwargs[key])
        raise SystemExit(3)

    # a plan of 2,048 cells on the CPU: enough for `--parallel auto` (serve.parallel.auto_plan) to pick from
    plan = SimpleNamespace(n_ctx=2048, n_gpu_layers=0, devices=[], host=None)
    monkeypatch.setattr(runner, "make_plan", lambda model, options: plan)
    monkeypatch.setattr(server, "create_app", create_app)
    return (lambda *args: CliRunner().invoke(cli, ["serve", "m.gguf", *args])), seen


def test_limit_flags_reach_serve_limits(monkeypatch):
    from ctxq.errors import InvalidOption
    from ctxq.serve.limits import ServeLimits
    from ctxq.units import MiB

    invoke, seen = _plumbing(monkeypatch, "limits")
    r = invoke("--max-body", "2", "--max-queue", "0", "--timeout", "30", "--shutdown-timeout", "5")
    assert r.exit_code == 3 and seen[-1] == ServeLimits(max_body=2 * MiB, max_queue=0, timeout=30,
                                                         shutdown_timeout=5)
    assert invoke().exit_code == 3 and seen[-1] == ServeLimits()
    r = invoke("--max-queue", "-1")
    assert isinstance(r.exception, InvalidOption) and r.exception.option == "max_queue" and len(seen) == 2


def test_chat_format_flag_reaches_create_app(monkeypatch):
    invoke, seen = _plumbing(monkeypatch, "chat_format")
    assert invoke("--chat-format", "chatml-function-calling").exit_code == 3
    assert invoke().exit_code == 3
    assert seen == ["chatml-function-calling", None]


def test_parallel_flag_reaches_create_app(monkeypatch):
    """None is today's serve; auto is what the plan holds (2,048 cells: 4 answers of 512 cells)."""
    invoke, seen = _plumbing(monkeypatch, "parallel")
    for args in ([], ["--parallel", "8"], ["-np", "auto"]):
        assert invoke(*args).exit_code == 3
    assert seen == [None, 8, 4]
    for bad in ("0", "257", "many"):
        r = invoke("--parallel", bad)
        assert r.exit_code == 2 and "1 to 256" in r.output
    assert len(seen) == 3


def test_parallel_refuses_what_it_does_not_serve_yet(smollm2):
    from ctxq.errors import InvalidOption

    for kwargs, option in ((dict(chat_format="chatml-function-calling"), "chat_format"),
                           (dict(session="doc.kv"), "session"), (dict(parallel=300), "parallel")):
        with pytest.raises(InvalidOption) as e:
            server_app(smollm2, parallel=kwargs.pop("parallel", 4), **kwargs)
        assert e.value.option == option


@pytest.mark.slow
def test_parallel_default_is_the_plans_own_p(smollm2):
    """create_app(parallel=0) on a plan made for 3 sequences runs the engine with those 3 (not a count of its own)."""
    from ctxq.runtime import runner
    from ctxq.serve import server

    p = runner.make_plan(smollm2, 2048, parallel=3)
    app, load = server.create_app(p, parallel=0)
    memory, n_seq, why = load()
    try:
        assert n_seq == 3 and "(the plan's)" in why, why
        assert app.state.ctxq_backend.engine.n_seq_max == 3
    finally:
        app.state.ctxq_backend.engine.close()


def server_app(model, **kwargs):
    from ctxq.runtime import runner
    from ctxq.serve import server

    return server.create_app(runner.make_plan(model, 512), **kwargs)
