"""Ground truth for tensor mode (`split_mode=3`, LLAMA_SPLIT_MODE_TENSOR): what each card really allocates.

llama.cpp is loaded in tensor mode over N local ggml RPC workers started with GGML_RPC_DEBUG=1 (CPU
devices, one thread each). Each worker logs every buffer it is asked for
(`[alloc_buffer] device: D, size: S -> remote_ptr: P`) and every one it frees (`[free_buffer] remote_ptr: P`);
the buffers a worker still holds after a short eval are that card's allocations. They are classified by
the order llama.cpp makes them, checked in each log:

- weights: the buffers allocated before the first KV buffer (the model loads first);
- KV: the buffers llama.cpp clears (`[buffer_clear]`: the cache is zeroed when the context is made), the recurrent
  state of a hybrid included (its own buffer, cleared too; the plan's `kv` + `state`);
- compute: the buffers allocated after the last KV buffer, while the context is made (the scheduler's reserve);
- all-reduce: the buffers allocated after the context is made, at the first batch (ceil(log2(cards)) scratch
  buffers sized to the batch: the eval is one full micro-batch, `n_ubatch` tokens, so they reach the size the
  plan counts).

A buffer that fits none of these (allocated between KV buffers without being cleared) is reported as
`other` with a warning rather than guessed. The load runs in a child process (llama.cpp can abort, and the
process hangs at exit after an RPC load: the child ends with os._exit), under a timeout; the workers are the
child's own children, killed with it.

    .venv/bin/python scripts/tensor_truth.py              # a few configurations: planned vs measured per card
    .venv/bin/python scripts/tensor_truth.py --quick      # SmolLM2 Q4_1, 8192 q8_0, split 2:1

scripts/accuracy.py --tensor writes the same comparison as a section of docs/accuracy-table.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ctxq.children import lifeline

MiB = 2**20
MODELS = Path.home() / ".cache" / "ctxq" / "models"
Q4_1 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
F16 = MODELS / "SmolLM2-135M-Instruct.F16.gguf"
GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
KINDS = ("weights", "kv", "compute", "allreduce", "other")
# a loopback worker that ends with the process that started it (ctxq.children's lifeline: a child that llama.cpp
# aborts leaves no worker behind)
WORKER = ("import logging, sys; from ctxq.children import watch_parent; watch_parent();"
          "logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format='%(message)s');"
          "from ctxq.rpc.server import serve_forever; serve_forever('127.0.0.1', int(sys.argv[1]), ['CPU'], 1)")
RESULT = "TENSOR_TRUTH_RESULT "
_KEEP: list = []  # the child's Llama, alive until os._exit
_ALLOC = re.compile(r"\[alloc_buffer\] device: (\S+), size: (\d+) -> remote_ptr: (\w+)")
_FREE = re.compile(r"\[free_buffer\] remote_ptr: (\w+)")
_CLEAR = re.compile(r"\[buffer_clear\] remote_ptr: (\w+)")


class TruthError(RuntimeError):
    """The load did not give an answer (llama.cpp failed, the child timed out or the logs did not parse)."""


@dataclass
class Buffer:
    size: int
    kind: str
    order: int  # its place among the worker's allocations


@dataclass
class Card:
    """What one worker holds after the eval, by kind (bytes)."""

    buffers: list[Buffer]
    warnings: list[str] = field(default_factory=list)

    def bytes(self, kind: str) -> int:
        return sum(b.size for b in self.buffers if b.kind == kind)

    @property
    def weights(self) -> int:
        return self.bytes("weights")

    @property
    def kv(self) -> int:
        return self.bytes("kv")

    @property
    def compute(self) -> int:
        """The compute buffer and the all-reduce scratch (as the plan's `compute` counts them)."""
        return self.bytes("compute") + self.bytes("allreduce")

    @property
    def allreduce(self) -> int:
        return self.bytes("allreduce")


# ---------------------------------------------------------------------------------------------- the parent


def measure(model, n_ctx: int, split, type_k: str = "f16", type_v: str | None = None, n_ubatch: int = 512,
            n_eval: int | None = None, timeout: float = 300, retries: int = 1) -> list[Card]:
    """Load `model` in tensor mode over len(split) RPC workers in a child process; each card's held buffers,
    classified. Raises TruthError (one line) when the child fails or runs past `timeout` seconds. A child
    killed by a signal (llama.cpp aborted) is run again up to `retries` times, with a line on stderr naming its
    saved output."""
    for attempt in range(retries + 1):
        try:
            return _measure_once(model, n_ctx, split, type_k, type_v, n_ubatch, n_eval, timeout)
        except Crashed as e:
            if attempt == retries:
                raise
            print(f"tensor_truth: {e}; loading again", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


class Crashed(TruthError):
    """The child was killed by a signal (llama.cpp aborted) before it answered."""



def _measure_once(model, n_ctx, split, type_k, type_v, n_ubatch, n_eval, timeout) -> list[Card]:
    args = dict(model=str(model), n_ctx=int(n_ctx), split=[float(x) for x in split], type_k=type_k,
                type_v=type_v or type_k, n_ubatch=int(n_ubatch),
                n_eval=int(n_ubatch if n_eval is None else n_eval),  # 0: load and make the context only
                logdir=tempfile.mkdtemp(prefix="ctxq-tensor-truth-"))  # the workers' logs (kept when the load fails)
    proc, out = _run_self("--child", args, timeout, "the load")
    text = out.decode(errors="replace")
    for line in text.splitlines():
        if line.startswith(RESULT):
            # the first object on the line: a thread of llama.cpp's may write after it before the line ends
            got, _ = json.JSONDecoder().raw_decode(line[len(RESULT):])
            if "error" in got:
                raise TruthError(got["error"])
            return [Card([Buffer(**b) for b in c["buffers"]], c["warnings"]) for c in got["cards"]]
    keep = Path(tempfile.mkstemp(prefix="ctxq-tensor-truth-", suffix=".log")[1])
    keep.write_text(text)
    lines = text.strip().splitlines()
    # a worker's abort (its log) before the child's own lines: the child then only loses the connection
    workers = [ln for f in sorted(Path(args["logdir"]).glob("w*.log"))
               for ln in f.read_text(errors="replace").splitlines() if re.search(r"GGML_ASSERT|\.cpp:\d+: ", ln)]
    why = ([f"RPC worker: {ln.strip()}" for ln in workers[:1]]  # GGML_ABORT prints `file.cpp:line: message`
           + [ln for ln in lines if re.search(r"GGML_ASSERT|\.cpp:\d+: |error|failed|Aborted", ln, re.I)][:3]
           or lines[-3:])
    error = Crashed if proc.returncode < 0 else TruthError
    raise error(f"the child ended (exit {proc.returncode}) without a result: {' | '.join(why)[-600:]} "
                f"(its output: {keep})")


def abort_words(message: str) -> str:
    """llama.cpp's failed assertion in a crash's message, as `file.cpp:line: GGML_ASSERT(...) failed` (its path and
    the backtrace dropped), naming the RPC worker where the worker aborted; else the message's first 300 characters."""
    message = message.split(" (its output:")[0]
    m = re.search(r"(RPC worker: )?\S*/([\w.-]+\.cpp:\d+: (GGML_ASSERT\(.*?\) failed|[^|]*))", message)
    if not m:
        return message[:300]
    return re.sub(r"Meta\([^)]*\)", "Meta(...)", re.sub(r"node_\d+", "node_N", (m.group(1) or "") + m.group(2))).strip()


def held_buffers(model, n_ctx: int, split, type_k: str = "f16", type_v: str | None = None,
                 n_ubatch: int = 512, timeout: float = 300) -> list[list[int]]:
    """Bytes of each buffer each worker holds after the load and one micro-batch, in allocation order."""
    return [[b.size for b in sorted(c.buffers, key=lambda b: b.order)]
            for c in measure(model, n_ctx, split, type_k, type_v, n_ubatch, timeout=timeout)]


def _run_self(flag: str, args: dict, timeout: float, what: str) -> tuple[subprocess.Popen, bytes]:
    """This script as a child (`flag` and its job as JSON) in a session of its own: the process and its output; the
    child's group (the workers it started) ended either way. TruthError past `timeout` seconds."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), flag, json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise TruthError(f"{what} did not finish in {timeout:.0f} s") from None
    finally:
        _kill_group(proc)  # the workers, should the child have left any
    return proc, out


def _kill_group(proc: subprocess.Popen) -> None:
    """End the child's process group (the child and the workers it started), by the child's id."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def probe(models, n_ctx: int = 2048, timeout: float = 300) -> dict[str, str | None]:
    """Whether llama.cpp loads each model in tensor mode over two RPC workers, split 1:1, without a batch: None where it
    loads, else its reason (one line). The models are loaded one after another in one child process over the same two
    workers, each freed before the next; where a load aborts the child, that model is named with the abort and the
    rest are probed in a new child."""
    left, out = [str(m) for m in models], {}
    while left:
        proc, text = _run_self("--probe", dict(models=left, n_ctx=n_ctx), timeout, "the probe")
        lines = text.decode(errors="replace").splitlines()
        for line in lines:
            if line.startswith(RESULT):
                got = json.loads(line[len(RESULT):])
                out[got["model"]] = got["why"]
        if left[0] not in out:  # the first model not answered aborted the child
            why = [ln for ln in lines if re.search(r"GGML_ASSERT|GGML_ABORT", ln)][:1] or lines[-1:]
            out[left[0]] = f"the load aborted (exit {proc.returncode}): {' '.join(why)[-300:]}"
        left = [m for m in left if m not in out]
    return out


def _probe_child(args: dict) -> None:
    ports = [_free_port() for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(p)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, **lifeline()) for p in ports]
    try:
        _connect(ports, procs)
        import llama_cpp

        from ctxq.llama.backend import capture_log

        for model in args["models"]:
            with capture_log() as lines:
                try:
                    llm = llama_cpp.Llama(model, n_ctx=args["n_ctx"], n_gpu_layers=999, split_mode=3,
                                          tensor_split=[1, 1], flash_attn=True, verbose=False, n_threads=1,
                                          swa_full=False)
                    llm.close()  # frees its buffers on the workers, which the next model needs
                    why = None
                except ValueError as e:
                    found = [l.strip() for l in lines if "error" in l.lower()]
                    why = f"{e}: {found[-1] if found else 'no reason logged'}"
            print(RESULT + json.dumps({"model": model, "why": why}), flush=True)
    finally:
        for p in procs:
            p.kill()
        os._exit(0)


def _connect(ports: list[int], procs: list) -> None:
    """Register the workers with ggml, once each listens."""
    from ctxq.rpc.client import add_servers

    t0 = time.time()
    while True:  # the workers take a moment to listen
        try:
            add_servers([f"127.0.0.1:{p}" for p in ports])
            return
        except Exception:
            if time.time() - t0 > 30 or any(p.poll() is not None for p in procs):
                raise
            time.sleep(0.1)


def _settle(logs: list[Path], quiet: float = 0.15, most: float = 3.0) -> None:
    """Wait until the workers' logs stop growing (their last lines of a step reach the files)."""
    t0, last, since = time.time(), None, time.time()
    while time.time() - t0 < most:
        sizes = [f.stat().st_size for f in logs]
        if sizes != last:
            last, since = sizes, time.time()
        elif time.time() - since >= quiet:
            return
        time.sleep(0.03)


# ----------------------------------------------------------------------------------------------- the child


def _child(args: dict) -> None:
    try:
        cards = _load(**args)
        print(RESULT + json.dumps({"cards": cards}), flush=True)
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        print(RESULT + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    finally:
        os._exit(0)  # an RPC load hangs at interpreter exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(model: str, n_ctx: int, split: list[float], type_k: str, type_v: str, n_ubatch: int, n_eval: int,
          logdir: str) -> list:
    logdir = Path(logdir)
    env = dict(os.environ, GGML_RPC_DEBUG="1")
    ports, procs, logs = [], [], []
    for i in range(len(split)):
        port = _free_port()
        ports.append(port)
        logs.append(logdir / f"w{i}.log")
        with open(logs[-1], "wb") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(port)], stdout=f,
                                          stderr=subprocess.STDOUT, **lifeline(env)))
    try:
        _connect(ports, procs)
        import llama_cpp

        from ctxq.llama.backend import capture_log

        with capture_log() as lines:
            try:
                llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_gpu_layers=999, split_mode=3, tensor_split=split,
                                      type_k=GGML_TYPE[type_k], type_v=GGML_TYPE[type_v], flash_attn=True,
                                      n_batch=n_ubatch, n_ubatch=n_ubatch, verbose=False, n_threads=1,
                                      swa_full=False)  # as ctxq runs a plan (Plan.swa_full; the C API's default
                                      # is a full-size cache for sliding-window layers)
            except ValueError as e:  # llama.cpp's reason is in its log (llama_model_load: error loading model: ...)
                why = [l.strip() for l in lines if "error" in l.lower()]
                raise ValueError(f"{e}: {why[-1] if why else 'no reason logged'}") from None
        # never freed: llama_free would talk to workers the `finally` below has killed, and ggml-rpc aborts the
        # child when a worker does not answer (seen: exit -6 in ~llama_context); the child ends with os._exit
        _KEEP.append(llm)
        _settle(logs)  # the workers' last lines of the load reach their logs
        made = [f.stat().st_size for f in logs]  # what follows is the first batch
        # token ids, not text: the memory does not depend on them, and a test model without a tokenizer
        # ("none": llama.cpp's dummy tokens) aborts in llama_tokenize
        tokens = [1 + i % (llm.n_vocab() - 1) for i in range(min(n_eval, n_ctx))]
        if tokens:
            llm.eval(tokens)
        _settle(logs)
        cards = [_classify(f.read_bytes(), cut) for f, cut in zip(logs, made)]
        for t in tokens[:2]:  # then two one-token steps, which reshape differently (an abort there ends the child)
            llm.eval([t])
        shutil.rmtree(logdir, ignore_errors=True)  # kept when the load fails
        return [{"buffers": [b.__dict__ for b in c.buffers], "warnings": c.warnings} for c in cards]
    finally:
        for p in procs:
            p.kill()


