"""llama.cpp's own accounting of a split graph: a metadata-only load (`no_alloc`) over loopback RPC workers.

A CPU dry run (`accounting.py`) has one device, so it cannot show what a split adds (the copies of each split's
inputs, pipeline parallelism's four of them, where ggml-alloc places the head above a device's layers). The same dry
run with the model's layers split over RPC workers on 127.0.0.1 does: nothing is allocated (weights and KV print 0),
the workers only answer the client's questions about alignment and tensor sizes, and each device's compute buffer
comes back in about a second at any width (Mistral-Nemo-12B's header on 2 workers: 0.3 s, where a real load of its
sparse weights over RPC takes 117 s).

One difference from a real load, found in llama.cpp's source (0.3.36): in a dry run, `llama_context::graph_reserve`
sizes the buffers with `ggml_backend_sched_reserve_size`, which resets the scheduler *after* the graph was built, so
the backends the graph callback pinned are lost: each layer's `norm` (and `l_last`), which llama.cpp pins to the
layer's device with every layer offloaded (`graph_get_cb`), then follows the node before it onto the previous
device, and the next device receives it as one more split input, in the scheduler's copies. `lost_pins` reads those
inputs from the scheduler's debug listing (GGML_SCHED_DEBUG) of the sized graph; `SplitDevice.corrected` takes
them off. Checked against real loads: SmolLM2-135M at 16k on 2 workers, the second device 170.17 MiB in the dry run,
165.67 real = 170.17 - 4 x 1.125 (tests/test_split_dry.py); Mistral-Nemo-12B's widths at 4k f16, 400.05 dry,
360.05 real = 400.05 - 4 x 10. llama.cpp's own `--fit` sizes its split from the same dry run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from .. import children, stages
from ..errors import CtxqError
from ..units import last_error_line

_SIZED = re.compile(r"graph_reserve: reserving a graph for ubatch with n_tokens =\s*(\d+)")
_SPLIT = re.compile(r"^## SPLIT #\d+: (\S+?)(?:\[([^\]]*)\])? # \d+ inputs: (.*)$")
_INPUT = re.compile(r"\[(\S+) \(\s*\d+[KM]\)\]")
_COPIES = re.compile(r"sched copies = (\d+)")
_METHOD = 5  # in the cache key: what lost_pins takes off
# "node #497 (  RMS_NORM):              norm-16 (   1M) [RPC0[ ] use=1,c=1:             l_out-15 (   1M) [RPC0[ ]"
_NODE = re.compile(r"^node #\s*\d+ \(\s*(\w+)\):\s*(.+?) \(\s*\d+[KM]\) \[.*?use=\d+,c=\d+:\s*(.+?) \(\s*\d+[KM]\) \[")
_PINNED = re.compile(r"^(norm|l_last)-(\d+)$")  # the tensors graph_get_cb pins to their layer's device


@dataclass
class SplitDevice:
    name: str  # llama.cpp's buffer name: "RPC0[127.0.0.1:port]", "CPU"
    compute: int  # the dry run's compute buffer, bytes
    lost_pins: list[str]  # split inputs that a real load computes on this device (the lost pins)
    lost_bytes: int  # their bytes in the scheduler's copies

    @property
    def corrected(self) -> int:
        """The compute buffer a real load allocates: the dry run's less the lost pins' copies."""
        return self.compute - self.lost_bytes


def lost_pins(lines: list[str], n_ubatch: int, resid: int) -> dict[str, tuple[list[str], int]]:
    """Per device (its endpoint, or the backend name), the pinned tensors it received as split inputs in the graph the
    dry run sized (the first reserved with n_ubatch tokens), and the bytes they add. A layer's first `norm` that ran on
    the previous device adds itself where its source, the previous layer's output (`l_out`, Nemotron-H's
    `nemotron_h_block_out`), crosses as well (the residual add still reads it): with pipeline parallelism `resid` (the layer input's f32 row block, n_embd x
    n_ubatch x 4; the listing prints sizes rounded to K or M) in each of the scheduler's copies, allocated before the
    split's nodes and never freed; without, nothing (a split's inputs are then nodes freed after their last reader:
    Llama-4-Scout's widths, n_cpu_moe=2, 104.09 MiB dry and real). Where the norm reads something else (Gemma 3n's
    altup streams, whose stack crosses anyway: tiny Gemma 3n's first device equal dry and real) nothing is taken off:
    the dry run is then the bound."""
    copies = next((int(m.group(1)) for line in lines if (m := _COPIES.search(line))), 1)
    out: dict[str, tuple[list[str], int]] = {}
    splits: list[tuple[str, list[str]]] = []
    source: dict[str, str] = {}  # a norm's source: the first node of that name in the sized graph
    sized = False
    for line in lines:
        if m := _SIZED.search(line):
            if sized:
                break  # only the first graph of n_ubatch tokens is sized (llama_context::sched_reserve)
            sized = int(m.group(1)) == n_ubatch
            continue
        if not sized:
            continue
        if m := _SPLIT.match(line):
            splits.append((m.group(2) or m.group(1), _INPUT.findall(m.group(3))))
        elif (m := _NODE.match(line)) and _PINNED.match(m.group(2)):  # RMS_NORM, or NORM (Cohere2's layer norm)
            source.setdefault(m.group(2), m.group(3))
    for key, inputs in splits:
        for name in inputs:
            if not _PINNED.match(name):
                continue
            src = source.get(name, "")  # the listing cuts node names to 20 characters
            extra = copies > 1 and any(i == src or (len(src) == 20 and i.startswith(src)) for i in inputs)
            got = out.setdefault(key, ([], 0))
            out[key] = (got[0] + [name], got[1] + (copies * resid if extra else 0))
    return out


def split_dry_run(path: str, workers, *, n_ctx: int, n_gpu_layers: int, tensor_split: list[float], resid: int,
                  type_k: str = "f16", type_v: str = "f16", flash_attn: bool = True, n_ubatch: int = 512,
                  n_batch: int = 2048, timeout: float = 300, **settings) -> list[SplitDevice]:
    """llama.cpp's compute buffers for the model at `path` split over `workers` (`ctxq.rpc.start_workers`) as
    `tensor_split` gives, in a dry run: one SplitDevice per worker, in order, then the host's. `resid`: bytes of
    one layer input (n_embd x n_ubatch x 4). `settings`: more of `measure`'s (swa_full, n_seq_max, kv_unified,
    n_outputs_max, cpu_patterns).

    The dry run has a process of its own (`python -m ctxq.planning.split_dry`, not multiprocessing, which would run
    the caller's main module again in its child), which sees the RPC workers as its only GPUs (a CUDA build's own
    cards would take layers of the split) and lists the scheduler's splits (GGML_SCHED_DEBUG, read when llama.cpp
    makes the scheduler)."""
    kw = dict(n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, tensor_split=tensor_split, type_k=type_k, type_v=type_v,
              flash_attn=flash_attn, n_ubatch=n_ubatch, n_batch=n_batch, **settings)
    kw["cpu_patterns"] = list(kw.get("cpu_patterns", ()))
    job = dict(path=str(path), endpoints=list(workers.endpoints), resid=resid, kw=kw)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GGML_SCHED_DEBUG="2", GGML_NO_BACKTRACE="1")
    try:
        r = subprocess.run([sys.executable, "-m", "ctxq.planning.split_dry"], input=json.dumps(job),
                           capture_output=True, text=True, timeout=timeout, **children.lifeline(env))
    except subprocess.TimeoutExpired:
        raise CtxqError(f"llama.cpp's dry run of the split took over {timeout:.0f} s") from None
    if r.returncode != 0:
        raise CtxqError(f"llama.cpp's dry run of the split failed: {last_error_line(r.stderr.splitlines())}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    out = []
    for ep in workers.endpoints:
        name = f"RPC0[{ep}]"
        names, nbytes = got["lost"].get(ep, ([], 0))
        out.append(SplitDevice(name, got["compute"].get(name, 0), names, nbytes))
    host = sum(v for k, v in got["compute"].items() if k.startswith("CPU"))
    names, nbytes = got["lost"].get("CPU", ([], 0))
    out.append(SplitDevice("CPU", host, names, nbytes))
    return out


def _main() -> int:
    """The dry run's process: a job on stdin (split_dry_run), its compute buffers and lost pins on stdout."""
    children.watch_parent()
    job = json.loads(sys.stdin.read())
    stages.reached("split-dry-run")
    try:
        from ..rpc.client import add_servers
        from ..llama.measure import measure

        add_servers(job["endpoints"])
        kw = dict(job["kw"], cpu_patterns=tuple(job["kw"].get("cpu_patterns", ())))
        m = measure(job["path"], dry_run=True, **kw)
    except CtxqError as e:
        print(str(e), file=sys.stderr)
        return 1
    lost = lost_pins(m.log, kw["n_ubatch"], job["resid"])
    print(json.dumps({"compute": m.allocations.compute, "lost": lost}))
    return 0


