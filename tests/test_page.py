"""`ctxq serve`'s page (issue 62) in a real browser: Debian's Chromium driven by Playwright, against the real console
script serving the default model on two simulated cards (`--simulate 0.3,0.2`: RPC workers on 127.0.0.1).

The plan drawn per device is checked against `ctxq plan --json`; a ~60k-character document is read with a progress
bar that moves and says the time left, across a reload; questions stream, the second starting in a small fraction of
the document's reading time; a hostile document runs nothing; every request the browser makes stays on 127.0.0.1;
`ctxq plan --html` draws the same bars from a file with no server."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import playwright.sync_api as playwright  # the test extra installs it: a missing driver fails, never skips
import pytest

from .conftest import run_ctxq
from .test_serve import serving

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it with EXTRAS=test where apt-get "
                "runs as root)", allow_module_level=True)

KEY = "page-key"
N_CTX = 16384  # the document's server: a ~60k-character document is ~11.6k tokens
PLAN_CTX = 4096  # the default model's
SIM = "0.3,0.2"
# the flags that work for Debian's Chromium here, headless as root (no sandbox), with no traffic of its own
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WORDS = ("the of and to in is was for on that with as by at from which river mountain library window garden "
         "morning evening letter story journey market silver green quiet ancient bright narrow distant").split()
HOSTILE = ('Minutes of the meeting.\n<script>window.__pwned = "script"</script>\n'
           '<img src=x onerror="window.__pwned = \'img\'">\n<b onmouseover="window.__pwned = 1">bold</b>\n'
           "The meeting was held in Lisbon.\n")


def document(chars: int = 60_000) -> str:
    """English-looking filler with one fact in it, about `chars` characters."""
    rng = random.Random(7)
    sents = []
    while sum(len(s) + 1 for s in sents) < chars:
        sents.append(" ".join(rng.choice(WORDS) for _ in range(11)).capitalize() + ".")
    sents.insert(len(sents) // 2, "Ada keeps her bicycle in Oslo.")
    return " ".join(sents)


def wait_until(page, expression: str, seconds: float = 30) -> None:
    """Until `expression` is true in the page: polled with evaluate, which the page's Content-Security-Policy lets
    through (Playwright's wait_for_function evaluates a string with eval, which it forbids)."""
    deadline = time.monotonic() + seconds
    while not page.evaluate(f"() => Boolean({expression})"):
        assert time.monotonic() < deadline, f"not within {seconds} s: {expression}"
        time.sleep(0.1)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"  # as `ctxq plan` prints a size


def plan_json(*args: str, ctx: int = 16384) -> dict:
    r = run_ctxq("plan", "--ctx", str(ctx), "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def bars(page) -> list[dict]:
    """Each drawn device: its label's texts and its segments' bytes."""
    return page.eval_on_selector_all(".device", """rows => rows.map(r => ({
        name: r.querySelector('.device-name').textContent,
        figures: r.querySelector('.device-figures').textContent,
        segments: Object.fromEntries([...r.querySelectorAll('.seg')].map(s => [s.dataset.segment, +s.dataset.bytes])),
        width: r.querySelector('.bar').getBoundingClientRect().width}))""")


def assert_bars_are(drawn: list[dict], plan: dict, host_capacity_exact: bool = True) -> None:
    devices = [*plan["gpus"], plan["host"]]
    assert len(drawn) == len(devices), (drawn, [d["device"]["name"] for d in devices])
    for row, d in zip(drawn, devices):
        total, capacity = row["figures"].removeprefix("total ").removesuffix(" GiB").split(" GiB of ")
        assert total == gib(d["total"]), (row, d["total"])
        if d is plan["host"] and not host_capacity_exact:
            assert abs(float(capacity) - d["device"]["usable"] / 2**30) < 2  # available RAM moves between calls
        else:
            assert capacity == gib(d["device"]["usable"]), (row, d["device"]["usable"])
        assert row["segments"]["KV cache"] == d["kv"] if d["kv"] else "KV cache" not in row["segments"]
        assert sum(v for k, v in row["segments"].items() if k != "free") == d["total"]


@pytest.fixture(scope="module")
def plan_server(smollm2, tmp_path_factory):
    """The default model on two simulated cards, one request at a time, no key."""
    log = tmp_path_factory.mktemp("page") / "serve.log"
    with serving(smollm2, log, "-c", str(PLAN_CTX), "--simulate", SIM) as (base, _):
        yield base


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The document's server: the default model's tokenizer and template on a tiny random network (a 60k-character
    document reads in seconds, not the minutes SmolLM2 takes on 2 cores), --parallel, an API key, a 0.25 MiB body
    limit."""
    from ctxq.testing.models import tiny_chat_llama_gguf

    model = tiny_chat_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf")
    log = tmp_path_factory.mktemp("page") / "serve.log"
    # -b/-ub 256: the engine reads the document in ~46 steps, each one a progress event, so that a reload lands
    # in the middle of the read on a fast machine too
    with serving(model, log, "-c", str(N_CTX), "--parallel", "2", "--api-key", KEY, "--max-body", "0.25",
                 "-b", "256", "-ub", "256") as (base, _):
        yield base


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A fresh Chromium profile; every request any page of it makes is recorded."""
    with playwright.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium-profile")),
                                                    executable_path=CHROMIUM, headless=True, args=ARGS)
        ctx.requests = []
        ctx.on("request", lambda r: ctx.requests.append(r.url))
        try:
            yield ctx
        finally:
            ctx.close()


@pytest.fixture(scope="module")
def page(server, browser):
    """The document server's page, past its API key form."""
    p = browser.new_page()
    p.goto(server + "/")
    p.get_by_label("API key").fill(KEY)  # the server has --api-key: the page asks for it
    p.get_by_role("button", name="Use key").click()
    p.wait_for_selector(".device")
    return p


def test_the_bars_are_what_ctxq_plan_json_says(plan_server, browser):
    page = browser.new_page()
    page.goto(plan_server + "/")
    page.wait_for_selector(".device")
    want = plan_json("--simulate", SIM, ctx=PLAN_CTX)
    drawn = bars(page)
    assert_bars_are(drawn, want, host_capacity_exact=False)
    assert drawn[0]["width"] > drawn[1]["width"]  # 0.3 GiB draws longer than 0.2 GiB
    assert [r["name"] for r in drawn][-1] == "CPU"
    # another set of cards for the served model: re-planned, redrawn (the model is not reloaded)
    page.get_by_label("Cards").fill("16,16,16,8,8")
    page.get_by_role("button", name="Plan", exact=True).click()
    wait_until(page, "document.querySelectorAll('.device').length === 6")
    assert_bars_are(bars(page), plan_json("--gpus", "16,16,16,8,8", ctx=PLAN_CTX), host_capacity_exact=False)
    # a setting that does not fit: the plan's own one line, the bars left as they were
    page.get_by_label("Context (tokens)").fill("100000000")
    page.get_by_role("button", name="Plan", exact=True).click()
    wait_until(page, "document.getElementById('plan-error').textContent.length > 0")
    error = page.locator("#plan-error").text_content()
    assert "100,000,000" in error or "100000000" in error, error
    assert page.locator(".device").count() == 6
    page.get_by_role("button", name="Back to the served plan").click()
    assert page.locator(".device").count() == 3
    page.close()


def test_one_at_a_time_a_read_document_is_held_for_the_question(plan_server):
    """Without --parallel the Llama keeps the document's tokens; llama-cpp-python's prefix reuse starts the
    question after them (its streams report no usage: /metrics counts the reused tokens)."""
    doc = document(1_000)
    r = httpx.post(plan_server + "/page/document", content=doc.encode(), timeout=60)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while (s := httpx.get(plan_server + "/page/document").json())["state"] == "reading":
        assert time.monotonic() < deadline, s
        time.sleep(0.3)
    assert s["state"] == "read" and s["done"] == s["tokens"] > 100 and s["text"] == doc, s
    before = _reused(plan_server)
    answer = httpx.post(plan_server + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": doc + "\n\nWhere does Ada keep her bicycle?"}],
        "max_tokens": 2, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert _reused(plan_server) - before >= s["tokens"] - 2, (before, s)  # the document, not read again


def _reused(base: str) -> float:
    text = httpx.get(base + "/metrics").text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("ctxq_prompt_tokens_reused_total")))


