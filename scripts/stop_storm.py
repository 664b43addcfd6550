"""Stop `ctxq convert` with SIGHUP and SIGTERM at random moments, under load, and check each stop (issue 56).

The bar: every stop ends the command within 10 s, with exit status 128 + the signal, and leaves nothing behind: no
temporary beside the destination, under ctxq's home or in the temporary folder, no child process. Each stop runs
`ctxq convert MODEL TYPE -o OUT --no-check` with a folder of its own (OUT's, CTXQ_HOME, TMPDIR) and a marker in its
environment, which every child inherits; busy loops (`python -c 'while 1: pass'`) run beside it. The moment is drawn
uniformly over the length of an unstopped conversion measured first under the same load, so stops land in Python's
start, the quantizer's start, llama_model_quantize and the load check alike.

A stop that lands before ctxq has installed its handler (in Python's start and imports) ends the process by the
signal's default action: `-SIG` from Popen, which a shell reports as the same 128 + SIG; no child exists yet then.

    .venv/bin/python scripts/stop_storm.py                     # 50 stops, 2 busy loops
    .venv/bin/python scripts/stop_storm.py --stops 8 --busy 1 --seed 3

Exit status 0 when every stop met the bar. tests/test_signals.py runs a short storm through `storm()`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MARK = "CTXQ_STOP_STORM"  # in the command's environment, so in every child's
BOUND_S = 10.0  # the bar for a stop


@dataclass
class Stop:
    """One stop: when it was sent (seconds after the start), what the command showed by then, how it ended."""

    signal: str
    moment_s: float
    phase: str = ""
    end_s: float | None = None  # None: it did not end within the guard (then killed)
    exit: int | None = None
    leftovers: list[str] = field(default_factory=list)
    had_children: bool = False
    err_tail: str = ""  # the end of its stderr, shown for a stop that missed the bar

    def ok(self, sig: int) -> bool:
        rc_ok = self.exit == 128 + sig or (self.exit == -sig and not self.had_children)
        return self.end_s is not None and self.end_s <= BOUND_S and rc_ok and not self.leftovers


def _ctxq() -> str:
    return str(Path(sys.executable).with_name("ctxq"))


def _phase(err: str) -> str:
    """How far the command's output got: the quantizer's last tensor count, else whether it printed anything."""
    counts = re.findall(r"(\d+)/(\d+) \[", err)
    if counts:
        return f"quantize {counts[-1][0]}/{counts[-1][1]}"
    return "its first line" if err.strip() else "no output yet"


def _marked(mark: str) -> list[str]:
    """Live processes (zombies excepted) whose environment holds `mark`."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.pid != os.getpid() and p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"pid {p.pid} {p.info['name']}")
        except psutil.Error:
            pass
    return found


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _run(model: str, type: str, work: Path, sig: int | None, moment: float, guard_s: float) -> tuple[Stop, bool]:
    """One conversion in `work`, stopped by `sig` `moment` seconds after its start (None: run to its end).
    (the stop, whether the signal was sent: False when the command had ended first)."""
    import psutil

    out, home, tmp = work / "out", work / "home", work / "tmp"
    for d in (out, home, tmp):
        d.mkdir(parents=True)
    env = {**os.environ, "CTXQ_HOME": str(home), "TMPDIR": str(tmp), MARK: str(work)}
    env.pop("CTXQ_DEBUG", None)
    # SIGHUP back at its default: a storm run under nohup would otherwise hand ctxq an ignored SIGHUP (cli/stops.py)
    proc = subprocess.Popen([_ctxq(), "convert", model, type, "-o", str(out / "x.gguf"), "--no-check"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    t0 = time.monotonic()
    name = signal.Signals(sig).name if sig else "-"
    if sig is not None:
        time.sleep(max(0.0, moment - (time.monotonic() - t0)))
    stop = Stop(name, time.monotonic() - t0)
    signalled = sig is not None and proc.poll() is None
    if signalled:
        try:
            stop.had_children = bool(psutil.Process(proc.pid).children(recursive=True))
        except psutil.Error:
            pass
        sent = time.monotonic()
        proc.send_signal(sig)
    else:
        sent = t0
    try:
        _, err = proc.communicate(timeout=guard_s)
        stop.end_s = time.monotonic() - sent
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    stop.exit, stop.phase, stop.err_tail = proc.returncode, _phase(err), err[-800:]
    left = _marked(str(work))
    deadline = time.monotonic() + 2  # a child the lifeline kills goes within moments, not at ctxq's exit
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _marked(str(work))
    from ctxq import tempfiles

    stop.leftovers = left + [f"tmp/{f}" for f in _files(tmp)] + \
        [f"home/{p.relative_to(home)}" for p in tempfiles.temporaries(home, recursive=True)] + \
        [f"out/{f}" for f in _files(out) if f != "x.gguf"]
    if "Traceback" in err:
        stop.leftovers.append("a traceback on stderr")
    return stop, signalled


def storm(stops: int = 50, busy: int = 2, seed: int | None = None, model: str | None = None, type: str = "q8_0",
          guard_s: float = 120.0, report=print) -> list[tuple[int, Stop]]:
    """`stops` stops (SIGHUP and SIGTERM in turn) at random moments beside `busy` busy loops; [(signal, Stop)].
    A draw that comes after the command's end is drawn again (counted in the report)."""
    if model is None:
        from ctxq.models import fetch_default_model

        model = str(fetch_default_model())
    rng = random.Random(seed)
    loops = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(busy)]
    rows: list[tuple[int, Stop]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ctxq-storm-") as root:
            whole, _ = _run(model, type, Path(root) / "whole", None, 0.0, guard_s)
            if whole.exit != 0:
                raise SystemExit(f"the unstopped conversion failed: exit {whole.exit}")
            length = whole.end_s
            report(f"an unstopped conversion under {busy} busy loop(s): {length:.2f} s")
            late = 0
            while len(rows) < stops:
                sig = (signal.SIGHUP, signal.SIGTERM)[len(rows) % 2]
                stop, sent = _run(model, type, Path(root) / f"{len(rows)}-{late}", sig, rng.uniform(0, length),
                                  guard_s)
                if not sent:
                    late += 1
                    continue
                rows.append((sig, stop))
                end = f"{stop.end_s:6.2f}" if stop.end_s is not None else f">{guard_s:.0f}"
                report(f"{len(rows):>3}  {stop.signal:<7}  {stop.moment_s:6.2f}  {stop.phase:<20}  {end:>6}  "
                       f"{stop.exit:>5}  {', '.join(stop.leftovers) or '-':<10}  {'ok' if stop.ok(sig) else 'FAIL'}")
                if not stop.ok(sig):
                    report("     stderr: " + stop.err_tail.replace("\r", "\n").strip().replace("\n", "\n     "))
            report(f"{late} draw(s) fell after the command's end and were drawn again")
    finally:
        for p in loops:
            p.kill()
            p.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stops", type=int, default=50)
    ap.add_argument("--busy", type=int, default=2, help="busy loops beside the command")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model, SmolLM2)")
    ap.add_argument("--type", default="q8_0")
    a = ap.parse_args(argv)
    print("  #  signal   moment  output got to         end s   exit  leftovers")
    rows = storm(a.stops, a.busy, a.seed, a.model, a.type)
    bad = [s for sig, s in rows if not s.ok(sig)]
    ends = sorted(s.end_s for _, s in rows if s.end_s is not None)
    handled = sum(s.exit == 128 + sig for sig, s in rows)
    print(f"{len(rows)} stops: {len(rows) - len(bad)} met the bar (within {BOUND_S:.0f} s, 128 + signal, nothing left); "
          f"{handled} through ctxq's handler, {len(rows) - handled - len(bad)} before it (Python's start); "
          f"end median {ends[len(ends) // 2]:.2f} s, max {ends[-1]:.2f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