def _classify(log: bytes, made: int) -> Card:
    """The buffers one worker holds, by kind (see the module's text), from its log; `made`: the log's size
    when the context was made (later allocations are the first batch's)."""
    allocs: dict[str, list] = {}  # ptr -> [size, order, offset, cleared]
    order = 0
    pos = 0
    for raw in log.splitlines(keepends=True):
        line = raw.decode(errors="replace")
        if m := _ALLOC.search(line):
            allocs[m.group(3)] = [int(m.group(2)), order, pos, False]
            order += 1
        elif m := _FREE.search(line):
            allocs.pop(m.group(1), None)
        elif m := _CLEAR.search(line):
            if m.group(1) in allocs:
                allocs[m.group(1)][3] = True
        pos += len(raw)
    warnings = []
    kv_orders = [o for _, o, at, cleared in allocs.values() if cleared and at < made]
    if not kv_orders:
        warnings.append("no KV buffer (none cleared) among the held buffers")
    first_kv, last_kv = (min(kv_orders), max(kv_orders)) if kv_orders else (math.inf, -math.inf)
    buffers = []
    for size, o, at, cleared in allocs.values():
        if at >= made:
            kind = "allreduce"
        elif cleared:
            kind = "kv"
        elif o < first_kv:
            kind = "weights"
        elif o > last_kv:
            kind = "compute"
        else:
            kind = "other"
            warnings.append(f"a buffer of {size} bytes allocated among the KV buffers, not cleared")
        buffers.append(Buffer(size, kind, o))
    kinds = [b.kind for b in sorted(buffers, key=lambda b: b.order)]
    rank = [KINDS.index(k) for k in kinds]
    if rank != sorted(rank):
        warnings.append("allocations not in the order weights, KV, compute, all-reduce: " + ", ".join(kinds))
    if not any(k == "weights" for k in kinds):
        warnings.append("no weights buffer held")
    if not any(k == "compute" for k in kinds):
        warnings.append("no compute buffer held")
    return Card(buffers, warnings)


