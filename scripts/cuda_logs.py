"""ctxq's predictions next to the buffers that public CUDA load logs printed.

    .venv/bin/python scripts/cuda_logs.py [--logs ../shared/data/cuda-logs-public.jsonl]

For each log whose parameters are complete enough, it writes a synthetic GGUF of the model's geometry
(`ctxq.testing.synthetic`), plans it with the log's n_ctx, split, KV types, flash attention and ubatch
(`ctxq.planning.planner.plan`, whose compute comes from llama.cpp's CPU dry run), adds the CUDA terms of
`ctxq.planning.memory.cuda` for this llama.cpp version, and prints one Markdown row per log: KV and compute per
device (printed / predicted, MiB), CUDA_Host compute, the CUDA terms, the build and why an entry is left out.
Sizes in the logs are MiB as printed; the geometry of each model is the one its Hugging Face config gives.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
from pathlib import Path

from ctxq.gguf.info import model_info
from ctxq.gguf.reader import TensorInfo, tensor_nbytes
from ctxq.planning.memory import cuda
from ctxq.planning.planner import plan
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf
from ctxq.units import MiB

DEFAULT_LOGS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cuda-logs-public.jsonl"
L8, L70 = GEOMETRIES["llama3-8b"], GEOMETRIES["llama3-70b"]
# Logs whose model ctxq can rebuild: (source fragment, n_ctx) -> geometry, planner arguments, assumptions.
# `old_fa`: the build predates the FA f16 copies in the compute buffer (ggml sync of 2026-06, llama.cpp
# PR #23907): they came from the pool then, so the term is shown but not added to the printed compute.
KNOWN = {
    ("logdetective/pull/106", 2048): dict(
        geometry=L8.scaled(name="Mistral-7B-like", n_vocab=32000), gpus="24", split=None, old_fa=True,
        assume="geometry inferred: KV 4096 MiB at 32k = 32 layers x 1024 wide; n_head 32 from the KQ step"),
    ("llama.cpp/issues/11200", 32768): dict(
        geometry=GEOMETRIES["qwen2.5-7b"].scaled(name="Qwen2.5-32B", n_layer=64, n_embd=5120, n_head=40,
                                                 n_head_kv=8, n_ff=27648), gpus="24,24", split="10:6", old_fa=True,
        assume="Q4_K_M weights stand in for Q8_0 (compute and KV do not depend on them)"),
    ("ollama/issues/8922", None): dict(
        geometry=L70, gpus="24,24,24", split="27,27,27", old_fa=True, n_ctx=8192, n_ubatch=512,
        flash_attn=False, assume="n_ctx 8192 from KV (27 layers x 32 MiB), ubatch 512 (ollama), FA off"),
    ("ollama/issues/10553", None): dict(
        geometry=L70, gpus="24,24", split="49,32", old_fa=True, n_ctx=4096, n_ubatch=512, flash_attn=True,
        assume="FA on (flat compute), ubatch 512 (ollama); Llama-3 vocabulary assumed"),
    ("koboldcpp/issues/1882", 150272): dict(
        geometry=L8.scaled(name="Mistral-Small-24B", n_layer=40, n_embd=5120, n_ff=32768, n_vocab=131072),
        gpus="24,24", split="1:1", old_fa=True, assume="geometry of Mistral-Small-24B (its config)"),
}
KNOWN[("logdetective/pull/106", 32768)] = KNOWN[("logdetective/pull/106", 2048)]
LEFT_OUT = {  # source fragment -> why no prediction
    "llama.cpp/issues/13661": "row split (ctxq plans layer split); Kepler K80",
    "issues/9390": "excerpt without compute lines; MLA-less DeepSeek2 geometry not buildable",
    "ik_llama.cpp/issues/514": "qwen3moe (MoE) geometry not in ctxq's synthetic models",
    "pull/6122": "Command-R architecture not in ctxq's synthetic models; CUDA1 compute cut",
    "pull/15860": "model not named; used for the reserve (unaccounted 451-456 MiB)",
    "dfch": "GLM-5.2 (DSA indexer, CPU experts) not buildable; used for the reserve (703-714 MiB)",
    "quantzhai": "custom KV type turbo3",
    "ironhands": "hybrid recurrent architecture not buildable",
    "llama.cpp/pull/8035": "weight types unknown (~2.7 bits/weight); unified-memory experiment",
    "ollama/issues/5091": "KV types and compute lines cut",
    "issues/14752": "model buffers only",
    "junweil": "model buffers only",
    "2026-05-14 server log": "compute lines not in the excerpt",
    "Japanese tuning log": "model not named",
    "issues/23679": "hybrid MoE (Qwen3.6) not buildable",
    "issues/19437": "hybrid MoE (Qwen3-Coder-Next) not buildable",
}


def _reason(e: dict) -> str:
    fork = e.get("fork") or ""
    if fork.startswith("ik_llama.cpp") or fork.startswith("TurboQuant"):
        return f"fork {fork}: its own graph and buffers"
    for frag, why in LEFT_OUT.items():
        if frag in e["source"]:
            return why
    if "Panchovix" in e["source"]:
        return "in kind: see the -ot ffn=CPU row"
    return "parameters incomplete"


def _fa_on(value) -> bool:
    return value not in (0, None, False, "off", "disabled")


def _mib(x) -> str:
    """A printed size; a failed allocation prints as the size it asked for ("alloc of 12710.31 failed")."""
    if isinstance(x, str):
        m = re.search(r"(\d+(?:\.\d+)?)", x)
        return f"needed {float(m.group(1)):.0f}" if m else "?"
    return f"{x:.0f}" if isinstance(x, (int, float)) else "?"


def predict(e: dict, recipe: dict, workdir: Path) -> dict:
    """Plan the entry's model with its parameters; per device KV and compute (planner + CUDA terms)."""
    p = e["params"]
    n_ctx = recipe.get("n_ctx") or p["n_ctx"]
    n_ubatch = recipe.get("n_ubatch") or p["n_ubatch"]
    fa = recipe.get("flash_attn", _fa_on(p.get("flash_attn")))
    tk, tv = p.get("type_k", "f16"), p.get("type_v", "f16")
    g = recipe["geometry"]
    path = workdir / f"{g.name}.gguf"
    if not path.exists():
        write_synthetic_gguf(path, g)
    info = model_info(path)
    pl = plan(path, n_ctx, gpus=recipe["gpus"], split=recipe["split"], type_k=tk, type_v=tv, flash_attn=fa,
              n_ubatch=n_ubatch, n_batch=max(p.get("n_batch") or 512, n_ubatch))
    rows = []
    for i, dp in enumerate(pl.gpus):
        layers = [il for il in dp.layers if il < info.n_layer]
        t = cuda.cuda_device_terms(info, n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=tk, type_v=tv, flash_attn=fa,
                                   layers=layers, has_output=info.n_layer in dp.layers, first=i == 0)
        in_buffer = t.offload_copies + (0 if recipe["old_fa"] else t.fa_kv_copies)
        rows.append(dict(kv=dp.kv / MiB, compute=(dp.compute + in_buffer) / MiB, terms=t))
    return dict(devices=rows, host=pl.host.compute / MiB, n_ctx=n_ctx, n_ubatch=n_ubatch, fa=fa)


