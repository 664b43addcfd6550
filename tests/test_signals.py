"""A stop signal is a stop (issue 47): SIGTERM and SIGHUP end a one-shot command as Ctrl-C does, every child ctxq
starts ends with it, and a file given as text is refused from its first block when it is not text.

Real processes throughout: the `ctxq` console script, its real children (the quantizer's and the quality measurement's
workers, the dry runs, RPC workers). Each command is stopped at a named stage (`ctxq.stages`: the process at the
stage says so on a FIFO and waits), never after a sleep; the children are the command's descendants seen at that
moment. Bytes read from a text are counted on the writing side of a FIFO: a writer cannot get further ahead of the
reader than the pipe holds.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from ctxq import tempfiles
from ctxq.textfile import BLOCK, NotText, TextFile, byte_limit, check_text

from .conftest import ctxq_exe

TEXT = ("The licensee may copy and distribute the work, in any medium, provided that each copy carries this notice. "
        "Nothing here grants the right to use the names of the authors. ") * 12  # about 600 tokens


# --- helpers ---------------------------------------------------------------------------------------------------

class Stopped:
    """A `ctxq` command held at a stage: its process, the paused process's pid, and its descendants then."""

    def __init__(self, proc: subprocess.Popen, paused: int, descendants: list[psutil.Process]):
        self.proc, self.paused, self.descendants = proc, paused, descendants

    def signal(self, sig: int) -> tuple[int, str]:
        if sig != signal.SIGKILL:  # an ignored signal cannot stop it: say so now, not after the bound below
            assert sig not in ignored_signals(self.proc.pid), f"signal {sig} is ignored in ctxq (started under nohup?)"
        self.proc.send_signal(sig)
        try:  # a command that does not end on a stop signal fails here instead of holding the suite
            _, err = self.proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            where = waits(self.proc.pid)
            self.proc.kill()
            _, err = self.proc.communicate()
            pytest.fail(f"ctxq did not end within 300 s of signal {sig}; {where}; {err[-2000:]}")
        return self.proc.returncode, err


def ignored_signals(pid: int) -> set[int]:
    """The signals process `pid` ignores (SigIgn in /proc/PID/status, a mask with bit n-1 for signal n)."""
    mask = int(next(ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if ln.startswith("SigIgn:")), 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def waits(pid: int) -> str:
    """Where each thread of `pid` and of its descendants sleeps in the kernel (wchan), for a hang's failure."""
    out = []
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            tasks = sorted(Path(f"/proc/{p.pid}/task").iterdir())
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}: " + ", ".join(
                f"{t.name} {(t / 'comm').read_text().strip()} {(t / 'wchan').read_text()}" for t in tasks))
        except (OSError, psutil.Error) as e:
            out.append(f"{p.pid}: {e}")
    return "; ".join(out)


def at_stage(tmp_path: Path, stage: str, *args: str, env: dict | None = None, preexec_fn=None) -> Stopped:
    """Start `ctxq ARGS` and wait until a process of it reaches `stage` (`ctxq.stages`)."""
    fifo = tmp_path / f"stage-{stage}"
    os.mkfifo(fifo)
    full = {**os.environ, **(env or {}), "CTXQ_TEST_STAGE": f"{stage}:{fifo}"}
    full.pop("CTXQ_DEBUG", None)
    proc = subprocess.Popen([ctxq_exe(), *args], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=preexec_fn)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    while reader.is_alive():
        reader.join(0.2)
        if reader.is_alive() and proc.poll() is not None:
            with open(fifo, "w"):  # lets the reader go
                pass
            reader.join()
            out, err = proc.communicate()
            pytest.fail(f"ctxq exited with {proc.returncode} before stage {stage}: {err[-2000:]}")
    name, pid = got[0].split()
    assert name == stage
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert int(pid) == proc.pid or int(pid) in [d.pid for d in descendants]
    return Stopped(proc, int(pid), descendants)