# ----------------------------------------------------------------------------------------- the comparison


@dataclass
class Row:
    """One card: planned and measured bytes of weights, KV and compute (compute with the all-reduce). `batch`: the
    load ran its micro-batch; where llama.cpp aborts at it (`aborted`), the load's allocations only, and the planned
    compute without the all-reduce scratch (allocated at the first batch)."""

    label: str
    card: int
    proportion: float
    planned: dict
    measured: dict
    allreduce: int
    warnings: list[str]
    batch: bool = True
    aborted: str = ""
    refused: str | None = None  # ctxq's first-batch refusal at these proportions ("" where it plans; None: not asked)
    target: tuple[float, int] | None = None  # (rel, abs bytes) the card's total is held to, where one is set

    def diff(self, kind: str) -> int:
        return self.planned[kind] - self.measured[kind]

    def under(self) -> list[str]:
        """The figures the plan puts below the measured ones (the never-under rule)."""
        return [k for k in ("weights", "kv", "compute") if self.diff(k) < 0]

    @property
    def error(self) -> int:
        """The card's planned total less its measured total (bytes)."""
        return sum(self.diff(k) for k in ("weights", "kv", "compute"))

    def within(self, rel: float, abs_: int) -> bool:
        """The card's total within rel of what it allocates or abs bytes, whichever is larger."""
        return abs(self.error) <= max(rel * sum(self.measured.values()), abs_)