def _row(k: int, e: dict, pred: dict | None, why: str = "") -> str:
    b = e["buffers_mib"]
    gpus = sorted((n for n in b if n.startswith("CUDA") and "_" not in n), key=lambda n: int(n[4:]))
    build = e.get("fork") or e.get("llama_cpp_version") or "?"
    src = e["source"].split("://")[-1][:48]
    if pred is None:
        return f"| {k} | {src} | {build[:40]} | | | | | left out: {why} |"
    kv = ", ".join(f"{_mib(b[n].get('KV'))}/{d['kv']:.0f}" for n, d in zip(gpus, pred["devices"]))
    comp = ", ".join(f"{_mib(b[n].get('compute'))}/{d['compute']:.0f}" for n, d in zip(gpus, pred["devices"]))
    host = f"{_mib(b.get('CUDA_Host', {}).get('compute'))}/{pred['host']:.0f}"
    terms = ", ".join(f"fa {d['terms'].fa_kv_copies / MiB:.0f} pool {d['terms'].pool / MiB:.0f}"
                      for d in pred["devices"])
    return f"| {k} | {src} | {build[:40]} | {kv} | {comp} | {host} | {terms} | {why} |"


def panchovix_row(e: dict) -> str:
    """The -ot ffn=CPU log in kind: CUDA0 = the other cards' compute + one expert tensor copied in.
    DeepSeek-V3's largest host weights are ffn_{gate,up,down}_exps, 256 x 7168 x 2048 values; the log does
    not say which types UD-Q2_K_XL gives them, so the range over Q3_K..Q6_K is shown."""
    from gguf.constants import GGMLQuantizationType as T

    b = e["buffers_mib"]
    copies = {}
    for ty in (T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        shape = (7168, 2048, 256)
        t = TensorInfo("blk.3.ffn_down_exps.weight", shape, int(ty), 0, tensor_nbytes(int(ty), shape))
        copies[ty.name] = cuda.cuda_nbytes(t) / MiB
    lo, hi = min(copies.values()), max(copies.values())
    others = b["CUDA1"]["compute"]
    return (f"| 5 | Panchovix DeepSeek-V3 (-ot ffn=CPU) | mainline | | CUDA0 {b['CUDA0']['compute']:.0f} vs "
            f"{others:.0f} on CUDA1-3 (+{b['CUDA0']['compute'] - others:.0f}) | | offload {lo:.0f}-{hi:.0f} "
            f"(one expert tensor, Q3_K-Q6_K) on CUDA0 only | in kind: predicted CUDA0 {others + lo:.0f}-"
            f"{others + hi:.0f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--logs", type=Path, default=DEFAULT_LOGS, help="JSONL of public CUDA load logs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    entries = [json.loads(line) for line in args.logs.read_text().splitlines() if line.strip()]
    print("| # | source | build / fork | KV per GPU, printed/predicted | compute per GPU, printed/predicted "
          "| CUDA_Host compute | CUDA terms (MiB) | note |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for k, e in enumerate(entries):
            n_ctx = e["params"].get("n_ctx")
            recipe = next((r for (frag, c), r in KNOWN.items() if frag in e["source"] and c in (n_ctx, None)), None)
            if "Panchovix" in e["source"]:
                print(panchovix_row(e))
            elif recipe is None:
                print(_row(k, e, None, _reason(e)))
            else:
                pred = predict(e, recipe, Path(tmp))
                shown_apart = recipe["old_fa"] and any(d["terms"].fa_kv_copies for d in pred["devices"])
                note = recipe["assume"] + ("; FA copies were pool memory in this build: shown, not added"
                                           if shown_apart else "")
                print(_row(k, e, pred, note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
