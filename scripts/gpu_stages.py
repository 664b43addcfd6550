"""The checks of scripts/gpu_check.py (issue 14), each a function of (out dir, Stage) -> a JSON-able dict.

Everything that touches CUDA runs in a child process (`ctxq.rpc.run_supervised`, or `ctxq worker`
processes), so that each measurement has its own CUDA context and NVML can tell processes apart;
the parent hides the GPU from itself (`hide_gpu()`) and only samples NVML.

Also what gpu_check.py and gpu_runs.py both use: a stage's time budget (`Stage`, `StageTimeout`) and
SmolLM2's carried header. Both import this module; it imports neither (tests/test_layout.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpu_nvml import Reading, Sampler

_GPU_ENV = "GPU_CHECK_CUDA_VISIBLE"  # the parent's CUDA_VISIBLE_DEVICES before hide_gpu()
PLACEMENTS = ("gpu", "partial")
PARTIAL_FRACTION = 0.6  # "some layers on the CPU": the GPU limited to 60 % of the all-GPU plan


class StageTimeout(Exception):
    """A stage ran out of its time between two of its steps."""


@dataclass
class Stage:
    name: str
    allotted_s: float
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)

    def __post_init__(self):
        self.started = self.clock()

    def left(self) -> float:
        return self.allotted_s - (self.clock() - self.started)

    def check(self, need_s: float = 0.0) -> None:
        """Raise StageTimeout when less than need_s is left (call between steps)."""
        if self.left() < need_s:
            raise StageTimeout(f"{self.name}: {self.allotted_s:.0f} s used up")


def hide_gpu() -> None:
    """Keep CUDA out of this process (its context would sit in every NVML reading); children get it back."""
    os.environ.setdefault(_GPU_ENV, os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def gpu_env() -> dict:
    """The environment for a child that should see the GPU."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get(_GPU_ENV, "0")}


