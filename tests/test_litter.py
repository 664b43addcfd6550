"""What a killed ctxq leaves behind, and who removes it: temporaries carry their writer's pid
(`ctxq.tempfiles`), the next conversion into the folder removes the stale ones, and a live
process's temporary is never touched. Real processes throughout: `kill -9` of the real `ctxq
convert` command, live and finished processes for the pid checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctxq import tempfiles
from ctxq.conversion.convert import verify_loads
from ctxq.gguf.reader import read_gguf


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_names_carry_pid_host_and_what(tmp_path):
    dest = tmp_path / "m.gguf"
    path = tempfiles.create(dest, "f16")
    assert path.name == f".m.gguf.ctxq-{os.getpid()}-{tempfiles.host_tag()}.f16.part" and path.is_file()
    again = tempfiles.create(dest, "f16")  # a second one of this process does not collide
    assert again != path and again.name.endswith(".f16-2.part")
    assert tempfiles.parse(path) == {"dest": "m.gguf", "pid": os.getpid(), "host": tempfiles.host_tag(), "what": "f16"}
    assert tempfiles.parse(tmp_path / ".m.gguf.part") is None and tempfiles.parse("m.gguf") is None


def test_only_stale_temporaries_are_swept(tmp_path):
    dest = tmp_path / "m.gguf"
    mine = tempfiles.create(dest, "gguf")  # this test's own process is alive: kept
    dead = tempfiles.temp_path(dest, "f16", pid=_dead_pid())
    dead.write_bytes(b"x" * 5000)
    with subprocess.Popen(["sleep", "60"]) as later:  # a live pid that started after the file was last written
        reused = tempfiles.temp_path(dest, "quantize", pid=later.pid)
        reused.write_bytes(b"y")
        old = time.time() - 3600
        os.utime(reused, (old, old))
        live = tempfiles.temp_path(dest, "copy", pid=later.pid)
        live.write_bytes(b"z")  # written while that process runs: it may be its writer
        other_host = dest.with_name(f".m.gguf.ctxq-{_dead_pid()}-elsewhere.gguf.part")
        other_host.write_bytes(b"w")  # another machine's (a shared folder): its pid means nothing here
        removed = dict(tempfiles.sweep(tmp_path))
        later.kill()
    assert set(removed) == {dead, reused} and removed[dead] > 0
    assert mine.exists() and live.exists() and other_host.exists() and not dead.exists() and not reused.exists()


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    from ctxq.testing.models import rebuild_smollm2_hf

    return rebuild_smollm2_hf()


def _wait_for(pred, proc, what: str, timeout: float = 240):
    deadline = time.time() + timeout
    while not pred():
        assert proc.poll() is None, f"ctxq exited before {what}: {proc.communicate()}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


_BUILDER = """
import os, sys, time
from pathlib import Path
from ctxq import tempfiles
dest = Path(sys.argv[1])
with tempfiles.building(dest):
    if not dest.exists():
        with open(dest.with_suffix(".builds"), "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.0)
        part = tempfiles.create(dest, "txt")
        part.write_text(str(os.getpid()))
        os.replace(part, dest)
print(dest.read_text())
"""


def test_two_processes_building_one_cache_file_build_it_once(tmp_path):
    """`tempfiles.building`: the second process waits for the first and takes its file (the suite's workers, and two
    `ctxq convert fit` runs, share ctxq's cache)."""
    dest = tmp_path / "cache" / "table.json"
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(dest)], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    builders = dest.with_suffix(".builds").read_text().split()
    assert len(builders) == 1 and outs == [builders[0]] * 3
    assert not tempfiles.temporaries(dest.parent)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["table.builds", "table.json"]  # the lock removed


def test_a_sweep_removes_a_build_lock_only_when_no_process_holds_it(tmp_path):
    dest = tmp_path / "table.json"
    lock = tmp_path / ".table.json.ctxq.lock"
    with tempfiles.building(dest):
        assert lock.is_file()
        tempfiles.sweep(tmp_path)
        assert lock.is_file()  # held: kept
    assert not lock.exists()
    lock.touch()  # what a holder killed with SIGKILL leaves
    tempfiles.sweep(tmp_path)
    assert not lock.exists()


@pytest.mark.slow
def test_kill_9_mid_conversion_then_the_next_conversion_sweeps(smollm2_hf, tmp_path):
    """`ctxq convert HF Q4_K_M -o out.gguf` killed with SIGKILL while quantizing leaves its f16
    intermediate and the quantizer's partial output, named with its pid; nothing at out.gguf. The next
    conversion into the folder removes both and writes its own output."""
    from .test_convert import make_tiny

    out_dir = tmp_path / "out"
    out = out_dir / "out.gguf"
    env = {**os.environ, "CTXQ_HOME": str(tmp_path / "home")}
    exe = Path(sys.executable).with_name("ctxq")
    proc = subprocess.Popen([str(exe), "convert", str(smollm2_hf), "Q4_K_M", "-o", str(out), "--no-check"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    quantizing = lambda: any(p.name.endswith(".quantize.part") and p.stat().st_size > 1 << 20  # noqa: E731
                             for p in out_dir.glob(".*"))
    _wait_for(quantizing, proc, "the quantizer to write")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    left = sorted(p.name for p in out_dir.iterdir())
    assert not out.exists()
    assert left == [f".out.gguf.ctxq-{proc.pid}-{tempfiles.host_tag()}.f16.part",
                    f".out.gguf.ctxq-{proc.pid}-{tempfiles.host_tag()}.quantize.part"], left
    assert sum((out_dir / n).stat().st_size for n in left) > 200 << 20  # the f16 alone is 258 MiB

    tiny = make_tiny(tmp_path / "tiny", "llama")
    rc = subprocess.run([str(exe), "convert", str(tiny), "f16", "-o", str(out_dir / "tiny.gguf")], env=env,
                        capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == ["tiny.gguf"]  # the killed run's temporaries are gone
    assert read_gguf(out_dir / "tiny.gguf", skip_arrays=True).arch == "llama"
    verify_loads(out_dir / "tiny.gguf")  # llama.cpp loads it: header, vocabulary, every tensor's bounds


@pytest.mark.slow
def test_kill_9_while_writing_the_f16(smollm2_hf, tmp_path):
    """Killed earlier, while the f16 intermediate is still being written: the rerun of the same
    command removes it and completes."""
    out = tmp_path / "s.gguf"
    env = {**os.environ, "CTXQ_HOME": str(tmp_path / "home")}
    exe = Path(sys.executable).with_name("ctxq")
    args = [str(exe), "convert", str(smollm2_hf), "q8_0", "-o", str(out)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writing = lambda: any(p.name.endswith(".gguf.part") and p.stat().st_size > 8 << 20  # noqa: E731
                          for p in tmp_path.glob(".*"))
    _wait_for(writing, proc, "the output to be written")
    proc.kill()
    proc.communicate()
    [left] = list(tmp_path.glob(".s.gguf.*"))
    assert tempfiles.parse(left)["pid"] == proc.pid and not out.exists()
    rc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr
    # (home: this test's CTXQ_HOME, where ctxq convert records what s.gguf was made from)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "s.gguf"]
    assert read_gguf(out, skip_arrays=True).get("general.file_type") == 7  # LLAMA_FTYPE_MOSTLY_Q8_0


def test_hf_route_keeps_one_reference_per_checkpoint(tmp_path, monkeypatch):
    """The quality gate's reference on the Hugging Face route is the f16 temporary, a new path every
    run: its logits are kept under the checkpoint's identity, so reruns add no new file."""
    from ctxq import convert

    from .test_convert import make_tiny

    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))
    tiny = make_tiny(tmp_path / "tiny", "llama")
    for _ in range(2):
        r = convert(tiny, "q4_k_m", tmp_path / "t.gguf", force=True)
        assert r.quality["n_tokens"] >= 128 and not r.cached
    assert len(list((tmp_path / "home" / "cache" / "reference-logits").glob("*.npy"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "t.gguf", "tiny"]
