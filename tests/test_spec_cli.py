"""`ctxq bench --spec` and `ctxq serve --spec` end to end (issue 55): the real console script, real llama.cpp."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

import ctxq
from ctxq.runtime.bench import SPEC_SIZES

from .conftest import run_ctxq
from .test_serve import _free_port, stop, wait_ready

ALICE = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
         "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
         "in it.")


def test_bench_spec_records_the_cost_curve_that_auto_then_uses(smollm2, tmp_path, monkeypatch):
    env = {"CTXQ_HOME": str(tmp_path)}
    r = run_ctxq("bench", str(smollm2), "-c", "512", "--spec", "-d", "64", "-r", "1", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cost = {int(n): c for n, c in out["cost"].items()}
    assert sorted(cost) == list(SPEC_SIZES) and cost[1] == 1.0 and out["depth"] == 64
    assert all(c >= 1.0 for c in cost.values())
    assert cost[16] > 2.0  # 16 tokens through every layer cost more than one; a bogus timer would say 1
    (kept,) = (tmp_path / "bench").glob("*-spec.json")
    saved = json.loads(kept.read_text())
    assert {int(n): c for n, c in saved["cost"].items()} == cost and saved["depth"] == 64
    # `auto` on the same plan reads it: drafts on, with this very curve
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path))
    llm = ctxq.load(smollm2, n_ctx=512, spec="auto")
    try:
        s = llm.ctxq_spec
        assert s.active and s.note is None and s.cost_source == "measured"
        assert s.drafter.policy.cost == cost
    finally:
        llm.close()
    monkeypatch.delenv("CTXQ_HOME")
    r = run_ctxq("run", str(smollm2), "-c", "512", "-n", "4", "--spec", "auto", "-p", "hi", env=env)
    assert r.returncode == 0 and "has not measured" not in r.stderr, r.stderr


def _serve_text(model: Path, log: Path, spec: str) -> tuple[str, int, str, str]:
    """(the greedy answer to a copy request, its tokens, the server's log, its /metrics) from `ctxq -v serve --spec
    SPEC`."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("ctxq")), "-v", "serve", str(model), "-c", "1024",
                                 "--port", str(port), "--spec", spec], stdout=out, stderr=subprocess.STDOUT,
                                env={k: v for k, v in os.environ.items() if k != "CTXQ_DEBUG"})
    try:
        wait_ready(proc, base, log)
        ask = {"messages": [{"role": "user", "content": ALICE * 2 + "\n\nRepeat the text above exactly."}],
               "max_tokens": 48, "temperature": 0}
        r = httpx.post(base + "/v1/chat/completions", json=ask, timeout=300)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        n = r.json()["usage"]["completion_tokens"]  # counted by llama-cpp-python, not the drafter
        # a second request: the drafter reports the first one as this one starts
        r2 = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=300)
        assert r2.status_code == 200, r2.text
        metrics = httpx.get(base + "/metrics").text
    finally:
        assert stop(proc) == 0
    return text, n, log.read_text(), metrics


def test_serve_with_ngram_drafts_answers_as_without(smollm2, tmp_path):
    plain, n, _, _ = _serve_text(smollm2, tmp_path / "off.log", "off")
    drafted, n_drafted, log, metrics = _serve_text(smollm2, tmp_path / "ngram.log", "ngram")
    assert drafted == plain and len(plain) > 100 and n_drafted == n
    m = re.search(r"spec ngram: a request decoded in (\d+) passes, (\d+) of (\d+) drafted tokens accepted", log)
    assert m, log[-2000:]
    passes = int(m[1])  # llama_decode calls after the prompt (the first token comes from the prompt's)
    assert passes <= (n - 1) / 2  # two tokens or more per pass: the copy was drafted, and the drafts held
    counted = {l.split()[0]: float(l.split()[1]) for l in metrics.splitlines() if l.startswith("ctxq_draft_")}
    assert counted["ctxq_draft_accepted_tokens_total"] >= int(m[2])  # both requests' drafts (the log's is the first)
    assert counted["ctxq_draft_tokens_total"] >= counted["ctxq_draft_accepted_tokens_total"]
