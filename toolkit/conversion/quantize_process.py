"""The parent's side of the quantizer's child process (`ctxq.conversion.quantize_worker`).

`Worker` starts the child early (it loads llama.cpp while the caller prepares the job), sends it one
job, follows llama.cpp's `[ i/ N]` tensor lines for progress and turns a failure into one line.
"""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import children, interrupts
from ..errors import ConversionError
from ..llama.backend import lib_dir, llama_log

_TENSOR_RE = re.compile(rb"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


def _failure(rc: int, result: dict, tail: collections.deque) -> str:
    """One line saying why the worker failed, from llama.cpp's own error when it printed one."""
    lines = [ln.strip() for ln in tail if ln.strip()]
    for ln in reversed(lines):
        m = re.search(r"failed to quantize: (.+)", ln)
        if m:
            return m.group(1).rstrip("!. ")
    if rc < 0:
        last = next((ln for ln in reversed(lines) if re.search(r"error|abort|assert", ln, re.I)), "")
        return f"llama.cpp died with {signal.Signals(-rc).name}" + (f" ({last[:200]})" if last else "")
    return result.get("error") or (lines[-1][:200] if lines else f"exit status {rc}")


class Worker:
    """A started `ctxq.conversion.quantize_worker` process. Start it early: it loads llama.cpp while the caller
    prepares the job. It runs in its own session, so a terminal's Ctrl-C reaches only the parent,
    which kills it (`close`): interrupting never waits for a tensor to finish."""

    def __init__(self, lean: bool = False):
        """`lean`: no quality gate and no imatrix, so the worker needs only the standard library and
        libllama (`python -I -S`: no site-packages, environment or user paths to read)."""
        self._tmp = tempfile.TemporaryDirectory(prefix="ctxq-quantize-")
        lib = ["--lib", str(lib_dir())]
        if lean:
            argv = [sys.executable, "-I", "-S", str(Path(__file__).with_name("quantize_worker.py")), "--lean", *lib]
        else:
            argv = [sys.executable, "-m", "ctxq.conversion.quantize_worker", *lib]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, **children.lifeline())

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with interrupts.held():  # a stop signal meanwhile waits until the worker is reaped and its folder gone
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stderr):
                try:
                    pipe.close()
                except OSError:  # a pipe to a dead process
                    pass
            self._tmp.cleanup()

    def run(self, job: dict, progress=None) -> dict:
        """Send the job, follow the `[ i/ N]` tensor lines, return the result; ConversionError on failure.
        A dry run's result holds llama.cpp's log lines (`log`): the types it chose are there."""
        result_path = Path(self._tmp.name) / "result.json"
        try:
            self.proc.stdin.write(json.dumps({**job, "result": str(result_path)}).encode())
            self.proc.stdin.close()
        except BrokenPipeError:  # it died while starting; its stderr says why
            pass
        tail: collections.deque = collections.deque(maxlen=40)
        lines: list[str] | None = [] if job.get("dry_run") else None
        line, last = b"", 0
        # a stop signal ends this wait wherever the kernel delivered it: the worker may be held (a test stage) or stuck
        while chunk := interrupts.read(self.proc.stderr.fileno()):
            line += chunk
            *done, line = line.split(b"\n")
            for ln in done:
                text = ln.decode("utf-8", "replace")
                llama_log.debug("%s", text)
                tail.append(text)
                if lines is not None:
                    lines.append(text)
                if progress and last and "quant size" in text:  # quantized; loading or the gate follows
                    progress(last, last, "")
            for m in _TENSOR_RE.finditer(b"\n".join(done + [line])):
                i, n = int(m.group(1)), int(m.group(2))
                if progress and i > last:
                    progress(i - 1, n, m.group(3).decode("utf-8", "replace"))
                last = max(last, i)
        rc = self.proc.wait()
        if line:
            tail.append(line.decode("utf-8", "replace"))
        try:
            result = json.loads(result_path.read_text())
        except (OSError, ValueError):
            result = {}
        if rc != 0 or "error" in result:
            raise ConversionError(_failure(rc, result, tail))
        if lines is not None:
            result["log"] = lines + ([line.decode("utf-8", "replace")] if line else [])
        return result


def tensor_overrides(tensor_types: dict[str, str] | None) -> list | None:
    """{tensor name: type} as the worker's [[anchored regex, ggml type], ...]."""
    if not tensor_types:
        return None
    return [[f"^{re.escape(n)}$", _ggml(t)] for n, t in sorted(tensor_types.items())]


def _ggml(name: str) -> int:
    from gguf.constants import GGMLQuantizationType as T

    try:
        return int(T[str(name).strip().upper()])
    except KeyError:
        raise ConversionError(f"unknown tensor type {name!r}: one of {', '.join(t.name.lower() for t in T)}") from None
