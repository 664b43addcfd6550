"""SIGTERM during a streamed generation: the stream ends cleanly, queued requests are answered 503,
new connections are refused, and `ctxq serve` exits 0 within its shutdown bound."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from .test_serve import KEY, start, wait_ready
from .test_serve_limits import ENDLESS, tiny  # noqa: F401 (tiny: the fixture)

pytestmark = pytest.mark.slow

BOUND = 4  # s: --shutdown-timeout
AUTH = {"Authorization": f"Bearer {KEY}"}


def _refused(base: str) -> bool:
    parts = urlsplit(base)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


# --parallel 1: the engine with one sequence, so the second request waits in the queue
@pytest.mark.parametrize("mode", [(), ("--parallel", "1")], ids=["one-at-a-time", "parallel"])
def test_sigterm_mid_stream(tiny, tmp_path, mode):  # noqa: F811
    log = tmp_path / "serve.log"
    proc, base = start(tiny, log, "-c", "4096", "--api-key", KEY, "--shutdown-timeout", str(BOUND), *mode)
    try:
        wait_ready(proc, base, log)
        queued = {}

        def ask():  # behind the stream, in the queue when the signal comes
            queued["r"] = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                     headers=AUTH, timeout=60)

        events = []
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while len(events) < 3:
                line = next(lines)
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
            waiter = threading.Thread(target=ask)
            waiter.start()
            while httpx.get(base + "/health", timeout=10).json()["queue"] < 1:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            waiter.join(30)
            refused_after = None
            while refused_after is None and time.monotonic() - signalled < 3:
                if _refused(base):
                    refused_after = time.monotonic() - signalled
                time.sleep(0.05)
            events += [line[len("data: "):] for line in lines if line.startswith("data: ")]
        code = proc.wait(BOUND + 10)
        exited_after = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-2000:]
    assert exited_after < BOUND + 5
    assert refused_after is not None, "new connections were still accepted 3 s after SIGTERM"
    # the stream ran on after the signal and ended as a finished completion, cut at the bound
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 3 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) < ENDLESS["max_tokens"]
    # the queued request was told to go elsewhere, not left to hang
    err = queued["r"]
    assert err.status_code == 503 and int(err.headers["Retry-After"]) >= 1
    assert err.json()["error"]["code"] == "server_stopping"
