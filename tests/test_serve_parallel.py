"""`ctxq serve --parallel` (issue 29): many questions about one document answered together by ctxq's
engine, the document's KV cells held and evaluated once. The real console script, real HTTP clients,
SmolLM2-135M (a ~5k-token document) and the tiny random model (a generation that never ends)."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .test_serve import KEY, metrics, serving

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
N_CTX = 8192
NAMES = "Ada Boris Chloe Dmitri Elena Farid Greta Hugo".split()
CITIES = "Lisbon Oslo Cairo Lima Quito Dakar Hanoi Riga".split()
WORDS = ("the of and to in is was for on that with as by at from which river mountain library window garden "
         "morning evening letter story journey market silver green quiet ancient bright narrow distant").split()
QUESTIONS = [f"In which city does {n} live? Answer with the city's name." for n in NAMES]
# every end-of-generation token of the SmolLM2 vocabulary: <|endoftext|>, <|im_end|> and <reponame> (FIM REP,
# which llama.cpp also ends on: a random tiny model sampled it 188 tokens into a stream in CI)
ENDLESS = {"prompt": "1, 2, 3,", "max_tokens": 4000, "logit_bias": {"0": -100, "2": -100, "4": -100}}


def document(n_sentences: int = 380) -> str:
    """English-looking filler (~5k SmolLM2 tokens) with one fact per person spread through it."""
    rng = random.Random(0)
    sents = [" ".join(rng.choice(WORDS) for _ in range(11)).capitalize() + "." for _ in range(n_sentences)]
    for i, (name, city) in enumerate(zip(NAMES, CITIES)):
        sents.insert((i + 1) * n_sentences // 9, f"{name} lives in {city}.")
    return " ".join(sents)


DOC = document()


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": DOC + "\n\n" + question}]


def stream_chat(base: str, question: str, marks: dict) -> dict:
    """A streamed greedy answer with include_usage: its text, usage, and when its first and last piece came."""
    body = {"messages": chat(question), "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, first = [], None, None
    with httpx.Client(base_url=base, headers=AUTH, timeout=600) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"]:
                piece = chunk["choices"][0]["delta"].get("content")
                if piece:
                    first = first or time.monotonic()
                    text.append(piece)
            else:
                usage = chunk["usage"]
    marks[question] = (first, time.monotonic())
    return {"text": "".join(text), "usage": usage}


@pytest.fixture(scope="module")
def one_at_a_time(smollm2, tmp_path_factory):
    """The same questions, one after another, on today's serve (llama-cpp-python's, no --parallel)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    out = []
    with serving(smollm2, log, "-c", str(N_CTX), "--api-key", KEY) as (base, _):
        for q in QUESTIONS:
            r = httpx.post(base + "/v1/chat/completions", json={"messages": chat(q), "max_tokens": 16,
                                                                "temperature": 0}, headers=AUTH, timeout=600)
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["message"]["content"])
    return out


@pytest.fixture(scope="module")
def parallel(smollm2, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(smollm2, log, "-c", str(N_CTX), "--parallel", "8", "--api-key", KEY) as running:
        yield running


def test_eight_questions_on_one_document_answered_together(parallel, one_at_a_time):
    base, log = parallel
    assert "--parallel 8: 8 sequences share the 8,192 KV cells" in log.read_text()
    n_doc = len(httpx.post(base + "/extras/tokenize", json={"input": DOC}, headers=AUTH, timeout=60).json()["tokens"])
    assert 4500 < n_doc < 6000
    before, marks = metrics(base), {}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda q: stream_chat(base, q, marks), QUESTIONS))
    after = metrics(base)
    evaluated = after["ctxq_prompt_tokens_evaluated_total"] - before["ctxq_prompt_tokens_evaluated_total"]
    prompts = [a["usage"]["prompt_tokens"] for a in answers]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    # The document evaluated once: 8 prompts of ~5.1k tokens, under 1.3 documents evaluated in all.
    assert all(p > n_doc for p in prompts)
    assert evaluated < 1.3 * n_doc, (evaluated, n_doc)
    assert sum(prompts) - sum(cached) == pytest.approx(evaluated, abs=8)
    assert sum(c >= n_doc - 64 for c in cached) >= 7, cached
    # The streams ran together: every stream had its first piece before any stream ended.
    assert max(f for f, _ in marks.values()) < min(e for _, e in marks.values()), marks
    same = sum(a["text"] == b for a, b in zip(answers, one_at_a_time))
    print(f"\ngreedy answers equal to one at a time: {same} of {len(answers)}")
    for q, a, b in zip(QUESTIONS, answers, one_at_a_time):
        print(f"  {q[:32]!r}: together {a['text']!r}, alone {b!r}")
    assert same >= 6  # batch arithmetic may differ in the last bits
    assert httpx.get(base + "/health").json()["status"] == "ready"
    idle = metrics(base)
    assert idle["ctxq_sequences_active"] == 0 and idle["ctxq_requests_processing"] == 0