def stopped_line(err: str, name: str) -> None:
    """One line on stderr says the command was stopped by `name`, and it is the last; no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].strip() == f"Stopped ({name}).", err[-2000:]
    assert sum("Stopped" in ln for ln in lines) == 1 and "Traceback" not in err, err[-2000:]


def none_running(procs: list[psutil.Process]) -> None:
    """Each process has ended and been waited for (is_running() is True for a zombie, and checks the pid's start
    time, so a reused pid does not count)."""
    assert procs, "the command had no children at the stage"
    left = [(p.pid, p.name()) for p in procs if p.is_running()]
    assert left == [], left


def wait_gone(procs: list[psutil.Process], guard_s: float = 120) -> list[psutil.Process]:
    """Wait until each process has ended (a zombie waiting for its new parent counts); those still running after
    `guard_s` (a bound only against a hang), which are then killed."""
    deadline = time.monotonic() + guard_s
    left = list(procs)
    while left and time.monotonic() < deadline:
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if left:
            time.sleep(0.05)
    for p in left:
        p.kill()
    return left


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def fifo_writer(path: Path, payload: bytes) -> dict:
    """Write `payload` into the FIFO `path` from a thread until the reader closes it; the result says how many bytes
    went in and the pipe's capacity (what can sit written but unread)."""
    os.mkfifo(path)
    out = {"written": 0}

    def write():
        fd = os.open(path, os.O_WRONLY)  # waits for the reader
        out["capacity"] = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        try:
            for i in range(0, len(payload), 4096):
                out["written"] += os.write(fd, payload[i:i + 4096])
        except BrokenPipeError:
            out["broken"] = True
        finally:
            os.close(fd)

    out["thread"] = threading.Thread(target=write, daemon=True)
    out["thread"].start()
    return out


def writer_done(w: dict, path: Path) -> None:
    """Wait for `fifo_writer`'s thread; one still waiting for a reader (ctxq never opened the FIFO) is let go."""
    w["thread"].join(0.5)
    if w["thread"].is_alive() and "capacity" not in w:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    w["thread"].join()


@pytest.fixture()
def home(tmp_path):
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A 2-layer, 64-wide llama with SmolLM2's tokenizer (F32, 27 MB): `convert fit` reaches its probes fast."""
    from ctxq.testing.models import tiny_chat_llama_gguf

    return tiny_chat_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf")


# --- SIGTERM at each stage -------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_stop_while_quantizing(smollm2, tmp_path, home, sig):
    """`ctxq convert` stopped while llama.cpp's quantizer writes (its worker held inside llama_model_quantize):
    exit 128 + the signal, one line, the quantizer's temporary gone from the destination's folder, nothing in the
    cache but finished records, the worker gone."""
    out = tmp_path / "out" / "x.gguf"
    held = at_stage(tmp_path, "quantize", "convert", str(smollm2), "q8_0", "-o", str(out), "--no-check",
                    env={"CTXQ_HOME": str(home)})
    assert [p.name for p in out.parent.iterdir()] == [tempfiles.temp_path(out, "quantize", held.proc.pid).name]
    assert any("quantize_worker" in " ".join(p.cmdline()) and p.pid == held.paused for p in held.descendants)
    rc, err = held.signal(sig)
    assert rc == 128 + sig
    stopped_line(err, signal.Signals(sig).name)
    assert list(out.parent.iterdir()) == []
    assert tempfiles.temporaries(home, recursive=True) == []
    none_running(held.descendants)


def test_stops_at_random_moments_under_load(smollm2):
    """Eight stops (SIGHUP and SIGTERM in turn) of `ctxq convert` at random moments beside a busy loop
    (scripts/stop_storm.py, whose 50-stop run is the issue's bar): each ends within 10 s with 128 + the signal (or,
    before ctxq's handler exists, by the signal itself with no child yet), with no temporary and no child left; and
    the draws reached the quantizer's worker, which a stop must take down with the command."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from stop_storm import storm

    rows = storm(stops=8, busy=1, seed=56, model=str(smollm2), report=lambda line: None)
    assert [(s.signal, s.moment_s, s.end_s, s.exit, s.leftovers) for sig, s in rows if not s.ok(sig)] == []
    assert any(s.had_children and s.exit == 128 + sig for sig, s in rows), [(s.moment_s, s.phase) for _, s in rows]


def test_sigterm_in_the_reference_pass(smollm2, tmp_path, home):
    """`ctxq quality` stopped while the reference's worker evaluates: no reference and no result in the cache, no
    temporary anywhere under ctxq's home, every child (the worker, the dry runs) gone, 143."""
    held = at_stage(tmp_path, "reference", "quality", str(smollm2), "--ctx", "256", "--kv", "q8_0",
                    env={"CTXQ_HOME": str(home)})
    assert any("ctxq.quality.worker" in " ".join(p.cmdline()) for p in held.descendants)
    rc, err = held.signal(signal.SIGTERM)
    assert rc == 143
    stopped_line(err, "SIGTERM")
    assert files_under(home / "quality") == []
    assert tempfiles.temporaries(home, recursive=True) == []
    none_running(held.descendants)