@pytest.fixture(scope="module")
def reading(page, tmp_path_factory):
    """The ~60k-character document uploaded from a file and read, the page reloaded in the middle: samples of the
    progress bar and its line every 100 ms until the reading ends."""
    path = tmp_path_factory.mktemp("doc") / "report.txt"
    path.write_text(document())
    page.get_by_label("Document file").set_input_files(str(path))
    page.get_by_role("button", name="Read").click()
    samples, reloaded, deadline = [], False, time.monotonic() + 300  # a loaded CI machine reads slower
    while time.monotonic() < deadline:
        s = page.evaluate("""() => { const p = document.querySelector('progress');
            const line = document.getElementById('read-status');
            return {value: p.value, max: p.max, text: line.textContent, state: line.dataset.state || ''}; }""")
        samples.append(s)
        if s["state"] == "read":
            break
        if not reloaded and s["state"] == "reading" and 0 < s["value"] < s["max"]:
            page.reload()  # the server keeps the job: the page finds it and follows it again
            reloaded = True
        time.sleep(0.02)
    assert samples[-1]["state"] == "read", samples[-3:]
    assert reloaded, "the reading ended before the page could reload in its middle"
    return {"samples": samples, "path": path}


def test_a_long_document_reads_with_a_moving_progress_bar_and_eta(reading, page):
    samples = reading["samples"]
    during = [s for s in samples if s["state"] == "reading"]
    values = sorted({s["value"] for s in during if 0 < s["value"] < s["max"]})
    assert len(values) >= 2, samples  # it moved, and was seen between its ends
    assert any(" s left" in s["text"] and "tokens/s" in s["text"] for s in during), during[-3:]
    last = samples[-1]
    assert last["value"] == last["max"] > 10_000  # the whole document, as tokens
    assert page.locator("#doc-held").text_content() == reading["path"].read_text()  # the text the server holds