_answers: dict[tuple, tuple[list[int], int, list[bool]]] = {}  # this process's answers, by file identity and question


def split_compute(path: str, n_devices: int, *, resid: int, **kw) -> tuple[list[int], int, list[bool]]:
    """The corrected compute buffers of `n_devices` split devices and of the host (bytes), and for each device whether
    the dry run lost a pin that a real load computes there (`lost_pins`), from `split_dry_run` on that many loopback
    workers started here; cached on disk per model file and settings, as the accounting's answers are
    (`accounting.answer_key`), and in memory (a warm plan reads neither the file nor the disk)."""
    st = os.stat(path)
    question = json.dumps([_METHOD, n_devices, resid, {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}],
                          sort_keys=True)
    mem = (str(path), st.st_size, st.st_mtime_ns, question)
    if mem in _answers:
        return _answers[mem]
    from ..paths import ctxq_home
    from ..llama.accounting import answer_key

    f = ctxq_home() / "split" / f"{answer_key(path, 'split', question)}.json"
    try:
        d = json.loads(f.read_text())
        got = [int(x) for x in d["devices"]], int(d["host"]), [bool(x) for x in d["lost"][:n_devices]]
    except (OSError, ValueError, KeyError, TypeError):
        from ..rpc import start_workers  # only to ask: its import is a tenth of a cold plan

        with start_workers(n_devices) as w:
            dry = split_dry_run(path, w, resid=resid, **kw)
        got = [d.corrected for d in dry[:-1]], dry[-1].corrected, [bool(d.lost_pins) for d in dry[:-1]]
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"devices": got[0], "host": got[1], "lost": [d.lost_pins for d in dry]}))
        os.replace(tmp, f)
    _answers[mem] = got
    return got

if __name__ == "__main__":
    raise SystemExit(_main())
