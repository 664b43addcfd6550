"""docs/page.png: `ctxq serve`'s page (issue 62) with the default model on two simulated cards, a short document
read and one question answered, in Debian's Chromium (as tests/test_page.py drives it).

    .venv/bin/python scripts/page_screenshot.py docs/page.png
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WORDS = "the of and to in is was for on that with as by at from which river library window garden morning".split()


def wait_until(page, expression: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not page.evaluate(f"() => Boolean({expression})"):  # evaluate: the page's CSP forbids eval
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {seconds} s: {expression}")
        time.sleep(0.2)


def main(out: str) -> None:
    rng = random.Random(7)
    sents = [" ".join(rng.choice(WORDS) for _ in range(11)).capitalize() + "." for _ in range(8)]
    sents.insert(4, "Ada keeps her bicycle in Oslo.")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctxq = Path(sys.executable).with_name("ctxq")
    server = subprocess.Popen([str(ctxq), "serve", "-c", "4096", "--simulate", "0.3,0.2", "--parallel", "2",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=ARGS)
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.goto(base + "/")
            page.wait_for_selector(".device")
            page.get_by_label("Document text").fill(" ".join(sents))
            page.get_by_role("button", name="Read").click()
            wait_until(page, "document.getElementById('read-status').dataset.state === 'read'", 600)
            page.get_by_label("Answer length").fill("24")
            page.get_by_label("Question", exact=True).fill("Where does Ada keep her bicycle?")
            page.get_by_role("button", name="Ask").click()
            wait_until(page, "document.querySelector('#answers .stats')?.dataset.ttft !== undefined", 600)
            page.screenshot(path=out, full_page=True)
            browser.close()
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/page.png")