def test_cached_tokens_in_a_plain_answer(parallel):
    base = parallel[0]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": chat(QUESTIONS[0]), "max_tokens": 4,
                                                        "temperature": 0}, headers=AUTH, timeout=600)
    assert r.status_code == 200, r.text
    use = r.json()["usage"]
    assert use["prompt_tokens_details"]["cached_tokens"] > 4500  # the document is resident from before
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]


def test_sixty_four_concurrent_requests_answered_or_refused_cleanly(parallel):
    base = parallel[0]

    def ask(i):
        r = httpx.post(base + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": 6, "temperature": 0},
            headers=AUTH, timeout=600)
        return r.status_code, r.json(), r.headers

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(ask, range(64)))
    codes = [s for s, _, _ in results]
    assert set(codes) <= {200, 503}, codes
    # 8 generating plus 32 waiting (max_queue) are let in; the rest may be refused with Retry-After
    assert codes.count(200) >= 40
    for status, body, headers in results:
        if status == 200:
            assert body["choices"][0]["message"]["content"] is not None and body["usage"]["completion_tokens"] > 0
        else:
            assert body["error"]["code"] == "server_overloaded" and int(headers["retry-after"]) >= 1
    assert len({b["id"] for s, b, _ in results if s == 200}) == codes.count(200)
    m = metrics(base)
    assert m["ctxq_sequences_active"] == 0 and m["ctxq_sequences_queued"] == 0
    assert httpx.get(base + "/health").json()["status"] == "ready"


@pytest.fixture(scope="module")
def tiny_parallel(tmp_path_factory):
    from ctxq.testing.models import tiny_chat_llama_gguf

    model = tiny_chat_llama_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(model, log, "-c", "4096", "--parallel", "auto", "--api-key", KEY) as running:
        yield running


def test_default_parallel_is_said_at_startup(tiny_parallel):
    text = tiny_parallel[1].read_text()
    line = next(ln for ln in text.splitlines() if "--parallel" in ln)
    # 4096 cells hold 8 answers of 512 cells: the plan's free memory holds their buffers on this machine
    assert "--parallel 8: 8 sequences share the 4,096 KV cells" in line and "MiB free" in line, line
    assert metrics(tiny_parallel[0])["ctxq_sequences_max"] == 8


def test_a_client_that_leaves_frees_its_sequence_and_cells(tiny_parallel):
    base = tiny_parallel[0]
    idle = metrics(base)
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as r:
        assert r.status_code == 200
        lines, chunks = r.iter_lines(), 0
        while chunks < 5:
            chunks += next(lines).startswith("data: ")
        busy = metrics(base)
        assert busy["ctxq_sequences_active"] == 1 and busy["ctxq_kv_cells_used"] > idle["ctxq_kv_cells_used"]
    left = time.monotonic()
    while metrics(base)["ctxq_sequences_active"] != 0:
        assert time.monotonic() - left < 10, "the sequence was not freed after its client left"
        time.sleep(0.05)
    a = metrics(base)
    time.sleep(0.5)
    b = metrics(base)
    assert a["ctxq_tokens_predicted_total"] == b["ctxq_tokens_predicted_total"]  # nothing decodes for it any more
    assert 5 <= a["ctxq_tokens_predicted_total"] - idle["ctxq_tokens_predicted_total"] < ENDLESS["max_tokens"] / 2
    # its private cells are free: at most the prompt stays resident for a later request to share
    assert b["ctxq_kv_cells_used"] <= idle["ctxq_kv_cells_used"] + 16


def test_a_request_over_the_cells_is_refused_with_both_numbers(tiny_parallel):
    base = tiny_parallel[0]
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi " * 3000, "max_tokens": 2000}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == 4096 and err["max_tokens"] == 2000
    assert str(err["prompt_tokens"]) in err["message"] and "4096" in err["message"]
    ok = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_second_document_takes_the_cells_of_the_first(tiny_parallel):
    """The first document stays resident for follow-up questions; a second one that needs its cells
    gets them (both start with the chat template's tokens, which are all they share)."""
    base = tiny_parallel[0]
    for seed in (1, 2):
        rng = random.Random(seed)
        doc = " ".join(rng.choice(WORDS) for _ in range(3000))  # ~3k tokens: two do not fit in 4096 cells
        r = httpx.post(base + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": doc + "\n\nSummarize."}], "max_tokens": 4}, headers=AUTH,
            timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 2500
    m = metrics(base)
    assert m["ctxq_sequences_active"] == 0 and m["ctxq_sequences_queued"] == 0
    assert m["ctxq_kv_cells_used"] <= 4096