def planned(model, n_ctx: int, kv: str, split=None, simulate: str | None = None, n_ubatch: int = 512):
    """ctxq's tensor-mode plan: `split` the proportions (None: the planner searches them on `simulate`). Without
    the first-batch refusals (planning/tensor/batch.py: the load is what is measured, and where a batch would abort
    none is computed): the plan these cards would get where llama.cpp runs it."""
    import ctxq
    from ctxq.planning.tensor.batch import loads_only

    n = len(str(split).replace(":", ",").split(",")) if split else None
    sim = simulate or ",".join(["1"] * (n or 2))
    with loads_only():
        return ctxq.plan(str(model), n_ctx, simulate=sim, split_mode="tensor", kv=kv, split=split, n_ubatch=n_ubatch)


def refusal(model, n_ctx: int, kv: str, split, simulate: str | None = None, n_ubatch: int = 512) -> str:
    """ctxq's own verdict on these proportions, first-batch refusals included (planning/tensor/batch.py): "" where it
    plans tensor mode, else its one line."""
    import ctxq
    from ctxq.errors import InvalidOption

    sim = simulate or ",".join(["1"] * len(split))
    try:
        ctxq.plan(str(model), n_ctx, simulate=sim, split_mode="tensor", kv=kv, n_ubatch=n_ubatch,
                  split=",".join(map(str, split)))
        return ""
    except InvalidOption as e:
        return str(e)


