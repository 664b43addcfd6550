"""`ctxq run -f DOC -p Q1 -p Q2 ...`, `--questions FILE` and `ctxq.ask()`: the document read once, the
answers decoded together, against single runs of the same questions (real SmolLM2 in real llama.cpp)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import ctxq
from ctxq.cli import cli
from ctxq.runtime import runner

from .conftest import run_ctxq

DOC = " ".join(f"Room {i} is painted {c}." for i, c in enumerate(["red", "blue", "green", "yellow"] * 6))
QUESTIONS = ["What colour is room 3?", "What colour is room 6?", "Which room is green?", "Name a yellow room."]
N = "10"


@pytest.fixture(scope="module")
def doc_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("doc") / "doc.txt"
    p.write_text(DOC)
    return p


@pytest.fixture(scope="module")
def many_json(doc_file):
    args = ["run", "-f", str(doc_file), "--chat", "--temp", "0", "-n", N, "--ctx", "2048", "--json"]
    for q in QUESTIONS:
        args += ["-p", q]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_four_questions_give_the_answers_of_four_single_runs(many_json):
    singles = [runner.run(None, q, document=DOC, chat=True, temp=0, n_predict=int(N), n_ctx=2048) for q in QUESTIONS]
    assert [a["question"] for a in many_json] == QUESTIONS
    n_doc = many_json[0]["n_document"]
    assert n_doc > 100 and all(a["cached_tokens"] == n_doc for a in many_json)  # every question forked
    assert [a["prompt_tokens"] for a in many_json] == [s.n_prompt for s in singles]
    matches = sum(a["text"] == s.text for a, s in zip(many_json, singles))
    print(f"ctxq run with {len(QUESTIONS)} questions: {matches} answers equal to single runs")
    assert matches >= len(QUESTIONS) - 1, [(a["text"], s.text) for a, s in zip(many_json, singles)]


def test_questions_file_and_labelled_text_output(doc_file, tmp_path, many_json):
    qfile = tmp_path / "q.txt"
    qfile.write_text("\n".join(QUESTIONS[:2]) + "\n\n")
    r = CliRunner().invoke(cli, ["run", "-f", str(doc_file), "--questions", str(qfile), "--chat", "--temp", "0",
                                 "-n", N, "--ctx", "2048"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.index(f"[1] {QUESTIONS[0]}") < out.index(f"[2] {QUESTIONS[1]}")
    assert many_json[0]["text"] in out and many_json[1]["text"] in out
    assert "held once" in r.stderr and f"{len(QUESTIONS[:2])} questions" in r.stderr


def test_bad_input_for_several_questions_is_one_line(doc_file, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = run_ctxq("run", "--questions", str(empty), "-f", str(doc_file))
    assert r.returncode == 1 and r.stderr.strip().startswith("Error:") and "no questions" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_ctxq("run", "-p", "a?", "-p", "b?", input="")
    assert r.returncode == 2 and "-f FILE" in r.stderr
    r = run_ctxq("run", "-f", str(doc_file), "-p", "a?", "-p", "b?", "--ctx", "256", "-n", "200")
    assert r.returncode == 1 and "KV cells" in r.stderr and "Traceback" not in r.stderr


def test_ask_answers_in_order_from_a_model_or_a_loaded_llama(smollm2):
    answers = ctxq.ask(None, DOC, QUESTIONS[:2], max_tokens=6)
    assert [a.question for a in answers] == QUESTIONS[:2]
    assert all(a.completion_tokens > 0 and a.finish_reason in ("stop", "length") for a in answers)
    llm = ctxq.load(smollm2, n_ctx=2048)
    try:
        again = ctxq.ask(llm, DOC, QUESTIONS[:2], max_tokens=6)
    finally:
        llm.close()
    assert [a.text for a in again] == [a.text for a in answers]
    assert again[1].cached_tokens == answers[1].cached_tokens > 100


def test_a_session_restores_the_document_for_several_questions(doc_file, tmp_path, many_json):
    base = ["run", "-f", str(doc_file), "--chat", "--temp", "0", "-n", N, "--ctx", "2048", "--json",
            "--session", str(tmp_path / "doc.kv"), "-p", QUESTIONS[0], "-p", QUESTIONS[1]]
    first = CliRunner().invoke(cli, base, catch_exceptions=False)
    assert first.exit_code == 0 and (tmp_path / "doc.kv").is_file()
    second = CliRunner().invoke(cli, base[:-4] + ["-p", QUESTIONS[2], "-p", QUESTIONS[3]], catch_exceptions=False)
    assert second.exit_code == 0, second.output
    got = json.loads(second.stdout)
    assert [a["text"] for a in got] == [a["text"] for a in many_json[2:]]
    # a single run restores the same file: the document evaluated by the engine is what a run saves
    single = runner.run(None, QUESTIONS[0], document=DOC, chat=True, temp=0, n_predict=int(N), n_ctx=2048,
                        session=tmp_path / "doc.kv")
    assert single.n_cached == many_json[0]["n_document"]
