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

import os
import re
from dataclasses import dataclass

_SIZED = re.compile(r"graph_reserve: reserving a graph for ubatch with n_tokens =\s*(\d+)")
_SPLIT = re.compile(r"^## SPLIT #\d+: (\S+?)(?:\[([^\]]*)\])? # \d+ inputs: (.*)$")
_INPUT = re.compile(r"\[(\S+) \(\s*\d+[KM]\)\]")
_COPIES = re.compile(r"sched copies = (\d+)")
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
    dry run sized (the first reserved with n_ubatch tokens), and their bytes: `resid` (the layer input's f32 row
    block, n_embd x n_ubatch x 4; the listing prints sizes rounded to K or M) in each of the scheduler's copies."""
    copies = next((int(m.group(1)) for line in lines if (m := _COPIES.search(line))), 1)
    out: dict[str, tuple[list[str], int]] = {}
    sized = False
    for line in lines:
        if m := _SIZED.search(line):
            if sized:
                break  # only the first graph of n_ubatch tokens is sized (llama_context::sched_reserve)
            sized = int(m.group(1)) == n_ubatch
            continue
        if sized and (m := _SPLIT.match(line)):
            names = [n for n in _INPUT.findall(m.group(3)) if _PINNED.match(n)]
            if names:
                key = m.group(2) or m.group(1)
                got = out.setdefault(key, ([], 0))
                out[key] = (got[0] + names, got[1] + copies * resid * len(names))
    return out


def _child(path: str, kw: dict) -> dict:
    """In a child process with the workers registered: the dry run, its compute buffers and its log."""
    os.environ["GGML_SCHED_DEBUG"] = "2"  # read when the scheduler is made, in llama_init_from_model
    from .measure import measure

    m = measure(path, dry_run=True, **kw)
    return {"compute": m.allocations.compute, "log": m.log}


def split_dry_run(path: str, workers, *, n_ctx: int, n_gpu_layers: int, tensor_split: list[float], resid: int,
                  type_k: str = "f16", type_v: str = "f16", flash_attn: bool = True, n_ubatch: int = 512,
                  n_batch: int = 2048, timeout: float = 300) -> list[SplitDevice]:
    """llama.cpp's compute buffers for the model at `path` split over `workers` (`ctxq.rpc.start_workers`) as
    `tensor_split` gives, in a dry run: one SplitDevice per worker, in order, then the host's. `resid`: bytes of
    one layer input (n_embd x n_ubatch x 4)."""
    from ..rpc import run_supervised

    kw = dict(n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, tensor_split=tensor_split, type_k=type_k, type_v=type_v,
              flash_attn=flash_attn, n_ubatch=n_ubatch, n_batch=n_batch)
    got = run_supervised(_child, path, kw, rpc=workers.endpoints, workers=workers, timeout=timeout)
    lost = lost_pins(got["log"], n_ubatch, resid)
    out = []
    for ep in workers.endpoints:
        name = f"RPC0[{ep}]"
        names, nbytes = lost.get(ep, ([], 0))
        out.append(SplitDevice(name, got["compute"].get(name, 0), names, nbytes))
    host = sum(v for k, v in got["compute"].items() if k.startswith("CPU"))
    names, nbytes = lost.get("CPU", ([], 0))
    out.append(SplitDevice("CPU", host, names, nbytes))
    return out
