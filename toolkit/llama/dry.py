"""llama.cpp's dry runs on the plan's path, in a process of their own: an abort there is an error here.

A metadata-only load (`measure(..., dry_run=True)`) runs llama.cpp's loader and context creation, which check
their assumptions with GGML_ASSERT: a header they were not written for (a Gemma 4 whose
`attention.shared_kv_layers` leaves fewer than two layers with a KV cache, llama-model.cpp's KV-reuse callback)
aborts the process, with a gdb backtrace on stderr. ctxq's accounting (`accounting.py`) and compute dry runs of
derived models therefore run in one child (`python -m ctxq.llama.dry`), started on the first cache miss and kept
for the rest of the process (a Python start with llama.cpp's import is 0.3-0.5 s; a cold plan asks about ten
questions). Jobs go as JSON lines on its stdin, answers come back on its stdout; its stderr is an unlinked file
holding llama.cpp's log of the current job, so that when it dies the parent reads llama.cpp's last message and
raises `LlamaAborted` (one line), and nothing is left on disk. The next question starts a new child.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .. import children, interrupts
from ..errors import CtxqError, LlamaAborted

log = logging.getLogger(__name__)

_TIMEOUT_S = 300.0  # a dry run takes milliseconds to a second (NOTES: a 70B header at 64k in 0.7 s)
# ggml_abort's message ("<file>:<line>: GGML_ASSERT(...) failed"), an uncaught C++ exception's what()
_ABORT_RE = re.compile(r"GGML_ASSERT|GGML_ABORT|: error|what\(\):|terminate called|fatal", re.I)


def abort_reason(lines: list[str], rc: int) -> str:
    """llama.cpp's last message before the process died: its abort line (the source path cut to the file's
    name), else its last log line, else the signal."""
    lines = [ln.strip() for ln in lines if ln.strip()]
    hit = next((ln for ln in reversed(lines) if _ABORT_RE.search(ln)), None) or (lines[-1] if lines else "")
    hit = re.sub(r"^\S*/([^/\s]+:\d+:)", r"\1", hit.replace("what():", "").strip())[:300]
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else f"signal {-rc}"
        return f"{hit} ({name})" if hit else f"llama.cpp died with {name}"
    return hit or f"exit status {rc}"


class _Child:
    """The dry-run process and the read end of its log file."""

    def __init__(self):
        fd, name = tempfile.mkstemp(prefix="ctxq-dry-", suffix=".log")
        try:
            err = os.open(name, os.O_WRONLY | os.O_APPEND)  # the child truncates it per job: append writes at 0
            self.log = open(name, "rb")  # an offset of its own
        finally:
            os.unlink(name)  # held open by both sides only: nothing is left behind, whatever happens
            os.close(fd)
        env = dict(os.environ, GGML_NO_BACKTRACE="1")  # ggml_print_backtrace would run gdb on the child
        try:
            # the lifeline, not PR_SET_PDEATHSIG: the child outlives a load thread that started it (ctxq.children)
            self.proc = subprocess.Popen([sys.executable, "-m", "ctxq.llama.dry"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                         **children.lifeline(env))
        finally:
            os.close(err)
        self.owner = os.getpid()

    def ask(self, job: dict, timeout: float) -> dict | None:
        """The child's answer; None when it died, or ran past `timeout` (then it is killed: `self.timed_out`)."""
        self.timed_out = False
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        if not interrupts.readable(self.proc.stdout.fileno(), timeout):  # a stop signal ends the wait (issue 56)
            self.timed_out = True
            self.proc.kill()
            return None
        line = self.proc.stdout.readline()  # empty at EOF: it died
        return json.loads(line) if line else None

    def tail(self) -> list[str]:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace").splitlines()[-40:]

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # it ends at EOF
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        rc = self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            try:
                f.close()
            except OSError:
                pass
        return rc


_lock = threading.Lock()
_child: _Child | None = None


def _stop() -> None:
    global _child
    if _child is not None and _child.owner == os.getpid():
        _child.close()
    _child = None


atexit.register(_stop)


def dry_measure(path: str, *, timeout: float = _TIMEOUT_S, **kw):
    """`measure(path, dry_run=True, **kw)` in the dry-run process: a `Measurement` (its log lines, the allocations
    read from them, llama_model_size). CtxqError when llama.cpp refuses the model or the context (with `reason`
    where the loader gave one); LlamaAborted when llama.cpp aborted."""
    global _child
    from .backend import parse_allocations
    from .measure import Measurement

    job = {"path": str(path), "kw": {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}}
    with _lock:
        if _child is None or _child.owner != os.getpid():  # a forked process does not share its parent's child
            _child = _Child()
        got = _child.ask(job, timeout)
        if got is None:
            timed_out, rc, lines = _child.timed_out, _child.proc.wait(), _child.tail()
            _child.close()
            _child = None
            if timed_out:
                raise CtxqError(f"llama.cpp's dry run of {Path(path).name} took over {timeout:.0f} s")
            reason = abort_reason(lines, rc)
            raise LlamaAborted(f"llama.cpp aborted on this {_arch(path)} model ({Path(path).name}): {reason}",
                               reason=reason, path=str(path))
    if "error" in got:
        e = CtxqError(got["error"])
        if got.get("reason") is not None:
            e.reason = got["reason"]
        raise e
    return Measurement(parse_allocations(got["log"]), got["log"], got["model_bytes"])


def _arch(path: str) -> str:
    try:
        from ..gguf.reader import read_gguf

        return str(read_gguf(str(path), skip_arrays=True).arch)
    except Exception:  # a message about a file llama.cpp could not take: any reader error leaves a plain word
        return "GGUF"


def _main() -> int:
    """The child: one JSON job a line on stdin, one JSON answer a line on stdout, llama.cpp's log on stderr."""
    import resource

    from ..children import watch_parent
    from .measure import measure

    watch_parent()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort leaves no core file behind
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    llama = logging.getLogger("ctxq.llama_cpp")
    llama.addHandler(handler)
    llama.setLevel(logging.DEBUG)
    llama.propagate = False
    for line in sys.stdin:
        job = json.loads(line)
        os.ftruncate(2, 0)  # the parent reads this job's log alone
        kw = dict(job["kw"])
        if "cpu_patterns" in kw:
            kw["cpu_patterns"] = tuple(kw["cpu_patterns"])
        try:
            m = measure(job["path"], dry_run=True, **kw)
            reply = {"log": m.log, "model_bytes": m.model_bytes}
        except CtxqError as e:
            reply = {"error": str(e), "reason": getattr(e, "reason", None)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
