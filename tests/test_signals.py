"""Children end with their parent (issue 47): every child ctxq starts holds a lifeline (`ctxq.children`), whichever
thread started it. Real processes throughout."""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest


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


@pytest.mark.slow
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
