"""Named stages of ctxq's long commands, where a test can stop one: the hook behind tests/test_signals.py.

With `CTXQ_TEST_STAGE=NAME:FIFO` in its environment, the process that reaches stage NAME (ctxq itself or one of its
children, which inherit the variable) writes "NAME PID" to the FIFO, waiting for the test to open it, and then waits
for a signal. The test thus knows that the command is at that point with its children started, and stops it there,
without sleeping. Without the variable (always, outside the tests) `reached` returns at once.

Stages: "quantize" (the quantizer's worker, inside llama_model_quantize at its first tensor), "reference" and
"candidate" (a quality worker after its first batch), "fit-probe" (`convert fit`, a probe file quantized and about
to be measured), "prefill" (`ctxq run`, after the first prompt chunk), "split-dry-run" (the split referee's dry run,
its RPC workers up).

Standard library only: the quantizer's lean worker loads this file by its path.
"""

from __future__ import annotations

import os
import signal

ENV = "CTXQ_TEST_STAGE"


def reached(name: str) -> None:
    """Stage `name`: nothing, unless a test asked to stop here (see the module's docstring)."""
    spec = os.environ.get(ENV)
    if not spec or spec.partition(":")[0] != name:
        return
    with open(spec.partition(":")[2], "w") as fifo:  # blocks until the test reads
        fifo.write(f"{name} {os.getpid()}\n")
    while True:
        signal.pause()  # a handled signal returns here (or raises, in ctxq's main process)
