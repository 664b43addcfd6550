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


def records(model: str | os.PathLike) -> list[dict]:
    """Every cached KV measurement of this model file (as it is now), with this llama.cpp and method."""
    folder = cache_dir() / "results"
    ident = file_id(str(model))
    version = md.version("llama_cpp_python")
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if d.get("mode") == "kv" and d.get("model_id") == ident and d.get("llama_cpp") == version \
                and d.get("method") == METHOD:
            found.append(d)
    return found


def results(model: str | os.PathLike) -> list[Result]:
    """`records` as `Result` objects."""
    return [Result(**d) for d in records(model)]