def compare(model, n_ctx: int, kv: str, split=None, simulate: str | None = None, n_ubatch: int = 512,
            label: str = "", timeout: float = 300, batch: bool | str = True) -> list[Row]:
    """Plan, load for real with the plan's proportions, and pair the two card by card. `batch`: True, the load runs
    one full micro-batch (retried once should llama.cpp abort); False, the load only; "auto", the batch where
    llama.cpp runs it, else (an abort, as Qwen3.5's models over RPC: ggml-rpc.cpp:1414) the load only, the abort
    named in the rows."""
    from ctxq.gguf.info import model_info
    from ctxq.gguf.shards import read_model
    from ctxq.planning.tensor.mode import allreduce_bytes

    p = planned(model, n_ctx, kv, split, simulate, n_ubatch)
    if p.split_mode != "tensor":
        raise TruthError(f"the plan is in {p.split_mode} mode, not tensor")
    if p.n_gpu_layers != p.n_layer + 1:
        raise TruthError(f"the plan keeps {p.n_layer + 1 - p.n_gpu_layers} layer slots on the CPU; "
                         "the truth run offloads every layer")
    tk, _, tv = kv.partition("/")
    refused = refusal(model, n_ctx, kv, p.tensor_split, simulate, n_ubatch) if batch == "auto" else None
    cards, aborted = None, ""
    if batch:
        try:
            cards = measure(model, n_ctx, p.tensor_split, tk, tv or tk, n_ubatch, timeout=timeout,
                            retries=0 if batch == "auto" else 1)
        except Crashed as e:
            if batch != "auto":
                raise
            aborted = abort_words(str(e))
    if cards is None:
        cards = measure(model, n_ctx, p.tensor_split, tk, tv or tk, n_ubatch, n_eval=0, timeout=timeout)
    # without a batch no scratch is allocated: the plan's is left out of the comparison
    scratch = 0 if batch and not aborted else allreduce_bytes(model_info(read_model(model)), len(cards), n_ubatch)
    total = sum(p.tensor_split)
    if split is None:  # the planner's own proportions: name them
        label = f"{label} = {':'.join(map(str, p.tensor_split))}"
    rows = []
    for j, (g, c) in enumerate(zip(p.gpus, cards)):
        rows.append(Row(label, j, p.tensor_split[j] / total,
                        {"weights": g.weights, "kv": g.kv + g.state, "compute": g.compute + g.cuda_copies - scratch},
                        {"weights": c.weights, "kv": c.kv, "compute": c.compute}, c.allreduce, c.warnings,
                        batch=bool(batch) and not aborted, aborted=aborted, refused=refused))
    return rows


