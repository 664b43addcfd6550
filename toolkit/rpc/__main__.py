"""`python -m ctxq.rpc`: one local worker process (started by `ctxq.rpc.start_workers`)."""

import os
import sys

from .workers import worker_main

code = worker_main()
sys.stdout.flush()
sys.stderr.flush()
# The server thread is blocked in C (accept) and cannot be joined: leave without interpreter
# shutdown racing it.
os._exit(code)
