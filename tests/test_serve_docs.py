"""docs/serve.md's structured-output example, run as written with the official `openai` client
against `ctxq serve` and the embedded model (only the address and key are the test server's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_serve import KEY, serving

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serve.md"
CONTRACT = """SERVICE AGREEMENT

This Service Agreement is made between Acme Corporation, a Delaware company, and Globex Limited,
a company registered in England. It was signed on 2024-03-15.

1. Services. Globex Limited shall provide software maintenance to Acme Corporation.
2. Fees. Acme Corporation shall pay the fees listed in Schedule A within thirty days of invoice.
3. Term. This agreement runs for two years from the date of signature.
""" + "\n".join(f"{n}. Clause {n}. The parties agree to act in good faith in all matters under this agreement."
                for n in range(4, 40)) + """

40. Governing law. This agreement is governed by the laws of England and Wales.
"""


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    (code,) = [b for b in blocks if "from openai import OpenAI" in b]
    return code


def test_docs_example_runs_with_the_openai_client(smollm2, tmp_path):
    code = example()
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and 'api_key="KEY"' in code
    with serving(smollm2, tmp_path / "serve.log", "-c", "4096", "--api-key", KEY, "--seed", "1") as (base, _):
        script = code.replace("http://127.0.0.1:8000/v1", base + "/v1").replace('api_key="KEY"', f'api_key="{KEY}"')
        (tmp_path / "contract.txt").write_text(CONTRACT)
        (tmp_path / "example.py").write_text(script)
        run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = run.stdout.strip().splitlines()[-1]
    assert re.search(r"\d{4}-\d{2}-\d{2}", line), line  # signed_on, a date by the schema's format
    assert line.startswith("["), line  # parties, a list
