"""The planner's compute buffers against llama.cpp's own split accounting, in seconds instead of minutes.

For one model and split it plans with ctxq on RPC devices, then asks llama.cpp for the same split in a dry run
over loopback RPC workers (`ctxq.planning.split_dry`: nothing allocated, about a second at any width) and, with
`--real`, loads it for real too (a sparse model's weights sent over RPC: minutes at real widths). It prints, per
device, the planned compute, the dry run's, the pins the dry run loses (split inputs a real load computes on the
device, in the scheduler's copies), the dry run less those, and the real figure.

    .venv/bin/python scripts/split_dry_run.py mistral-nemo-12b --ctx 4096 --kv f16 --split 1:1
    .venv/bin/python scripts/split_dry_run.py llama4-scout-4l --ctx 65536 --kv q8_0 --split 1:1 --real
    .venv/bin/python scripts/split_dry_run.py path/to/model.gguf --ctx 16384 --split 2:1:1 --fa off

`--table` instead takes every dense-split cell of the real-width section of docs/accuracy-table.md (the arch-realistic
cells of scripts/accuracy.py, flash attention on) and prints each device's planned total and the dry run's
(planned total less planned compute plus the corrected dry run) against llama.cpp's real figure recorded there:

    .venv/bin/python scripts/split_dry_run.py --table

MODEL is a GGUF file, a dense geometry of `ctxq.testing.synthetic.GEOMETRIES` (written sparse under /tmp) or a
real-width header of `ctxq.testing.upstream_widths.REALISTIC`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def model_path(name: str) -> str:
    if Path(name).is_file():
        return name
    from ctxq.testing import upstream_widths
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    if name in upstream_widths.REALISTIC:
        return str(upstream_widths.build_realistic(name))
    if name in GEOMETRIES:
        out = Path(tempfile.gettempdir()) / f"ctxq-split-dry-{name}.gguf"
        if not out.exists():
            write_synthetic_gguf(out, GEOMETRIES[name])
        return str(out)
    sys.exit(f"split_dry_run: {name} is neither a file, a geometry nor a real-width model")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--table", action="store_true", help="the real-width cells of docs/accuracy-table.md")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--fa", choices=("on", "off"), default="on")
    ap.add_argument("--split", default="1:1", help="ratios, one per RPC device (each 64 GiB, so that it fits)")
    ap.add_argument("--real", action="store_true", help="also load it for real (slow at real widths)")
    a = ap.parse_args()
    if a.table:
        return table()
    if not a.model:
        ap.error("give a MODEL, or --table")

    from ctxq.gguf.info import model_info
    from ctxq.planning.split_dry import split_dry_run
    from ctxq.planning.memory.compute import load_source
    from ctxq.planning.devices import Device
    from ctxq.planning.planner import plan
    from ctxq.rpc import run_supervised, start_workers
    from ctxq.testing.accuracy import _measure_child
    from ctxq.units import GiB, MiB

    path = model_path(a.model)
    ratios = [float(x) for x in a.split.split(":")]
    devs = [Device(name=f"RPC{i}", kind="rpc", total=64 * GiB, usable=64 * GiB) for i in range(len(ratios))]
    p = plan(path, a.ctx, devices=devs, kv=a.kv, split=a.split, flash_attn=a.fa == "on")
    info = model_info(load_source(path))
    resid = info.n_embd * p.n_ubatch * 4
    kw = dict(n_ctx=a.ctx, n_gpu_layers=p.n_gpu_layers, tensor_split=ratios, type_k=p.type_k, type_v=p.type_v,
              flash_attn=p.flash_attn, n_ubatch=p.n_ubatch, n_batch=p.n_batch)
    with start_workers(len(ratios)) as w:
        dry = split_dry_run(path, w, resid=resid, **kw)
        real = None
        if a.real:
            real = run_supervised(_measure_child, path, {**kw, "swa_full": p.swa_full}, (), rpc=w.endpoints,
                                  workers=w, timeout=1800)["compute"]
    print(f"{Path(path).name}: {a.ctx} tokens, {p.type_k}/{p.type_v}, flash attention {a.fa}, split {a.split}, "
          f"layers per device {p.tensor_split}")
    print(f"{'device':8} {'planned':>10} {'dry run':>10} {'lost pins':>10} {'corrected':>10} {'real':>10}  MiB")
    planned = [g.compute for g in p.gpus] + [p.host.compute]
    for i, (d, pl) in enumerate(zip(dry, planned)):
        label = "CPU" if d.name == "CPU" else f"RPC{i}"
        r = "" if real is None else f"{(sum(v for k, v in real.items() if k.startswith('CPU')) if d.name == 'CPU' else real.get(d.name, 0)) / MiB:10.2f}"
        print(f"{label:8} {pl / MiB:10.2f} {d.compute / MiB:10.2f} {d.lost_bytes / MiB:10.2f} {d.corrected / MiB:10.2f} "
              f"{r}  {' '.join(d.lost_pins)}")
    return 0


# the arch-realistic cells with flash attention on (scripts/accuracy.py's ARCH_REALISTIC_CELLS)
TABLE_CELLS = [("rpc2", [1, 1], 16384, "f16"), ("rpc2", [1, 1], 65536, "q8_0"), ("rpc3", [2, 1, 1], 65536, "f16")]


def table() -> int:
    from ctxq.gguf.info import model_info
    from ctxq.planning.split_dry import split_dry_run
    from ctxq.planning.memory.compute import load_source
    from ctxq.planning.devices import Device
    from ctxq.planning.planner import plan
    from ctxq.rpc import start_workers
    from ctxq.testing import upstream_widths
    from ctxq.units import GiB, MiB

    doc = (Path(__file__).resolve().parent.parent / "docs" / "accuracy-table.md").read_text()
    section = doc.split("<!-- section arch-realistic -->")[1].split("<!-- section")[0]
    real = {}
    for line in section.splitlines():
        c = [x.strip() for x in line.split("|")]
        if len(c) > 8 and c[1] in upstream_widths.REALISTIC:
            real.setdefault((c[1], c[2], int(c[3]), c[4], c[5]), float(c[7]))
    print(f"{'model':16} {'devices':7} {'n_ctx':>6} {'KV':5} {'device':6} {'real MiB':>9} {'planned':>8} {'dry run':>8}")
    worst = [0.0, 0.0]
    for name in upstream_widths.REALISTIC:
        path = str(upstream_widths.build_realistic(name))
        info = model_info(load_source(path))
        for label, sizes, n_ctx, kv in TABLE_CELLS:
            devs = [Device(name=f"RPC{i}", kind="rpc", total=int(s * GiB), usable=int(s * GiB)) for i, s in enumerate(sizes)]
            p = plan(path, n_ctx, devices=devs, kv=kv, flash_attn=True, split=":".join(map(str, sizes)))
            with start_workers(len(sizes)) as w:
                dry = split_dry_run(path, w, n_ctx=n_ctx, n_gpu_layers=p.n_gpu_layers, tensor_split=[float(s) for s in sizes],
                                    type_k=p.type_k, type_v=p.type_v, flash_attn=True, n_ubatch=p.n_ubatch,
                                    n_batch=p.n_batch, resid=info.n_embd * p.n_ubatch * 4)
            for i, g in enumerate(p.gpus):
                r = real.get((name, label, n_ctx, kv, f"RPC{i}"))
                if r is None:
                    continue
                planned, got = g.buffers / MiB - r, (g.buffers - g.compute + dry[i].corrected) / MiB - r
                worst = [max(worst[0], abs(planned)), max(worst[1], abs(got))]
                print(f"{name:16} {label:7} {n_ctx:6} {kv:5} RPC{i:<3} {r:9.2f} {planned:+8.2f} {got:+8.2f}", flush=True)
    print(f"worst |error| MiB: planned {worst[0]:.2f}, dry run {worst[1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