CONFIGS = [  # (label, model, n_ctx, kv, split, simulate)
    ("SmolLM2 Q4_1 8192 q8_0 2:1", Q4_1, 8192, "q8_0", "2:1", None),
    ("SmolLM2 Q4_1 8192 q8_0 1:1", Q4_1, 8192, "q8_0", "1:1", None),
    ("SmolLM2 Q4_1 8192 q8_0 searched (0.3,0.2 GiB)", Q4_1, 8192, "q8_0", None, "0.3,0.2"),
    ("SmolLM2 F16 4096 f16 5:3:2", F16, 4096, "f16", "5:3:2", None),
    # checkpoints transformers builds, converted by llama.cpp's own converter (ctxq.testing.upstream_models)
    ("GLM-4 (fused up+gate, q/k/v biases) 4096 q8_0 3:1", lambda: _upstream("glm4"), 4096, "q8_0", "3:1", None),
    ("GLM-4 (fused up+gate, q/k/v biases) 4096 f16 5:3:2", lambda: _upstream("glm4"), 4096, "f16", "5:3:2", None),
    ("SmolLM3 (untied output) 4096 q8_0 3:1", lambda: _upstream("smollm3"), 4096, "q8_0", "3:1", None),
    ("GLM-4.5-style MoE (routed + shared experts) 4096 q8_0 3:1", lambda: _upstream("glm4moe"), 4096, "q8_0", "3:1",
     None),
]


def _upstream(name: str) -> Path:
    from ctxq.testing import upstream_models

    return upstream_models.build(name)


# The yardsticks: every architecture ctxq's test models cover where llama.cpp runs tensor mode, on 2 and 3 cards,
# each KV type (scripts/accuracy.py --tensor)
YARDSTICK_SPLITS = ("2:1", "5:3:2")
YARDSTICK_KV = ("f16", "q8_0", "q4_0")
# Qwen3.5-shaped models made in code with delta nets wide enough that every card gets whole heads (4 K heads and 8 V
# heads of 128: llama.cpp's granule is lcm(128, ssm_d_state) wide)
WIDE = dict(n_layer=4, n_embd=256, n_ff=512, ssm_d_state=128, ssm_n_group=4, ssm_dt_rank=8)


def yardsticks(folder: Path) -> list[tuple[str, str, object]]:
    """(name, architecture, a function making the model or the reason it is not made) for each of ctxq's yardstick
    models whose architecture llama.cpp runs in tensor mode (asked of the linked libllama, llama/archs.py): the hybrids
    and gpt-oss made in code (ctxq.testing.hybrid.MAKERS, into `folder`) and the checkpoints transformers builds and
    llama.cpp's converter converts (ctxq.testing.upstream_models, cached)."""
    from ctxq.llama.archs import refuses_tensor_mode
    from ctxq.testing import upstream_models
    from ctxq.testing.hybrid import MAKERS, HybridGeometry, write_qwen35

    out = []
    for name, make in MAKERS.items():
        if refuses_tensor_mode(name):
            continue
        if name in ("qwen35", "qwen3next", "qwen35moe"):
            made = (lambda n=name: write_qwen35(folder / f"{n}.gguf", HybridGeometry(**WIDE), arch=n))
        else:
            made = (lambda n=name, m=make: m(folder / f"{n}.gguf"))
        out.append((f"{name} (made)", name, made))
    for name in upstream_models.NAMES:
        arch = upstream_models.SPECS[name].arch
        if refuses_tensor_mode(arch):
            continue
        why = upstream_models.NOT_BUILDABLE.get(name)
        out.append((name, arch, why or (lambda n=name: upstream_models.build(n))))
    return out