def test_sigterm_in_a_candidate_pass(smollm2, tmp_path, home):
    """Stopped in the candidate's pass: the finished reference stays (a result), the candidate leaves nothing."""
    held = at_stage(tmp_path, "candidate", "quality", str(smollm2), "--ctx", "256", "--kv", "q8_0",
                    env={"CTXQ_HOME": str(home)})
    rc, err = held.signal(signal.SIGTERM)
    assert rc == 143
    stopped_line(err, "SIGTERM")
    left = files_under(home / "quality")
    assert len(left) == 1 and left[0].startswith("ref-") and left[0].endswith(".npz"), left
    assert tempfiles.temporaries(home, recursive=True) == []
    none_running(held.descendants)


@pytest.mark.slow  # ~30 s: fit measures every type first
def test_sigterm_at_a_fit_probe(tiny_chat, tmp_path, home):
    """`ctxq convert MODEL fit` stopped with a probe file quantized in its work folder: the folder is gone, nothing
    at the destination, the fit cache holds only finished files, children gone."""
    out = tmp_path / "out" / "fit.gguf"
    held = at_stage(tmp_path, "fit-probe", "convert", str(tiny_chat), "fit", "--target-size", "10MiB",
                    "-o", str(out), env={"CTXQ_HOME": str(home)})
    [work] = tempfiles.temporaries(home / "fit", recursive=True)  # the work folder, with the probe in it
    assert (work / "probe.gguf").is_file()
    rc, err = held.signal(signal.SIGTERM)
    assert rc == 143
    stopped_line(err, "SIGTERM")
    assert not work.exists() and not out.exists()
    assert tempfiles.temporaries(home, recursive=True) == []
    assert all(n.startswith(("errors-", "text-")) for n in files_under(home / "fit")), files_under(home / "fit")
    none_running(held.descendants)


def test_sigterm_in_a_runs_prefill_on_local_workers(smollm2, tmp_path):
    """`ctxq run --simulate` stopped after its first prompt chunk: its RPC worker and dry-run child gone, 143."""
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    held = at_stage(tmp_path, "prefill", "run", str(smollm2), "-f", str(doc), "-p", "Summarize:", "--ctx", "1024",
                    "-b", "64", "-n", "4", "--simulate", "1")
    assert held.paused == held.proc.pid
    assert any("ctxq.rpc" in " ".join(p.cmdline()) for p in held.descendants)
    rc, err = held.signal(signal.SIGTERM)
    assert rc == 143
    stopped_line(err, "SIGTERM")
    none_running(held.descendants)


def test_sigterm_in_the_split_referees_dry_run(smollm2, tmp_path, home):
    """`ctxq plan` on two described GPUs stopped in the split referee's dry run: its two loopback RPC workers and the
    dry-run process gone, no answer cached for the split, 143."""
    held = at_stage(tmp_path, "split-dry-run", "plan", str(smollm2), "--ctx", "4096", "--gpus", "1,1",
                    env={"CTXQ_HOME": str(home)})
    assert sum("ctxq.rpc" in " ".join(p.cmdline()) for p in held.descendants) == 2
    rc, err = held.signal(signal.SIGTERM)
    assert rc == 143
    stopped_line(err, "SIGTERM")
    assert files_under(home / "split") == []
    none_running(held.descendants)