def ask(page, question: str, max_tokens: int = 8) -> dict:
    """Ask on the page; (the answer, its stats line and ttft, how many times the answer's text changed)."""
    n = page.locator("#answers article").count()
    page.evaluate("""() => { window.__changes = 0; new MutationObserver(() => window.__changes++)
        .observe(document.getElementById('answers'), {subtree: true, childList: true, characterData: true}); }""")
    page.get_by_label("Answer length").fill(str(max_tokens))
    page.get_by_label("Question", exact=True).fill(question)
    page.get_by_role("button", name="Ask").click()
    article = page.locator("#answers article").nth(n)
    stats = article.locator(".stats")
    wait_until(page, f"document.querySelectorAll('#answers article')[{n}]?.querySelector('.stats')"
               "?.dataset.ttft !== undefined", 120)
    return {"answer": article.locator(".answer").text_content(), "stats": stats.text_content(),
            "ttft": float(stats.get_attribute("data-ttft")), "read": int(stats.get_attribute("data-read")),
            "changes": page.evaluate("window.__changes")}


def test_questions_stream_and_read_only_their_own_tokens(reading, page):
    read_s = float(page.locator("#read-status").text_content().split(" in ")[1].split(" s")[0])
    first = ask(page, "Where does Ada keep her bicycle?")
    second = ask(page, "What is the document about?")
    log = page.get_by_role("log")
    assert log.locator("article").count() >= 2
    for a in (first, second):
        assert a["answer"].strip(), a
        assert a["changes"] >= 3, a  # the answer came in pieces, not at once
        assert "time to first token" in a["stats"] and "tokens/s" in a["stats"], a
        assert 0 < a["read"] < 64, a  # the question's own tokens, not the document's
    assert second["ttft"] < 0.25 * read_s, (second, read_s)


