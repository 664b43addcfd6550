"""Sessions (issue 17): the saved KV state of a document, restored instead of prefilled again.

Real models in the real llama.cpp: the tiny chat model (SmolLM2's tokenizer and template, random
weights: greedy tokens compare exactly, the words mean nothing) and SmolLM2 itself; the real console
script where the command line matters.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ctxq.digest import file_digest
from ctxq.runtime import runner, session
from ctxq.testing.models import tiny_chat_llama_gguf

from .conftest import ctxq_exe, run_ctxq
from .test_run import text_of_tokens

QUESTION = "What is the first word of the text above?"
GREEDY = dict(chat=True, temp=0, n_predict=24, seed=1, n_ctx=4096)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_chat_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf")


@pytest.fixture(scope="module")
def doc(tiny):
    return text_of_tokens(tiny, 1500)[0]


@pytest.fixture(scope="module")
def fresh(tiny, doc):
    """The greedy answer of a run that processes the whole input (no session), q8_0 KV."""
    return runner.run(tiny, QUESTION, document=doc, kv="q8_0", **GREEDY)


def test_restored_run_answers_as_a_fresh_prefill(tiny, doc, fresh, tmp_path):
    path = tmp_path / "doc.kv"
    first = runner.run(tiny, QUESTION, document=doc, session=path, kv="q8_0", **GREEDY)
    assert first.n_cached == 0 and path.is_file()
    second = runner.run(tiny, QUESTION, document=doc, session=path, kv="q8_0", **GREEDY)
    assert len(fresh.tokens) == 24
    assert first.tokens == fresh.tokens and second.tokens == fresh.tokens
    # the document's tokens were restored; only the question and the template's tail were evaluated
    assert second.n_cached > 1400 and second.n_prompt - second.n_cached < 30, (second.n_prompt, second.n_cached)
    other = runner.run(tiny, "And the last word?", document=doc, session=path, kv="q8_0", **GREEDY)
    assert other.n_cached == second.n_cached

    meta = session.read_metadata(path)
    assert meta["model_sha256"] == file_digest(tiny) and meta["n_tokens"] == second.n_cached
    assert meta["settings"] == {"n_ctx": 4096, "type_k": "q8_0", "type_v": "q8_0", "flash_attn": True,
                                "n_ubatch": 512, "swa_full": False}
    assert meta["ctxq"] and meta["llama_cpp_python"] and len(meta["state_sha256"]) == 64
    trailer = path.stat().st_size - meta["state_bytes"]
    assert 0 < trailer < 4096
    assert not list(tmp_path.glob(".*partial"))


def _corrupt(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)


@pytest.mark.parametrize("case, words", [
    ("other model", "made from another model file"),
    ("other kv", "made with type_k='f16', type_v='f16'; this plan has type_k='q8_0', type_v='q8_0'"),
    ("truncated", "truncated"),
    ("corrupted", "checksum does not match"),
    ("other document", "are not the start of this input"),
])
def test_foreign_session_is_refused_in_one_line_and_the_run_answers(tiny, doc, fresh, tmp_path, caplog, case,
                                                                    words):
    path = tmp_path / "s.kv"
    made_from, kv, made_doc = tiny, "q8_0", doc
    if case == "other model":  # same shapes, other weights
        made_from = tiny_chat_llama_gguf(tmp_path / "other.gguf", seed=1)
    elif case == "other kv":
        kv = "f16"
    elif case == "other document":
        made_doc = "Another text entirely. " + doc
    runner.run(made_from, QUESTION, document=made_doc, session=path, kv=kv, **GREEDY)
    if case == "truncated":
        _truncate(path)
    elif case == "corrupted":
        _corrupt(path)
    with caplog.at_level(logging.WARNING, logger="ctxq.runtime.session"):
        r = runner.run(tiny, QUESTION, document=doc, session=path, kv="q8_0", **GREEDY)
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert words in warnings[0] and "processing the input from the start" in warnings[0]
    assert r.n_cached == 0 and r.tokens == fresh.tokens  # never an answer from a foreign cache
    # the run saved its own state over the foreign file: the next run restores it
    assert runner.run(tiny, QUESTION, document=doc, session=path, kv="q8_0", **GREEDY).n_cached > 1400


def test_restore_session_api_checks_prefix_and_returns_count(tiny, doc, tmp_path):
    p = runner.prepare(tiny, QUESTION, document=doc, session=tmp_path / "s.kv", kv="q8_0", **{
        k: v for k, v in GREEDY.items() if k in ("chat", "n_ctx")})
    head = p.tokens[:p.keep]
    llm = runner.load(plan=p.plan)
    try:
        llm.eval(head)
        session.save_session(llm, tmp_path / "s.kv", head, p.plan)
        llm.reset()
        assert session.restore_session(llm, tmp_path / "s.kv", p.plan, p.tokens) == len(head)
        assert llm.n_tokens == len(head) and list(llm.input_ids[:len(head)]) == head
        assert session.restore_session(llm, tmp_path / "s.kv", p.plan, head[:-1]) == 0  # longer than the input
        assert session.restore_session(llm, tmp_path / "missing.kv", p.plan) == 0
    finally:
        llm.close()
    # ctxq.load(session=...) restores right after loading; llama-cpp-python reuses it as a prefix
    llm = runner.load(plan=p.plan, session=tmp_path / "s.kv")
    try:
        assert llm.ctxq_session == len(head) and llm.n_tokens == len(head)
    finally:
        llm.close()


def test_cli_refuses_a_session_of_another_kv_type_in_one_line(tiny, doc, tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text(doc)
    args = ("run", str(tiny), "-f", str(f), "-p", QUESTION, "--chat", "--temp", "0", "-n", "8", "-c", "4096",
            "--session", str(tmp_path / "s.kv"))
    r = run_ctxq(*args, "--kv", "f16")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^ctxq: session: saved \d+ tokens to ", r.stderr, re.M), r.stderr
    r = run_ctxq(*args, "--kv", "q8_0", "--json")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if "session" in l]
    assert len(lines) == 2, r.stderr  # not used (and why), then saved again
    assert "not used: it was made with -ctk f16, -ctv f16; this plan has -ctk q8_0, -ctv q8_0" in lines[0]
    out = json.loads(r.stdout)
    assert out["n_cached"] == 0 and out["n_generated"] > 0


@pytest.mark.slow
def test_smollm2_restored_session_gives_the_same_greedy_answer(smollm2, tmp_path):
    doc = " ".join(f"Room {i} of the hotel is painted {c}." for i, c in
                   enumerate(["red", "blue", "green", "white", "yellow", "black"] * 30))
    f = tmp_path / "doc.txt"
    f.write_text(doc)
    base = ("run", str(smollm2), "-f", str(f), "--chat", "--temp", "0", "-n", "16", "-c", "4096", "--json")
    q = ("-p", "What colour is room 3?")
    fresh = json.loads(run_ctxq(*base, *q).stdout)
    saved = run_ctxq(*base, *q, "--session", str(tmp_path / "s.kv"))
    restored = run_ctxq(*base, *q, "--session", str(tmp_path / "s.kv"))
    assert saved.returncode == 0 and restored.returncode == 0, saved.stderr + restored.stderr
    saved, restored = json.loads(saved.stdout), json.loads(restored.stdout)
    assert fresh["text"].strip() and saved["text"] == fresh["text"] and restored["text"] == fresh["text"]
    assert restored["n_cached"] > 0.95 * restored["n_prompt"] and saved["n_cached"] == 0
    other = json.loads(run_ctxq(*base, "-p", "What colour is room 4?", "--session", str(tmp_path / "s.kv")).stdout)
    assert other["n_cached"] == restored["n_cached"]


@pytest.mark.slow
def test_kill_9_while_saving_leaves_no_session_file(smollm2, tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text(text_of_tokens(smollm2, 2000)[0])
    target = tmp_path / "s.kv"
    args = [ctxq_exe(), "run", str(smollm2), "-f", str(f), "-p", "Why?", "-n", "1", "-c", "4096", "--kv", "f16",
            "--session", str(target)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = None
    try:
        while proc.poll() is None and partial is None:  # the state (about 45 MiB) is being written
            partial = next(tmp_path.glob(".s.kv.*.partial"), None)
            time.sleep(0.0005)
        assert partial is not None, "the run ended before its save was seen"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()
    r = run_ctxq(*args[1:])  # the next run saves the session and removes the killed save's leftovers
    assert r.returncode == 0, r.stderr
    assert target.is_file() and not list(tmp_path.glob(".s.kv.*"))


def test_auto_sessions_evict_the_least_recently_used(tiny, doc, tmp_path, monkeypatch):
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path))
    kw = dict(session="auto", kv="q8_0", **GREEDY)
    docs = [doc, "Second. " + doc, "Third. " + doc]
    runner.run(tiny, QUESTION, document=docs[0], **kw)
    (a,) = list(session.cache_dir().glob("*.kv"))
    # room for two sessions of this size, not three
    monkeypatch.setenv("CTXQ_SESSION_CACHE_GIB", str(2.5 * a.stat().st_size / 2**30))
    runner.run(tiny, QUESTION, document=docs[1], **kw)
    assert runner.run(tiny, QUESTION, document=docs[0], **kw).n_cached > 1400  # used now: b is the oldest
    runner.run(tiny, QUESTION, document=docs[2], **kw)
    left = list(session.cache_dir().glob("*.kv"))
    assert len(left) == 2 and a in left
    # b was evicted; saving it again evicts a, now the least recently used
    assert runner.run(tiny, QUESTION, document=docs[1], **kw).n_cached == 0
    assert len(list(session.cache_dir().glob("*.kv"))) == 2 and not a.exists()
    assert runner.run(tiny, QUESTION, document=docs[2], **kw).n_cached > 1400
    monkeypatch.setenv("CTXQ_SESSION_CACHE_GIB", "0.00001")  # 10 KiB: less than one session
    assert runner.run(tiny, QUESTION, document=docs[2], **kw).n_cached > 1400  # restoring needs no room


def test_a_session_the_disk_has_no_room_for_is_refused_in_one_line(tiny, doc, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a 256 KiB tmpfs (a disk too small for the session)")
    try:
        f = tmp_path / "doc.txt"
        f.write_text(doc)
        r = run_ctxq("run", str(tiny), "-f", str(f), "-p", QUESTION, "--temp", "0", "-n", "4", "-c", "4096",
                     "--kv", "f16", "--session", str(mnt / "s.kv"))
        assert r.returncode == 0, r.stderr
        lines = [l for l in r.stderr.splitlines() if "session" in l]
        assert len(lines) == 1 and re.search(r"session not saved: the session needs [\d.]+ MiB but .* has "
                                             r"0\.\d MiB free", lines[0]), r.stderr
        assert r.stdout.strip() and os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --- ctxq serve: the prefix reused between requests, and a start from a saved session ------------

HOTEL = " ".join(f"Room {i} of the hotel is painted {c}." for i, c in
                 enumerate(["red", "blue", "green", "white", "yellow", "black"] * 20))
SERVE_PLAN = dict(n_ctx=4096, kv="f16")


def _chat(client, question: str) -> dict:
    """A chat request as a new user writes it: the document, then the question, in one user message."""
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": HOTEL + "\n\n" + question}], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_evals(llm) -> int:
    """Prompt tokens llama.cpp has evaluated in this context (its perf counter n_p_eval)."""
    return runner.backend.llama_cpp().llama_perf_context(llm._ctx.ctx).n_p_eval


def _served_llm():
    from llama_cpp.server import app as server_app

    return server_app._llama_proxy._current_model


@pytest.mark.slow
def test_server_reuses_the_document_across_questions(smollm2):
    from fastapi.testclient import TestClient

    from ctxq.serve import server

    app, load = server.create_app(runner.make_plan(smollm2, **SERVE_PLAN))
    load()
    llm = _served_llm()
    with TestClient(app) as client:
        before = _prompt_evals(llm)
        t0 = time.perf_counter()
        first = _chat(client, "What colour is room 3?")
        t1 = time.perf_counter()
        after_first = _prompt_evals(llm)
        second = _chat(client, "What colour is room 4?")
        t2 = time.perf_counter()
        n_prompt = first["usage"]["prompt_tokens"]
        assert n_prompt > 900 and after_first - before >= n_prompt - 1
        # the second question evaluates only what follows the shared document
        assert _prompt_evals(llm) - after_first < 40, (_prompt_evals(llm), after_first)
        assert second["choices"][0]["message"]["content"].strip()
        print(f"\nserve: first question {t1 - t0:.2f} s, second {t2 - t1:.2f} s")


@pytest.mark.slow
def test_server_started_from_a_session_does_not_prefill_the_document(smollm2, tmp_path):
    from fastapi.testclient import TestClient

    from ctxq.serve import server

    path = tmp_path / "hotel.kv"
    saved = runner.run(smollm2, "What colour is room 3?", document=HOTEL, chat=True, n_predict=1, session=path,
                       **SERVE_PLAN)
    n_doc = session.read_metadata(path)["n_tokens"]
    assert n_doc > 0.98 * saved.n_prompt
    app, load = server.create_app(runner.make_plan(smollm2, **SERVE_PLAN), session=path)
    load()  # restores the session before the API lets a request in
    llm = _served_llm()
    assert llm.n_tokens == n_doc
    with TestClient(app) as client:
        before = _prompt_evals(llm)
        answer = _chat(client, "What colour is room 4?")
        assert answer["choices"][0]["message"]["content"].strip()
        assert answer["usage"]["prompt_tokens"] > n_doc and _prompt_evals(llm) - before < 40

    # the command line: `ctxq serve --session FILE` says what it restored and answers
    import httpx

    from .test_serve import _free_port

    port = _free_port()
    proc = subprocess.Popen([ctxq_exe(), "serve", str(smollm2), "-c", "4096", "--kv", "f16", "--port", str(port),
                             "--session", str(path)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        with httpx.Client(base_url=base, timeout=300) as client:
            assert _chat(client, "What colour is room 5?")["choices"][0]["message"]["content"].strip()
    finally:
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
    assert f"ctxq: session: restored {n_doc} tokens from {path}" in err, err
