"""`ctxq cache`, `ctxq cache clean` and `ctxq cache rm` through the real console script, on a
private CTXQ_HOME holding one file of each part, a stale temporary and a live process's one."""

from __future__ import annotations

import os
import subprocess

import pytest

from ctxq import tempfiles

from .conftest import run_ctxq

MIB = 1 << 20


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    files = {"models/tiny-Q4_K_M.gguf": 3 * MIB, "derived/abc.gguf": MIB, "hfplan/def-f16.gguf": MIB,
             "cache/quantize/rec.json": 100, "cache/reference-logits/l.npy": 2 * MIB, "cache/digests/d.json": 50}
    for rel, size in files.items():
        (h / rel).parent.mkdir(parents=True, exist_ok=True)
        (h / rel).write_bytes(b"\1" * size)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tempfiles.temp_path(h / "models" / "big.gguf", "f16", pid=dead.pid)  # a killed conversion's
    stale.write_bytes(b"\1" * 5 * MIB)
    live = tempfiles.temp_path(h / "derived" / "x.gguf", "header")  # this test process is alive
    live.write_bytes(b"\1" * MIB)
    return h, stale, live


def ctxq(home, *args):
    rc = run_ctxq(*args, env={"CTXQ_HOME": str(home)})
    assert "Traceback" not in rc.stderr
    return rc


def test_listing_shows_parts_models_and_temporaries(home):
    h, stale, live = home
    rc = ctxq(h, "cache")
    assert rc.returncode == 0, rc.stderr
    rows: dict = {}
    for ln in rc.stdout.splitlines():
        if ln.split():
            rows.setdefault(ln.split()[0], ln.split())
    assert rows["models"][1:4] == ["3.0", "MiB", "1"]  # temporaries are not counted in their part
    assert rows["derived"][1:4] == ["1.0", "MiB", "1"] and rows["logits"][1:4] == ["2.0", "MiB", "1"]
    assert rows["tiny-Q4_K_M.gguf"][1:] == ["3.0", "MiB"]  # each model on its own line
    assert "temporaries: 1 stale (5.0 MiB), 1 of running" in rc.stdout


def test_clean_removes_stale_temporaries_only(home):
    h, stale, live = home
    rc = ctxq(h, "cache", "clean", "--dry-run")
    assert rc.returncode == 0 and f"would remove {stale}" in rc.stdout and stale.exists()
    rc = ctxq(h, "cache", "clean")
    assert rc.returncode == 0 and rc.stdout.strip().splitlines()[-1] == "removed 1 files, 5.0 MiB"
    assert not stale.exists() and live.exists()  # a running process's temporary stays
    assert (h / "derived" / "abc.gguf").exists() and (h / "models" / "tiny-Q4_K_M.gguf").exists()


def test_clean_named_parts_and_all_keep_models(home):
    h, stale, live = home
    rc = ctxq(h, "cache", "clean", "derived", "logits")
    assert rc.returncode == 0, rc.stderr
    assert not (h / "derived" / "abc.gguf").exists() and not (h / "cache" / "reference-logits" / "l.npy").exists()
    assert (h / "hfplan" / "def-f16.gguf").exists() and live.exists() and not stale.exists()
    rc = ctxq(h, "cache", "clean", "--all")
    assert rc.returncode == 0, rc.stderr
    left = sorted(str(p.relative_to(h)) for p in h.rglob("*") if p.is_file())
    assert left == ["derived/" + live.name, "models/tiny-Q4_K_M.gguf"]
    rc = ctxq(h, "cache", "clean", "models")  # models are not a part to clear
    assert rc.returncode == 2 and "Invalid value" in rc.stderr


def test_rm_removes_a_model_by_name(home):
    h, _, _ = home
    rc = ctxq(h, "cache", "rm", "tiny-Q4_K_M.gguf", "not-there.gguf")
    assert rc.returncode == 1 and rc.stderr.startswith("Error: not-there.gguf: no such model")
    assert len(rc.stderr.strip().splitlines()) == 1
    assert (h / "models" / "tiny-Q4_K_M.gguf").exists()  # nothing removed when one name is wrong
    rc = ctxq(h, "cache", "rm", "tiny-Q4_K_M.gguf")
    assert rc.returncode == 0 and "removed" in rc.stdout and not (h / "models" / "tiny-Q4_K_M.gguf").exists()
    rc = ctxq(h, "cache", "rm", "../derived/abc.gguf")
    assert rc.returncode == 1 and (h / "derived" / "abc.gguf").exists()


def test_a_killed_writers_header_is_cleaned(tmp_path):
    """The header-only writer (planner caches) uses the same names: a killed one's is stale."""
    from ctxq.gguf.writer import write_sparse_gguf

    h = tmp_path / "home"
    code = ("import os, sys\nfrom ctxq.gguf.writer import write_sparse_gguf\n"
            "def meta(w):\n    os.kill(os.getpid(), 9)  # killed while writing\n"
            f"write_sparse_gguf({str(h / 'derived' / 'k.gguf')!r}, 'llama', [], meta)\n")
    done = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9
    [left] = list((h / "derived").iterdir())
    assert tempfiles.parse(left)["what"] == "header" and tempfiles.is_stale(left)
    assert ctxq(h, "cache", "clean").returncode == 0 and list((h / "derived").iterdir()) == []
    assert write_sparse_gguf(h / "derived" / "k.gguf", "llama", [], lambda w: None).is_file()
