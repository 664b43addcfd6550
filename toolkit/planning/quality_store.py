"""The measurements `ctxq quality` keeps, as the planner reads them: JSON records, no numpy, no llama.cpp (a plan
of a file already measured stays fast)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
from dataclasses import asdict, dataclass, field

from ..paths import ctxq_home

METHOD = 3  # in every cache key and record: what the worker computes and how positions are scored


@dataclass
class Result:
    """One configuration measured against its reference on one text at one context."""

    model: str  # the file measured (its weights)
    type_k: str
    type_v: str
    mean_kl: float  # nats, KL(reference || this), over the scored positions
    p99_kl: float
    top1_agreement: float  # 0-1: the share of positions where both rank the same token first
    ppl: float  # this configuration's perplexity of the text at the scored positions
    bytes: int  # KV bytes per token of context (kv mode) or the file's size (weights mode)
    n_ctx: int
    n_scored: int
    text: str  # the text's file name, or "licences" (built in)
    text_sha256: str
    reference: str  # "f16/f16 cache" or the reference file's name
    mode: str = "kv"  # "kv" or "weights"
    llama_cpp: str = ""
    seconds: float = 0.0
    cached: bool = False
    model_id: list = field(default_factory=list)  # the model file's identity (path, size, mtime)
    method: int = METHOD

    @property
    def pair(self) -> str:
        return f"{self.type_k}/{self.type_v}"

    def public(self) -> dict:
        d = asdict(self)
        d.pop("model_id")
        d.pop("method")
        return d


def cache_dir():
    return ctxq_home() / "quality"


def file_id(path: str) -> list:
    """A model file's identity: its real path, size and modification time."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def records(model: str | os.PathLike, mode: str = "kv") -> list[dict]:
    """Every cached measurement of this model file (as it is now) in `mode` (kv: its cache pairs against f16;
    weights: its weights against a more precise file; whole: both against that file with an f16 cache), with this
    llama.cpp and method."""
    folder = cache_dir() / "results"
    try:
        ident = file_id(str(model))
    except OSError:  # not a local file (a Hub model planned from its header): nothing measured
        return []
    version = md.version("llama_cpp_python")
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if d.get("mode") == mode and d.get("model_id") == ident and d.get("llama_cpp") == version \
                and d.get("method") == METHOD:
            found.append(d)
    return found


def results(model: str | os.PathLike, mode: str = "kv") -> list[Result]:
    """`records` as `Result` objects."""
    return [Result(**d) for d in records(model, mode)]


def whole_cost(model: str, n_ctx: int, kv: dict) -> dict:
    """What the plan's weights and KV cache cost the answers together, as far as measured: `kv` is the plan's
    `kv_quality`; the weights' loss is this file's measurement against a more precise file (`ctxq quality
    --against`, or the fit that wrote it), the whole a measurement of the file at the plan's pair against that
    file with an f16 cache (`ctxq quality --against REF --whole`), else the sum of the two parts (predicted: the
    losses are close to additive, not exactly)."""
    if not kv:
        return {}
    pair = (kv["type_k"], kv["type_v"])
    whole = _best((r for r in results(model, "whole") if (r.type_k, r.type_v) == pair), n_ctx)
    weights = _best((r for r in results(model, "weights") if (r.type_k, r.type_v) == ("f16", "f16")), n_ctx)
    kv_kl = kv.get("mean_kl") if kv.get("measured") else kv.get("default_kl")
    out = {"kv": {"mean_kl": kv_kl, "measured": bool(kv.get("measured"))},
           "weights": _summary(weights) if weights else {"mean_kl": None, "measured": False}}
    if whole is not None:
        out["total"] = {**_summary(whole), "how": "measured"}
    elif weights is not None and kv_kl is not None:
        out["total"] = {"mean_kl": weights.mean_kl + kv_kl, "measured": False,
                        "how": "sum of the measured parts" if kv.get("measured") else
                        "the weights measured plus the pair's default loss"}
    return out


def _best(found, n_ctx: int):
    """The measurement at the context planned, else the longest (the loss grows with the context)."""
    return max(found, key=lambda r: (r.n_ctx == n_ctx, r.n_ctx), default=None)


def _summary(r: Result) -> dict:
    return {"mean_kl": r.mean_kl, "top1_agreement": r.top1_agreement, "measured": True, "reference": r.reference,
            "text": r.text, "n_ctx": r.n_ctx}


def describe_whole(q: dict, model: str, n_ctx: int) -> str | None:
    """`whole_cost` as the plan's second quality line; None when the weights were never measured and no hint
    helps (a Hub model)."""
    if not q:
        return None
    kv, w, total = q["kv"], q["weights"], q.get("total")
    kv_text = "KV not measured" if kv["mean_kl"] is None else \
        f"KV {kv['mean_kl']:.4f}{'' if kv['measured'] else ' (default table)'}"
    if total is not None and total["how"] == "measured":
        return (f"whole plan: mean KL {total['mean_kl']:.4f}, top-1 {100 * total['top1_agreement']:.1f} % against "
                f"{total['reference']}, measured on {total['text']} at {total['n_ctx']:,} tokens")
    if w["measured"] and total is None:
        return (f"weights: mean KL {w['mean_kl']:.4f} against {w['reference']} ({w['text']} at {w['n_ctx']:,} "
                f"tokens); {kv_text}: no sum")
    if not w["measured"]:
        from pathlib import Path

        if not Path(model).is_file():
            return None
        return (f"weights: not measured; measure them: ctxq quality {model} --ctx {n_ctx} --against MORE_PRECISE.gguf "
                "[--whole --kv PAIR: weights and cache together]")
    return (f"whole plan: mean KL ~{total['mean_kl']:.4f} = weights {w['mean_kl']:.4f} (against {w['reference']}, "
            f"{w['text']} at {w['n_ctx']:,} tokens) + {kv_text}; predicted: {total['how']}, not measured together")
