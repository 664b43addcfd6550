"""The referee: every plan's split-independent terms checked against llama.cpp's own accounting.

Before a plan is returned (`plan`, `run`, `serve`, `load` all go through `planner.plan_for`), its weights,
KV cache (per layer and in total), recurrent state and output buffer are compared with a metadata-only load
of the real header at the plan's context, batch and cache types (`llama.accounting`, cached per model and
settings). A difference beyond llama.cpp's printed rounding (0.005 MiB per printed size) is a bug in ctxq's
rules: with `CTXQ_REFEREE=strict` (the test suite sets it) it raises; otherwise the plan is made again with
the larger figure per layer and carries a one-line note saying so.

The split-dependent terms (compute buffers, graph-input copies) are not this referee's: llama.cpp's CPU dry run has
one device. A dry run of the plan's split over loopback RPC workers sizes them (`split_referee`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from ..errors import CtxqError
from ..gguf.info import ModelInfo, block_of, kv_per_token
from ..llama.accounting import PRINT_ROUNDING, Accounting
from ..units import MiB
from .memory.costs import kv_by_layer


class RefereeError(CtxqError):
    """The planner's figures and llama.cpp's accounting disagree (raised with CTXQ_REFEREE=strict)."""


@dataclass
class Finding:
    term: str  # "KV", "KV of layer 3", "recurrent state", "weights", "output buffer"
    planned: int  # bytes
    llama: int  # bytes, as llama.cpp accounts them

    @property
    def under(self) -> bool:
        return self.planned < self.llama

    def __str__(self) -> str:
        return f"{self.term} {self.planned / MiB:.2f} MiB planned, llama.cpp {self.llama / MiB:.2f}"


@dataclass
class Verdict:
    findings: list[Finding] = field(default_factory=list)

    @property
    def under(self) -> bool:
        return any(f.under for f in self.findings)

    def note(self) -> str:
        worst = max(self.findings, key=lambda f: abs(f.llama - f.planned))
        more = f" (and {len(self.findings) - 1} more)" if len(self.findings) > 1 else ""
        return f"llama.cpp's own accounting differs: {worst}{more}; the plan takes the larger figure"


def strict() -> bool:
    return os.environ.get("CTXQ_REFEREE", "") == "strict"


def judge(info: ModelInfo, acc: Accounting, *, n_ctx: int, n_ubatch: int, type_k: str, type_v: str,
          flash_attn: bool, skipped: int = 0, n_seq_max: int = 1) -> Verdict:
    """The differences between the plan's figures (from `info`) and llama.cpp's accounting `acc`, made at
    the same settings, beyond the printed rounding. `skipped`: bytes of the NextN blocks' tensors, which
    llama_model_size counts but a load leaves unallocated (TENSOR_SKIP)."""
    v = Verdict()
    planned = kv_by_layer(info, n_ctx, n_ubatch, type_k, type_v)
    real = acc.layer_kv(type_k, type_v, flash_attn)
    if acc.consistent():  # per layer, exact: both from llama.cpp's widths and cells
        v.findings += [Finding(f"KV of layer {il}", p, r) for il, (p, r) in enumerate(zip(planned, real)) if p != r]
    slack = 2 * len(acc.caches) * PRINT_ROUNDING
    printed = sum(c.k_bytes + c.v_bytes for c in acc.caches)
    if abs(sum(planned) - printed) > slack:
        v.findings.append(Finding("KV", sum(planned), printed))
    state = n_seq_max * sum(la.state_bytes for la in info.layers)  # one state per sequence (memory.costs)
    # the printed sizes' rounding, and the bytes planning.facts adds sharing their upper bound out per layer
    if abs(state - acc.state_bytes) > acc.state_printed * PRINT_ROUNDING + len(acc.recurrent):
        v.findings.append(Finding("recurrent state", state, acc.state_bytes))
    logits = n_seq_max * info.n_vocab * 4  # memory.costs: the host's logits, n_vocab f32 per sequence
    if abs(logits - acc.output_bytes) > PRINT_ROUNDING:
        v.findings.append(Finding("output buffer", logits, acc.output_bytes))
    weights = info.token_embd_bytes + info.output_bytes + info.other_bytes + sum(info.layer_bytes)
    if acc.model_bytes and weights + skipped != acc.model_bytes:
        v.findings.append(Finding("weights", weights, acc.model_bytes - skipped))
    return v


def larger(info: ModelInfo, acc: Accounting, *, n_ctx: int, n_ubatch: int, type_k: str, type_v: str,
           flash_attn: bool) -> ModelInfo:
    """`info` with llama.cpp's facts for each layer where its KV or state is larger than the rules'."""
    from .facts import with_facts

    theirs = with_facts(info, acc)
    if theirs is info:
        return info
    planned = kv_by_layer(info, n_ctx, n_ubatch, type_k, type_v)
    real = kv_by_layer(theirs, n_ctx, n_ubatch, type_k, type_v)
    layers = []
    for il, (mine, other) in enumerate(zip(info.layers, theirs.layers)):
        la = other if real[il] > planned[il] else mine
        if other.state_bytes > la.state_bytes:
            la = replace(la, recurrent=True, state_bytes=other.state_bytes)
        layers.append(la)
    out = replace(info, layers=layers, n_swa=max(info.n_swa, theirs.n_swa))
    out.kv_bytes_per_token = kv_per_token(out)
    return out


def refereed(p, src, info: ModelInfo, replan):
    """`p` checked against llama.cpp's accounting at its settings; `replan(info)` plans again with the
    larger figures when the plan's are below llama.cpp's. Strict mode raises on any difference."""
    from .memory.compute import notes_for

    p = _refereed(p, src, info, replan)
    p.notes += [n for n in notes_for(src) if n not in p.notes]  # the compute's fallbacks (an abort in a dry run)
    return p


def _refereed(p, src, info: ModelInfo, replan):
    from .facts import accounting_at

    acc = accounting_at(src, info, n_ctx=p.n_ctx, n_ubatch=p.n_ubatch, n_batch=p.n_batch, type_k=p.type_k,
                        type_v=p.type_v, flash_attn=p.flash_attn, **p.context_settings())
    settings = dict(n_ctx=p.n_ctx, n_ubatch=p.n_ubatch, type_k=p.type_k, type_v=p.type_v, flash_attn=p.flash_attn)
    mtp = {il for il, la in enumerate(info.layers) if la.mtp}
    skipped = sum(t.nbytes for t in src.tensors if block_of(t.name) in mtp) if mtp else 0
    v = judge(info, acc, skipped=skipped, n_seq_max=p.n_seq_max, **settings)
    if not v.findings:
        return p
    if strict():
        raise RefereeError(f"{info.arch}: the plan and llama.cpp's accounting disagree: "
                           + "; ".join(str(f) for f in v.findings[:4]))
    if v.under:  # `larger` reads one sequence's state (Accounting.state_per_layer divides by n_seq_max)
        p = replan(larger(info, acc, **settings))
    p.notes.append(v.note())
    return p
