"""`make setup` installs what `ctxq serve` needs (issue 29 part 7): scripts/setup.sh, run as `make setup`
runs it (no EXTRAS), into a fresh venv, with the llama-cpp-python wheel this checkout's setup cached. Before,
`make demo` and then `ctxq serve` failed with "No module named 'fastapi'"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_package import llama_cpp_wheel

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_plain_setup_installs_the_server_extra(tmp_path):
    if llama_cpp_wheel() is None:
        pytest.skip("this venv was not made by scripts/setup.sh (no cached llama-cpp-python wheel to reuse)")
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("EXTRAS", "VIRTUAL_ENV")}
    env.update(VENV=str(venv), PYTHON=getattr(sys, "_base_executable", sys.executable))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    # The wheel came from the cache: a rebuild would say so (and take minutes).
    assert "building llama-cpp-python" not in p.stdout
    # What `ctxq serve` imports, and its --help from the console script of that venv.
    check = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import fastapi, uvicorn, sse_starlette, starlette_context, pydantic_settings, jsonschema;"
                            "import llama_cpp.server.app; import ctxq.serve.server; print('ok')"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert check.stdout.strip() == "ok", check.stderr[-2000:]
    # The test extra was not asked for, so it is not there: the server extra came on its own.
    no_test = subprocess.run([str(venv / "bin" / "python"), "-c", "import hypothesis"], capture_output=True)
    assert no_test.returncode != 0
    serve = subprocess.run([str(venv / "bin" / "ctxq"), "serve", "--help"], capture_output=True, text=True)
    assert serve.returncode == 0 and "--ctx" in serve.stdout, serve.stderr
