"""The planner's compute-buffer under-estimates on split graphs, against llama.cpp's own sizing.

Issue 13 ("the under-estimates that remain on RPC and CPU devices") names two cells:

- Gemma-2-9B-shaped, 16,384 tokens, f16, flash attention off, split 2:1:1 over 3 RPC workers;
- Llama-3-70B-shaped, 65,536 tokens, f16, 5 RPC workers declared 16,16,16,8,8, the plan's own split.

For each cell this script plans with ctxq, makes llama.cpp size the same layout over real loopback
RPC workers, and prints per device llama.cpp's compute buffer (the host: compute + output buffers)
against the planner's (`ctxq.planning.memory.costs`), and counts the rows the plan under-estimates.

By default llama.cpp sizes the layout in a dry run (`no_alloc`, milliseconds, nothing allocated).
A dry run differs from a real load in one way (`dry_run_norm_copy`): every device after the first holds
4 residual-sized copies more, because the dry run's sizing pass drops llama.cpp's pinning of each
layer's `norm` to its device. The table compares with the real load's figure (dry run less that term);
`--real` loads for real instead (weights and KV allocated in the workers: mind the memory).

    .venv/bin/python scripts/underestimates.py            # the two cells of issue 13
    .venv/bin/python scripts/underestimates.py --all      # and the cells around them
    .venv/bin/python scripts/underestimates.py --cells gemma-16k-fa0-211 --splits --real

What the planner missed before it took these terms (llama.cpp: ggml-backend.cpp
`ggml_backend_sched_split_graph`, passes 5 and 6; with pipeline parallelism every input of a split gets
GGML_SCHED_MAX_COPIES = 4 copies flagged input+output, so ggml-alloc never frees them; the host, which
builds the graph inputs, holds 4 too), now in `memory.index_inputs`, `split.device_compute`, `memory.host_cost`:

1. Index inputs: `attn_inp_v_idxs` is I64 [n_ubatch * n_embd_v_gqa] with flash attention off (transposed
   V cache, llama_kv_cache::build_input_v_idxs), one per KV cache (iSWA: 2): Gemma-2-9B
   4 * 2 * 512 * 2048 * 8 B = 64 MiB on every device and on the host. Quantized caches add Hadamard
   rotation matrices (`attn_inp_k_rot`, `attn_inp_v_rot`); `k_idxs`, `inp_pos`, `out_ids` are KiB.
2. Layers left on the CPU: llama_context enables pipeline parallelism only when every layer is offloaded,
   so there is one copy of each input, not 4; and the host's compute holds the layers' peak (70B at
   32k, flash attention off, 14 CPU layers: the host's compute is 4,244 MiB; the plan said 336).
3. The one-layer derived model frees the graph inputs after its only layer, so its peak is not the
   steady state of a device holding many layers (Mistral-Nemo at 4k: 4 MiB short): `compute.py`
   measures a derived model with two layers of each kind as well (`ComputePeaks.layer_steady`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ctxq.gguf.info import model_info
from ctxq.planning.devices import Device
from ctxq.planning.planner import plan
from ctxq.rpc import run_supervised, start_workers
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf
from ctxq.units import GiB, MiB

SLACK = 0.02 * MiB  # llama.cpp prints buffer sizes in MiB with 2 decimals
SCHED_COPIES = 4  # GGML_SCHED_MAX_COPIES (ggml-backend.cpp), copies of each split input with pipeline parallelism


@dataclass(frozen=True)
class Cell:
    name: str
    model: str  # a key of GEOMETRIES
    n_ctx: int
    flash_attn: bool | None  # None: the planner's default (on)
    ratios: tuple[float, ...] | None = None  # a split given as ratios over RPC devices of 16 GiB
    declared: tuple[float, ...] | None = None  # `--rpc host:port=GiB` sizes; the plan's own split
    kv: str = "f16"


ISSUE = [
    Cell("gemma-16k-fa0-211", "gemma2-9b", 16384, False, ratios=(2, 1, 1)),
    Cell("70b-64k-rpc5", "llama3-70b", 65536, None, declared=(16, 16, 16, 8, 8)),
]
AROUND = [
    Cell("gemma-4k-fa0-211", "gemma2-9b", 4096, False, ratios=(2, 1, 1)),
    Cell("gemma-32k-fa0-211", "gemma2-9b", 32768, False, ratios=(2, 1, 1)),
    Cell("gemma-16k-fa1-211", "gemma2-9b", 16384, True, ratios=(2, 1, 1)),
    Cell("gemma-16k-fa0-11", "gemma2-9b", 16384, False, ratios=(1, 1)),
    Cell("gemma-16k-fa0-rpc5", "gemma2-9b", 16384, False, ratios=(16, 16, 16, 8, 8)),
    Cell("gemma-32k-fa1-rpc5", "gemma2-9b", 32768, True, ratios=(16, 16, 16, 8, 8)),
    Cell("gemma-16k-q8-211", "gemma2-9b", 16384, True, ratios=(2, 1, 1), kv="q8_0"),
    Cell("70b-16k-rpc5", "llama3-70b", 16384, None, declared=(16, 16, 16, 8, 8)),
    Cell("70b-32k-fa0-rpc5", "llama3-70b", 32768, False, declared=(16, 16, 16, 8, 8)),
    Cell("70b-64k-111", "llama3-70b", 65536, True, ratios=(1, 1, 1)),
    Cell("70b-64k-q8-rpc5", "llama3-70b", 65536, None, declared=(16, 16, 16, 8, 8), kv="q8_0"),
    Cell("70b-64k-11", "llama3-70b", 65536, True, ratios=(1, 1)),
    Cell("8b-4k-fa0-rpc5", "llama3-8b", 4096, False, ratios=(16, 16, 16, 8, 8)),
    Cell("8b-32k-rpc5", "llama3-8b", 32768, True, ratios=(16, 16, 16, 8, 8)),
    Cell("8b-4k-rpc5", "llama3-8b", 4096, True, ratios=(16, 16, 16, 8, 8)),
    Cell("8b-16k-fa0-11", "llama3-8b", 16384, False, ratios=(1, 1)),
    Cell("nemo-4k-rpc5", "mistral-nemo-12b", 4096, True, ratios=(16, 16, 16, 8, 8)),
    Cell("nemo-32k-fa0-111", "mistral-nemo-12b", 32768, False, ratios=(1, 1, 1)),
    Cell("nemo-32k-rpc5", "mistral-nemo-12b", 32768, True, ratios=(16, 16, 16, 8, 8)),
    Cell("nemo-16k-rpc5", "mistral-nemo-12b", 16384, True, ratios=(16, 16, 16, 8, 8)),
    Cell("nemo-64k-q8-rpc5", "mistral-nemo-12b", 65536, True, ratios=(16, 16, 16, 8, 8), kv="q8_0"),
    Cell("qwen-32k-rpc5", "qwen2.5-7b", 32768, True, ratios=(16, 16, 16, 8, 8)),
    Cell("qwen-4k-fa0-11", "qwen2.5-7b", 4096, False, ratios=(1, 1)),
    Cell("phi3-4k-rpc5", "phi3-mini", 4096, True, ratios=(16, 16, 16, 8, 8)),
    Cell("phi3-4k-fa0-111", "phi3-mini", 4096, False, ratios=(1, 1, 1)),
    # quantized caches: the output device's residual term
    Cell("8b-32k-q8-rpc5", "llama3-8b", 32768, True, ratios=(16, 16, 16, 8, 8), kv="q8_0"),
    Cell("8b-4k-q4-11", "llama3-8b", 4096, True, ratios=(1, 1), kv="q4_0"),
    Cell("qwen-32k-q4-rpc5", "qwen2.5-7b", 32768, True, ratios=(16, 16, 16, 8, 8), kv="q4_0"),
    Cell("nemo-32k-q8-111", "mistral-nemo-12b", 32768, True, ratios=(1, 1, 1), kv="q8_0"),
    Cell("gemma-32k-q4-rpc5", "gemma2-9b", 32768, True, ratios=(16, 16, 16, 8, 8), kv="q4_0"),
    Cell("phi3-32k-q4-11", "phi3-mini", 32768, True, ratios=(1, 1), kv="q4_0"),
    Cell("phi3-32k-11", "phi3-mini", 32768, True, ratios=(1, 1)),
    Cell("phi3-4k-q4-11", "phi3-mini", 4096, True, ratios=(1, 1), kv="q4_0"),
    Cell("phi3-16k-q8-rpc5", "phi3-mini", 16384, True, ratios=(16, 16, 16, 8, 8), kv="q8_0"),
    Cell("70b-16k-q4-rpc5", "llama3-70b", 16384, None, declared=(16, 16, 16, 8, 8), kv="q4_0"),
    # layers left on the CPU: no pipeline parallelism (llama_context: n_gpu_layers > n_layer), 1 copy
    Cell("70b-64k-cpu-rpc5", "llama3-70b", 65536, None, declared=(12, 12, 12, 8, 8)),
    Cell("8b-32k-cpu-11", "llama3-8b", 32768, True, declared=(2, 2)),
    Cell("gemma-16k-fa0-cpu-11", "gemma2-9b", 16384, False, declared=(2.5, 2.5)),
]


def dry_run_norm_copy(resid: int, first: bool, pipeline: bool) -> int:
    """Only in llama.cpp's dry run: a second residual-sized input on every device after the first.

    llama_context::graph_get_cb pins each layer's `norm-<il>` to the layer's device with full offload
    (ggml_backend_sched_set_tensor_backend). A dry run (no_alloc) sizes the pp graph with
    graph_reserve(split_only, sizes) -> ggml_backend_sched_reserve_size, which calls
    ggml_backend_sched_reset first and so wipes those pins; pass 2 "expand gpu down" then gives the
    weightless rms_norm to the previous device, and the split receives `norm-<il>` besides
    `l_out-<il-1>`. A real load (ggml_backend_sched_reserve) keeps the pins: no such copy.
    """
    return SCHED_COPIES * resid if pipeline and not first else 0


# --- llama.cpp's dry run ---------------------------------------------------------------------

def _dry_child(model: str, kw: dict, splits: bool, real: bool = False) -> dict:
    if splits:
        os.environ["GGML_SCHED_DEBUG"] = "1"  # ggml_backend_sched_print_assignments: splits and inputs
    from ctxq.llama.measure import measure

    m = measure(model, dry_run=not real, **kw)
    a = m.allocations
    return {"compute": a.compute, "output": a.output, "layers": a.layers,
            "splits": [l.rstrip() for l in m.log if "## SPLIT" in l]}


def run_cell(cell: Cell, workers, tmp: Path, splits: bool, real_load: bool = False) -> list[tuple]:
    path = tmp / f"{cell.model}.gguf"
    if not path.exists():
        write_synthetic_gguf(path, GEOMETRIES[cell.model])
    model = str(path)
    info = model_info(model)
    eps = workers.endpoints
    if cell.declared:
        p = plan(model, cell.n_ctx, rpc=",".join(f"{e}={s:g}" for e, s in zip(eps, cell.declared)),
                 kv=cell.kv, flash_attn=cell.flash_attn)
    else:
        devs = [Device(name=f"RPC{i}", kind="rpc", total=16 * GiB, usable=16 * GiB) for i in range(len(eps))]
        p = plan(model, cell.n_ctx, devices=devs, kv=cell.kv, flash_attn=cell.flash_attn,
                 split=":".join(f"{r:g}" for r in cell.ratios))
    kw = dict(n_ctx=cell.n_ctx, n_gpu_layers=p.n_gpu_layers, type_k=p.type_k, type_v=p.type_v,
              flash_attn=p.flash_attn, n_batch=p.n_batch, n_ubatch=p.n_ubatch, swa_full=p.swa_full,
              tensor_split=[float(c) for c in p.tensor_split])
    real = run_supervised(_dry_child, model, kw, splits, real_load, rpc=eps, workers=workers, timeout=900)
    if splits:
        # every reserve's splits (pp, tg, pp again; the buffers keep the largest)
        print("\n".join(re.sub(r"^.*?## ", "  ", l) for l in real["splits"] if "SPLIT #0" not in l))
    resid = info.n_embd * p.n_ubatch * 4
    pipeline = p.cpu_layers == 0
    rows, first = [], True
    for i, g in enumerate(p.gpus):
        if not g.layers:
            continue
        has_out = info.n_layer in g.layers
        got = raw = real["compute"].get(f"RPC0[{eps[i]}]", 0)
        if not real_load:  # compare with what a real load allocates (checked: --real)
            got -= dry_run_norm_copy(resid, first, pipeline)
        rows.append((cell.name, f"RPC{i}" + (" out" if has_out else " first" if first else ""), raw, got, g.compute))
        first = False
    got = sum(v for k, v in real["compute"].items() if k.startswith("CPU")) + sum(real["output"].values())
    rows.append((cell.name, f"CPU ({p.cpu_layers} layers)" if p.cpu_layers else "CPU", got, got, p.host.compute))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="also the cells around the two of issue 13")
    ap.add_argument("--cells", default=None, help="comma-separated cell names")
    ap.add_argument("--splits", action="store_true", help="print the scheduler's split inputs")
    ap.add_argument("--real", action="store_true",
                    help="load for real instead of a dry run (allocates weights and KV in the workers)")
    a = ap.parse_args()
    cells = ISSUE + (AROUND if a.all or a.cells else [])
    if a.cells:
        cells = [c for c in cells if c.name in a.cells.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="ctxq-underestimates-"))
    kind = "real load" if a.real else "dry run"
    print(f"| cell | device | llama.cpp {kind} | llama.cpp real load | planner | error |")
    print("|---|---|---:|---:|---:|---:|")
    under = n_rows = 0
    worst = 0
    by_count: dict[int, list[Cell]] = {}
    for c in cells:
        by_count.setdefault(len(c.ratios or c.declared), []).append(c)
    for n, group in sorted(by_count.items()):
        with start_workers(n) as w:
            for c in group:
                for cell, dev, raw, got, planned in run_cell(c, w, tmp, a.splits, a.real):
                    n_rows += 1
                    under += planned < got - SLACK
                    worst = max(worst, planned - got)
                    print(f"| {cell} | {dev} | {raw / MiB:.2f} | {got / MiB:.2f} | {planned / MiB:.2f} | "
                          f"{(planned - got) / MiB:+.2f} |", flush=True)
    print(f"\n{n_rows} device rows; under-estimated by more than 0.02 MiB: {under}; "
          f"largest over-estimate {worst / MiB:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