def test_two_tabs_ask_at_once(reading, page, browser, server):
    other = browser.new_page()  # a tab of its own: sessionStorage is per tab, so it asks for the key again
    other.goto(server + "/")
    other.get_by_label("API key").fill(KEY)
    other.get_by_role("button", name="Use key").click()
    wait_until(other, "!document.getElementById('doc-shown').hidden")  # it found the document the server holds
    for tab, q in ((page, "Who keeps a bicycle?"), (other, "Which city is named?")):
        tab.get_by_label("Answer length").fill("8")
        tab.get_by_label("Question", exact=True).fill(q)
    n = page.locator("#answers article").count()
    page.get_by_role("button", name="Ask").click()
    other.get_by_role("button", name="Ask").click()
    for tab, i in ((page, n), (other, 0)):
        wait_until(tab, f"document.querySelectorAll('#answers .stats')[{i}]?.dataset.ttft !== undefined", 120)
        stats = tab.locator("#answers .stats").nth(i)
        assert 0 < int(stats.get_attribute("data-read")) < 64, stats.text_content()
    other.close()


def test_a_hostile_document_runs_nothing_and_shows_as_text(page, server):
    page.get_by_label("Document file").set_input_files([])
    page.get_by_label("Document text").fill(HOSTILE)
    page.get_by_role("button", name="Read").click()
    wait_until(page, "document.getElementById('read-status').dataset.state === 'read'", 60)
    assert page.locator("#doc-held").text_content() == HOSTILE
    hostile_question = '<img src=x onerror="window.__pwned = \'question\'"> Where was the meeting?'
    a = ask(page, hostile_question)
    assert page.locator("#answers .question").last.text_content() == hostile_question
    assert page.evaluate("window.__pwned") is None
    assert page.locator("main img, main script, main b").count() == 0  # nothing became an element
    assert not [u for u in page.context.requests if urlparse(u).path == "/x"]  # no <img src=x> was loaded
    assert a["answer"] is not None


def test_the_server_refuses_what_it_cannot_read(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(server + "/")
    assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    assert "<script type=\"module\" src=" in r.text and "<script>" not in r.text  # no inline script
    assert httpx.get(server + "/page/plan").status_code == 401  # the key, as for the API
    assert httpx.get(server + "/page/files/nothing.js").status_code == 404
    too_big = httpx.post(server + "/page/document", content=b"word " * 60_000, headers=auth)
    assert too_big.status_code == 413 and "262144 bytes" in too_big.json()["error"]["message"]
    long = httpx.post(server + "/page/document", content=" ".join(["word"] * 40_000).encode(), headers=auth,
                      timeout=60)
    assert long.status_code == 400, long.text
    msg = long.json()["error"]["message"]
    assert f"{N_CTX:,}" in msg and f"{long.json()['error']['prompt_tokens']:,} tokens" in msg, msg


def test_the_page_loads_nothing_from_outside_loopback(page, browser, server):
    assert browser.requests, "no request was recorded"
    outside = [u for u in browser.requests if urlparse(u).hostname != "127.0.0.1"]
    assert outside == []
    assert any(u.endswith("/page/files/main.js") for u in browser.requests)  # the recording saw the page's own


def test_plan_html_draws_the_same_bars_offline(browser, tmp_path):
    out = tmp_path / "plan.html"
    r = run_ctxq("plan", "--ctx", "65536", "--gpus", "16,16,16,8,8", "--cpu-memory", "32", "--html", str(out))
    assert r.returncode == 0, r.stderr
    want = plan_json("--gpus", "16,16,16,8,8", "--cpu-memory", "32", ctx=65536)
    page = browser.new_page()
    seen = []
    page.on("request", lambda q: seen.append(q.url))
    page.goto(out.as_uri())
    page.wait_for_selector(".device")
    assert_bars_are(bars(page), want)
    assert [urlparse(u).scheme for u in seen] == ["file"]  # the file alone: nothing else was fetched
    page.close()
