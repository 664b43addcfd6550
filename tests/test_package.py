"""ctxq as users install it (issue 23): the sdist and the wheel built from this checkout, installed into
a fresh virtual environment outside it with the project's llama-cpp-python wheel, then every command
run from another folder. The other tests import the editable checkout, so only this one sees what the
package really ships (a forgotten subpackage made `inspect`, `plan` and `run` fail on import)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> source folder, as setup.py maps them
SOURCES = {"ctxq": ROOT / "toolkit", "ctxq/converters": ROOT / "converters", "ctxq/profiles": ROOT / "profiles"}

pytestmark = pytest.mark.slow
SHIPPED = (".py", ".toml", ".html", ".css", ".js")  # modules, profiles, the page of `ctxq serve`


def _run(cmd, *, cwd, env=None, timeout=300, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p


def setup_cache() -> Path:
    """Where scripts/setup.sh keeps built wheels (wheels/<key>/) and the CUDA toolkit (cuda/): not CTXQ_HOME."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ctxq"


def llama_cpp_wheel() -> Path | None:
    """The llama-cpp-python wheel scripts/setup.sh installed into this venv (its cache key is stamped there)."""
    stamp = Path(sys.prefix) / ".llama-cpp-key"
    if not stamp.is_file():
        return None
    wheels = sorted((setup_cache() / "wheels" / stamp.read_text().strip()).glob("llama_cpp_python-*.whl"))
    return wheels[0] if wheels else None


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The sdist from setuptools' own build hook, then the wheel built from that sdist (as `python -m
    build` does), so a file the sdist forgets is missing from the wheel too."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(out)!r})"], cwd=ROOT)
    sdist = next(out.glob("ctxq-*.tar.gz"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, sdist], cwd=out)
    return {"sdist": sdist, "wheel": next(out.glob("ctxq-*.whl"))}


def test_wheel_holds_every_module_and_data_file(dist):
    names = set(zipfile.ZipFile(dist["wheel"]).namelist())
    want = {f"{pkg}/{f.relative_to(src)}" for pkg, src in SOURCES.items()
            for f in src.rglob("*") if f.suffix in SHIPPED and "__pycache__" not in f.parts}
    assert want, "no sources found"
    assert not want - names, f"missing from the wheel: {sorted(want - names)}"
    assert "ctxq/py.typed" in names and "ctxq/hub/__init__.py" in names
    # the page of `ctxq serve` (issue 62): package data, no build step
    assert {f"ctxq/serve/page/{n}" for n in ("index.html", "page.css", "main.js", "api.js", "plan.js")} <= names
    assert not {n for n in names if n.startswith(("toolkit/", "tests/", "converters/"))}, "a folder under its own name"
    with tarfile.open(dist["sdist"]) as t:
        members = {m.split("/", 1)[1] for m in t.getnames() if "/" in m}
    assert {"setup.py", "pyproject.toml", "README.md", "toolkit/py.typed", "profiles/2x24.toml"} <= members


def user_venv(base: Path, packages: list, model: Path) -> dict:
    """A fresh venv under `base` (outside the checkout) with `packages` installed; an empty ctxq home
    holding only the default model; a working folder that is not the checkout."""
    venv = base / "venv"
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", venv], cwd=base)
    py = venv / "bin" / "python"
    # pip's cache serves the dependencies already downloaded for .venv
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages], cwd=base, timeout=600)
    home = base / "ctxq-home"
    (home / "models").mkdir(parents=True)
    (home / "models" / model.name).symlink_to(model)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CTXQ_DEBUG")}
    env.update(CTXQ_HOME=str(home), HF_HUB_OFFLINE="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    work = base / "elsewhere"
    work.mkdir()
    return {"py": py, "ctxq": venv / "bin" / "ctxq", "env": env, "cwd": work, "venv": venv, "model": model}


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory, smollm2) -> dict:
    """The built wheel with its server extra and this venv's llama-cpp-python wheel, in a fresh venv."""
    wheel = llama_cpp_wheel()
    if wheel is None:
        pytest.skip("no cached llama-cpp-python wheel for this venv: run `make setup-test`")
    return user_venv(tmp_path_factory.mktemp("user"), [f"{dist['wheel']}[server]", wheel], smollm2)


def ctxq(inst, *args, **kw) -> subprocess.CompletedProcess:
    return _run([inst["ctxq"], *args], cwd=inst["cwd"], env=inst["env"], **kw)


def test_the_installed_package_is_the_one_imported(installed):
    p = _run([installed["py"], "-c", "import ctxq, ctxq.hub; print(ctxq.__file__)"],
             cwd=installed["cwd"], env=installed["env"])
    assert Path(p.stdout.strip()).is_relative_to(installed["venv"]), p.stdout


def test_commands_from_another_folder(installed):
    assert ctxq(installed, "--version").stdout.strip().endswith("0.1.0")
    doctor = ctxq(installed, "doctor").stdout
    assert "RPC yes" in doctor and "CPU" in doctor
    assert "layers         30" in ctxq(installed, "inspect", installed["model"]).stdout
    plan = ctxq(installed, "plan", "--ctx", "4096").stdout
    assert "-c 4096" in plan and "llama.cpp flags" in plan
    cache = ctxq(installed, "cache").stdout
    assert str(installed["env"]["CTXQ_HOME"]) in cache
    assert re.search(r"^models\s+\S+ MiB\s+1\s", cache, re.M), cache  # the default model, nothing else
    run = ctxq(installed, "run", "--ctx", "512", "-n", "6", "--temp", "0", "-p", "The capital of France is")
    assert re.search(r"generated [1-6] tokens", run.stderr), run.stderr
    assert run.stdout.strip(), "no text generated"


def test_library_from_another_folder(installed):
    code = ("import ctxq, json\n"
            "p = ctxq.plan(n_ctx=2048)\n"
            "llm = ctxq.load(n_ctx=2048)\n"
            "out = llm.create_completion('The capital of France is', max_tokens=4, temperature=0)\n"
            "print(json.dumps({'n_ctx': p.n_ctx, 'llm_ctx': llm.n_ctx(), 'text': out['choices'][0]['text']}))\n")
    p = _run([installed["py"], "-c", code], cwd=installed["cwd"], env=installed["env"])
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["n_ctx"] == 2048 and r["llm_ctx"] == 2048 and r["text"].strip(), r


def test_serve_answers_health(installed):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = installed["cwd"] / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([installed["ctxq"], "serve", "--ctx", "1024", "--port", str(port)],
                                cwd=installed["cwd"], env=installed["env"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"ctxq serve exited {proc.returncode}: {log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no /health within 90 s: {log.read_text()[-2000:]}"
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(30)