def test_sighup_ignored_under_nohup_stays_ignored(smollm2, tmp_path):
    """A SIGHUP that was ignored when ctxq started (nohup) does not stop it; SIGTERM still does."""
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    held = at_stage(tmp_path, "prefill", "run", str(smollm2), "-f", str(doc), "-p", "Summarize:", "--ctx", "1024",
                    "-b", "64", "-n", "4", preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    held.proc.send_signal(signal.SIGHUP)
    # the kernel drops an ignored signal at once: the process is still there, still at its stage
    assert held.proc.poll() is None and psutil.Process(held.proc.pid).status() != psutil.STATUS_ZOMBIE
    rc, err = held.signal(signal.SIGTERM)
    assert rc == 143
    stopped_line(err, "SIGTERM")


# --- children die with their parent ----------------------------------------------------------------------------

def test_children_end_with_a_parent_killed_by_sigkill(smollm2, tmp_path, home):
    """`kill -9` of ctxq while its quality worker is held at a stage (so it never polls for anything): the worker
    and the dry-run process learn of it through their lifeline and end."""
    held = at_stage(tmp_path, "reference", "quality", str(smollm2), "--ctx", "256", "--kv", "q8_0",
                    env={"CTXQ_HOME": str(home)})
    assert len(held.descendants) >= 2  # the worker and the dry-run process
    held.signal(signal.SIGKILL)
    assert wait_gone(held.descendants) == []


SCRIPT = """
import os, sys, threading
from ctxq.llama import dry
model = sys.argv[1]
t = threading.Thread(target=lambda: dry.dry_measure(model, n_ctx=256, n_gpu_layers=0))
t.start(); t.join()  # the dry-run process was started by this thread, which has ended
first = dry._child.proc.pid
dry.dry_measure(model, n_ctx=512, n_gpu_layers=0)  # it still answers, from the main thread
assert dry._child.proc.pid == first
print(first, flush=True)
sys.stdin.read()  # held until the test kills this process
"""


def test_a_child_outlives_the_thread_that_started_it_not_the_process(smollm2, tmp_path):
    """The dry-run process started from a thread that then ends lives on and answers (PR_SET_PDEATHSIG, which
    follows the starting thread, would have killed it with that thread), and ends when its parent process is killed
    (its lifeline; here its stdin, which only the parent held, ends too)."""
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(smollm2)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CTXQ_HOME": str(tmp_path / "home")})
    line = proc.stdout.readline()
    assert line.strip().isdigit(), proc.communicate()[1][-2000:]
    child = psutil.Process(int(line))
    assert child.is_running() and child.ppid() == proc.pid
    proc.kill()
    proc.wait()
    assert wait_gone([child]) == []


LIFELINE = """
import subprocess, sys, threading
from ctxq import children
# the child says its pid on the shared stdout once it watches its lifeline, then waits on nothing its parent holds
child = [sys.executable, "-c", "from ctxq import children; children.watch_parent(); import os, threading; "
         "print(os.getpid(), flush=True); threading.Event().wait()"]
t = threading.Thread(target=lambda: subprocess.Popen(child, **children.lifeline()))
t.start(); t.join()  # started by a thread that has ended
sys.stdin.read()  # held until the test kills this process
"""


def test_the_lifeline_ends_a_child_whose_parent_is_killed(tmp_path):
    """A child that waits on nothing its parent holds (no pipe, no polling), started from a thread that has ended:
    alive while the parent lives; `kill -9` of the parent ends it, through the lifeline alone."""
    import sys

    proc = subprocess.Popen([sys.executable, "-c", LIFELINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip().isdigit(), proc.communicate()[1][-2000:]
    child = psutil.Process(int(line))
    assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE and child.ppid() == proc.pid
    proc.kill()
    proc.wait()
    assert wait_gone([child]) == []


# --- text inputs -----------------------------------------------------------------------------------------------

def test_not_text_is_named_from_the_first_block(tmp_path):
    for head, what in [(b"GGUF\x03\x00\x00\x00", "a GGUF model"), (b"%PDF-1.7\n", "a PDF document"),
                       (b"\x89PNG\r\n\x1a\n\x00\x00", "a PNG image"), (b"\xff\xd8\xff\xe0\x00\x10JFIF", "a JPEG image"),
                       (b"PK\x03\x04", "a ZIP archive"), (b"\xff\xfeh\x00i\x00", "UTF-16 text")]:
        with pytest.raises(NotText, match=f"looks like {what}") as e:
            check_text(head + b"more", "f", complete=True)
        assert e.value.looks_like.startswith(what)
    with pytest.raises(NotText, match="NUL byte at offset 5"):
        check_text(b"hello\x00world", "f", complete=True)
    with pytest.raises(NotText, match="byte 0xe9 at offset 3"):
        check_text("café".encode("latin-1"), "f", complete=True)
    euro = "price: €".encode()
    check_text(euro[:-1], "f", complete=False)  # a character cut by the block's end is text
    with pytest.raises(NotText):
        check_text(euro[:-1], "f", complete=True)  # ... but not at the file's end
    path = tmp_path / "t.txt"
    path.write_bytes(b"plain " * (BLOCK // 3) + "é".encode())
    text, whole = TextFile(path).text()
    assert whole and text.endswith("é")
    data, whole = TextFile(path).read(100)
    assert not whole and data == (b"plain " * 17)[:100]


@pytest.mark.parametrize("command", ["run", "quality"])
def test_a_binary_file_is_refused_after_its_first_block(smollm2, tmp_path, command):
    """A GGUF given as the text (-f): one line naming it, after reading no more than the first block; the rest of the
    8 MiB is never read (the FIFO's writer is stopped by the reader closing it)."""
    payload = smollm2.read_bytes()[:8 << 20]
    w = fifo_writer(tmp_path / "model-as-text", payload)
    args = ["run", str(smollm2), "-f", str(tmp_path / "model-as-text"), "-p", "hi", "--ctx", "1024"] \
        if command == "run" else ["quality", str(smollm2), "--ctx", "1024", "-f", str(tmp_path / "model-as-text")]
    r = subprocess.run([ctxq_exe(), *args], capture_output=True, text=True,
                       env={**os.environ, "CTXQ_HOME": str(tmp_path / "home")})
    writer_done(w, tmp_path / "model-as-text")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"Error: {tmp_path / 'model-as-text'} is not text: it looks like a GGUF "
                                             "model; give a UTF-8 text file"]
    assert w.get("broken") and w["written"] <= BLOCK + w["capacity"], w


def test_run_reads_a_long_text_only_as_far_as_the_context(smollm2, tmp_path):
    """A 16 MiB text for a 1,024-token context: refused as too long after at most the bytes 1,024 tokens of this
    vocabulary can hold (byte_limit), plus one."""
    limit = byte_limit(smollm2, 1024)
    assert BLOCK < limit < 1 << 20
    w = fifo_writer(tmp_path / "long", TEXT.encode() * ((16 << 20) // len(TEXT)))
    r = subprocess.run([ctxq_exe(), "run", str(smollm2), "-f", str(tmp_path / "long"), "-p", "hi", "--ctx", "1024"],
                       capture_output=True, text=True, env={**os.environ, "CTXQ_HOME": str(tmp_path / "home")})
    writer_done(w, tmp_path / "long")
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"Error: {tmp_path / 'long'} is longer than {limit:,} bytes") and "--ctx" in line, line
    assert w.get("broken") and w["written"] <= limit + 1 + w["capacity"], w


def test_a_text_within_the_limit_is_read_whole(smollm2, tmp_path):
    """The same text cut to fit runs as before: the input's tokens are the whole file's."""
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    r = subprocess.run([ctxq_exe(), "run", str(smollm2), "-f", str(doc), "-p", "hi", "--ctx", "1024", "--dry-run",
                        "--json"], capture_output=True, text=True,
                       env={**os.environ, "CTXQ_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    import json

    from ctxq.runtime.generate import input_tokens

    assert json.loads(r.stdout)["n_prompt"] == len(input_tokens(smollm2, "hi", document=TEXT)[0])


def test_quality_reads_a_long_text_only_as_far_as_its_tokens(smollm2, tmp_path):
    """`ctxq quality -f` on a 16 MiB text at --ctx 64 reads no more than its first 65 tokens' worth (and a block for
    the word the limit cuts), and measures what the whole text's first 64 tokens give: the same perplexity as a
    shorter file of the same text, read whole."""
    import json

    from ctxq.quality.measurement import _text_limit

    limit = _text_limit(str(smollm2), str(smollm2), 64)
    data = TEXT.encode() * ((16 << 20) // len(TEXT))
    short = tmp_path / "short.txt"
    short.write_bytes(data[:limit - 4096])  # under the limit: read whole
    w = fifo_writer(tmp_path / "long", data)
    env = {**os.environ, "CTXQ_HOME": str(tmp_path / "home")}
    args = ["quality", str(smollm2), "--ctx", "64", "--kv", "q8_0", "--json", "-f"]
    r = subprocess.run([ctxq_exe(), *args, str(tmp_path / "long")], capture_output=True, text=True, env=env)
    writer_done(w, tmp_path / "long")
    assert r.returncode == 0, r.stderr
    assert w.get("broken") and w["written"] <= limit + 1 + w["capacity"], w
    whole = subprocess.run([ctxq_exe(), *args, str(short)], capture_output=True, text=True, env=env)
    assert whole.returncode == 0, whole.stderr
    got, want = (json.loads(x.stdout)["results"][-1] for x in (r, whole))
    assert got["ppl"] == want["ppl"] and got["mean_kl"] == want["mean_kl"] and not got["cached"] and not want["cached"]