@contextlib.contextmanager
def _child_sees_gpu(visible: bool = True):
    """run_supervised's children copy os.environ at start: set it for the spawn, then restore it."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get(_GPU_ENV, "0") if visible else ""
    try:
        yield
    finally:
        os.environ["CUDA_VISIBLE_DEVICES"] = old


def supervised(fn, *args, sampler: Sampler | None, timeout: float, gpu: bool = True) -> tuple[dict, int | None]:
    """`fn(*args)` in a child, sampled; (its result, its pid from its first `report`)."""
    from ctxq.rpc import run_supervised

    pid: list[int] = []
    with _child_sees_gpu(gpu), (sampler or contextlib.nullcontext()):
        res = run_supervised(fn, *args, timeout=timeout,
                             on_message=lambda m: pid.append(m["pid"]) if "pid" in m else None)
    return res, (pid[0] if pid else None)


def random_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """Prompt tokens for a model without a real vocabulary (the synthetic GGUFs): values do not matter."""
    rng = random.Random(seed)
    return [rng.randrange(1, n_vocab) for _ in range(n)]


# --- child side --------------------------------------------------------------------------------

@contextlib.contextmanager
def llama_lines():
    """llama.cpp's log lines printed in the block, from the `ctxq.llama_cpp` logger that ctxq's backend
    sends every line to. Not `backend.capture_log()`: its blocks nest badly (a sink is removed from the
    list by equality, so an inner block that saw the same lines removes the outer one's)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("ctxq.llama_cpp"), Collect(logging.DEBUG)
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _alloc_dict(lines: list[str]) -> dict:
    from ctxq.llama import backend

    a = backend.parse_allocations(lines)
    return {"model": a.model, "kv": a.kv, "compute": a.compute, "output": a.output,
            "layers": {str(k): v for k, v in a.layers.items()}}


def cell_child(model: str, n_ctx: int, kv: str, placement: str, n_prefill: int) -> dict:
    """Plan for the GPU this process sees (placement "gpu": all layers on it; "partial": the GPU capped so
    that some go to the CPU; "cpu": no GPU, for a check without one), load as planned, prefill n_prefill tokens; the plan, llama.cpp's printed buffers, timings."""
    import dataclasses

    from ctxq.errors import CtxqError
    from ctxq.llama import backend
    from ctxq.planning.devices import detect_gpus
    from ctxq.planning.planner import plan
    from ctxq.rpc import report
    from ctxq.runtime import runner

    report({"pid": os.getpid()})
    gpus = [d for d in detect_gpus() if d.kind == "gpu"]
    if not gpus and placement != "cpu":
        raise CtxqError("llama.cpp sees no CUDA device in this process")
    p = plan(model, n_ctx, devices=gpus[:1] if placement != "cpu" else [], kv=kv)
    if placement == "partial":
        capped = dataclasses.replace(gpus[0], usable=int(p.gpus[0].total * PARTIAL_FRACTION))
        p = plan(model, n_ctx, devices=[capped], kv=kv)
    with llama_lines() as lines:
        llm, memory, load_s = runner.load_plan(p)
    try:
        lc = backend.llama_cpp()
        t0 = time.perf_counter()
        llm.eval(random_tokens(n_prefill, llm.n_vocab()))
        lc.llama_synchronize(llm.ctx)
        prefill_s = time.perf_counter() - t0
    finally:
        llm.close()
    return {"plan": p.to_dict(), "printed": _alloc_dict(lines), "memory": [vars(m) for m in memory],
            "load_s": load_s, "prefill_s": prefill_s, "n_prefill": n_prefill, "log": lines}


def rpc_run_child(model: str, rpc: str, n_ctx: int, n_prompt: int, n_predict: int) -> dict:
    """`ctxq run --ctx n_ctx --split auto --rpc ...` through the library (a synthetic model has no
    tokenizer, so the prompt is tokens): plan, printed buffers, timings."""
    from ctxq.gguf.info import model_info
    from ctxq.rpc import report
    from ctxq.runtime import runner

    report({"pid": os.getpid()})
    toks = random_tokens(n_prompt, model_info(model).n_vocab)
    with llama_lines() as lines:
        r = runner.run(model, tokens=toks, n_ctx=n_ctx, rpc=rpc, split="auto", n_predict=n_predict, temp=0.0)
    d = r.to_dict()
    d.pop("text", None)
    return {**d, "printed": _alloc_dict(lines)}


def plain_child(model: str, text: str, n_ctx: int, n_predict: int) -> dict:
    """A plain `Llama` with the kwargs ctxq's plan gives (runner.llama_params): prefill, greedy decode."""
    from ctxq.rpc import generate_greedy, report
    from ctxq.runtime import runner

    report({"pid": os.getpid()})
    kw = runner.llama_params(runner.make_plan(model, n_ctx))
    g = generate_greedy(model, text, n_predict, **kw)
    return {"n_prompt": g.n_prompt, "n_generated": len(g.tokens), "prefill_s": g.prefill_s, "decode_s": g.decode_s,
            "prefill_tps": g.prefill_tps, "decode_tps": g.decode_tps}


# --- parent side: comparisons --------------------------------------------------------------------

def _host_names(names) -> list[str]:
    return [n for n in names if n.startswith("CPU") or n.endswith("_Host")]


def compare_cell(res: dict, nvml_peak: int | None) -> dict:
    """Planned vs printed vs NVML for the GPU and the host of one cell (bytes)."""
    pr, gp = res["printed"], res["plan"]["gpus"]
    g = gp[0] if gp else {"weights": 0, "kv": 0, "compute": 0, "margin": 0, "total": 0, "layers": []}
    dev = "CUDA0"
    printed = {k: pr[src].get(dev, 0) for k, src in (("weights", "model"), ("kv", "kv"), ("compute", "compute"))}
    printed_total = sum(printed.values())
    h = res["plan"]["host"]
    names = {n for d in (pr["model"], pr["kv"], pr["compute"], pr["output"]) for n in d}
    # CPU_REPACK holds re-laid-out copies of weights that stay mapped (as ctxq.testing.accuracy counts them)
    host = [n for n in _host_names(names) if n != "CPU_REPACK"]
    host_printed = {k: sum(pr[src].get(n, 0) for n in host)
                    for k, src in (("weights", "model"), ("kv", "kv"), ("compute", "compute"), ("output", "output"))}
    host_printed["repack"] = pr["model"].get("CPU_REPACK", 0)
    on_gpu = sum(1 for d in pr["layers"].values() if d == dev)
    return {
        "gpu_planned": {k: g[k] for k in ("weights", "kv", "compute", "margin")},
        "gpu_planned_total": g["total"], "gpu_printed": printed, "gpu_printed_total": printed_total,
        "nvml_peak": nvml_peak,
        "unaccounted": nvml_peak - printed_total if nvml_peak is not None else None,
        "fits": nvml_peak <= g["total"] if nvml_peak is not None else None,
        "error_printed": g["total"] - g["margin"] - printed_total,
        "host_planned": {k: h[k] for k in ("weights", "kv", "compute")}, "host_printed": host_printed,
        "layers_planned_gpu": len(g["layers"]), "layers_printed_gpu": on_gpu,
    }


def compare_workers(res: dict, workers: list[dict], sampler: Sampler) -> list[dict]:
    """Per worker: declared, planned (plan total), printed (llama.cpp's buffers), NVML peak, headroom."""
    by_ep = {g["device"]["endpoint"]: g for g in res["plan"]["gpus"]}
    printed = {m["name"]: m["reported"] for m in res["memory"]}
    rows = []
    for w in workers:
        g = by_ep.get(w["endpoint"], {})
        name = g.get("device", {}).get("name")
        peak = sampler.peak_of(w["pid"])
        rows.append({"endpoint": w["endpoint"], "pid": w["pid"], "declared": w["declared"],
                     "planned_total": g.get("total"), "layers": len(g.get("layers", [])),
                     "printed": printed.get(name), "nvml_peak": peak,
                     "headroom": w["declared"] - peak if peak is not None else None,
                     "exceeded": peak > w["declared"] if peak is not None else None})
    return rows


def nvml_or_fake() -> tuple[callable, str | None]:
    """The real NVML reader for GPU 0, or a reader of zeros and the reason (no driver)."""
    from gpu_nvml import nvml_reader

    try:
        return nvml_reader(0), None
    except Exception as e:
        return (lambda: Reading(0, {})), f"NVML unavailable ({type(e).__name__}: {e})"


def write_log(path: Path, title: str, lines: list[str]) -> None:
    with open(path, "a") as f:
        f.write(f"\n===== {title} =====\n")
        f.write("\n".join(lines) + "\n")


# --- SmolLM2: carry the header, rebuild the file ---------------------------------------------------

def smollm2_header(dest: Path, model=None) -> Path:
    """SmolLM2's GGUF up to its tensor data (metadata, tokenizer, tensor table), and a .json with the
    full file size, so that `rebuild_with_random_weights` can make a loadable file of the same layout."""
    from ctxq.gguf.reader import read_gguf
    from ctxq.models import resolve_model

    src = read_gguf(resolve_model(model))
    with open(src.path, "rb") as f:
        dest.write_bytes(f.read(src.data_offset))
    dest.with_suffix(".json").write_text(json.dumps({"file_size": src.file_size, "source": src.path.name}))
    return dest


def rebuild_with_random_weights(header: Path, dest: Path, seed: int = 0) -> Path:
    """A full-size GGUF from a carried header: norms 1.0, quantized blocks with random values of about
    SmolLM2's weight scale (|w| < 0.08), other types zero. Speed depends on types and shapes, not values;
    random values keep the greedy decode from sitting on one token (all zeros would pick token 0, EOS)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType as T

    from ctxq.gguf.reader import read_gguf

    size = json.loads(header.with_suffix(".json").read_text())["file_size"]
    dest.write_bytes(header.read_bytes())
    with open(dest, "r+b") as f:
        f.truncate(size)
    g = read_gguf(dest, skip_arrays=True)
    rng = np.random.default_rng(seed)
    blocks = {T.Q4_1: ([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)], 0.01, -0.075),
              T.Q8_0: ([("d", "<f2"), ("qs", "i1", 32)], 0.002, None)}
    with open(dest, "r+b") as f:
        for t in g.tensors:
            f.seek(g.data_offset + t.offset)
            if t.type == T.F32:
                f.write(np.ones(t.n_elements, "<f4").tobytes())
            elif t.type in blocks:
                fields, d, m = blocks[T(t.type)]
                a = np.zeros(t.nbytes // np.dtype(fields).itemsize, fields)
                a["d"] = d
                if m is not None:
                    a["m"] = m
                a["qs"] = rng.integers(0 if m is not None else -30, 256 if m is not None else 31, a["qs"].shape)
                f.write(a.tobytes())
    return dest