# At real layer widths (header-only conversions, ctxq.testing.upstream_widths), a few layers each: name -> the
# (KV type, split) cells, None for every yardstick cell (llama4-scout-4l's 5.7 GB takes about a minute a load)
REAL_WIDTHS = {"gemma4-6l": None, "gemma4-e2b-8l": None, "gemma4-e2b-4l": None,
               "llama4-scout-4l": (("q8_0", "5:3:2"), ("f16", "2:1"))}


def real_widths() -> list[tuple[str, str, object, list[tuple[str, str]]]]:
    """(name, architecture, a function making the model, its (KV type, split) cells) of REAL_WIDTHS whose
    architecture llama.cpp runs in tensor mode."""
    from ctxq.llama.archs import refuses_tensor_mode
    from ctxq.testing import upstream_models, upstream_widths

    out = []
    for name, cells in REAL_WIDTHS.items():
        arch = upstream_models.SPECS[upstream_widths.REALISTIC[name].base].arch
        if not refuses_tensor_mode(arch):
            out.append((name, arch, lambda n=name: upstream_widths.build_realistic(n),
                        list(cells or [(kv, sp) for sp in YARDSTICK_SPLITS for kv in YARDSTICK_KV])))
    return out


EXTRA = [  # main() only: the other load measured by hand when the planner was written
    ("SmolLM2 F16 4096 q4_0 3:1", F16, 4096, "q4_0", "3:1", None),
]


def outside(r: Row) -> bool:
    """The card's total is outside its target (where it has one)."""
    return r.target is not None and not r.within(*r.target)


def table(rows: list[Row]) -> str:
    head = ("| configuration | card | share | weights planned | measured | diff | KV planned | measured | diff "
            "| compute planned | measured (all-reduce) | diff | total diff | never under, within target |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        cells = []
        for k in ("weights", "kv", "compute"):
            extra = (f" ({r.allreduce / MiB:.3f})" if r.batch else " (no batch)") if k == "compute" else ""
            cells += [f"{r.planned[k] / MiB:.3f}", f"{r.measured[k] / MiB:.3f}{extra}", f"{r.diff(k) / MiB:+.3f}"]
        cells.append(f"{r.error / MiB:+.3f}")
        under = r.under()
        status = "ok" if not under else "**UNDER: " + ", ".join(under) + "**"
        if outside(r):
            status += f" **OVER: outside {r.target[0]:.0%} / {r.target[1] / MiB:g} MiB**"
        if r.warnings:
            status += " (" + "; ".join(r.warnings) + ")"
        lines.append(f"| {r.label} | {r.card} | {r.proportion:.0%} | " + " | ".join(cells) + f" | {status} |")
    return "\n".join(lines)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the first configuration")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per load")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(json.loads(a.child))
    if a.probe:
        _probe_child(json.loads(a.probe))
    rows, bad = [], 0
    for label, model, n_ctx, kv, split, sim in CONFIGS[:1] if a.quick else CONFIGS + EXTRA:
        model = model() if callable(model) else model
        if not Path(model).exists():
            print(f"skip {label}: {model} is absent (make it with `ctxq convert`)", flush=True)
            continue
        t0 = time.time()
        try:
            got = compare(model, n_ctx, kv, split, sim, label=label, timeout=a.timeout)
        except TruthError as e:
            print(f"{label}: FAILS: {e}", flush=True)
            bad += 1
            continue
        rows += got
        bad += sum(1 for r in got if r.under() or r.warnings)
        print(f"{label}: {time.time() - t0:.0f} s", flush=True)
    print(table(rows))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
