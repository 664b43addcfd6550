"""Per-layer facts from llama.cpp's own accounting, for architectures ctxq has no verified rules for.

`gguf.info.model_info` reads a layer's kind, KV widths and recurrent state from per-architecture rules
(SWA_RULES, RECURRENT_RULES, MTP_ARCHS). Those rules are kept where they were measured against llama.cpp
(VERIFIED_ARCHS: the families of docs/accuracy-table.md); they are the fast path, needing no dry run. For
every other architecture the layers' KV caches, sliding windows, KV sharing and recurrent state come from
llama.cpp's metadata-only load of the real header (`llama.accounting`), cached per model file.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..errors import CtxqError
from ..gguf.info import RECURRENT_RULES, ModelInfo, kv_per_token
from ..gguf.reader import GGUFFile
from ..llama.accounting import Accounting, accounting
from .derived import load_error, model_path

log = logging.getLogger(__name__)

# Architectures whose rules in gguf.info were checked against llama.cpp's real allocations
# (docs/accuracy-table.md: the dense, hybrid and MoE sections).
VERIFIED_ARCHS = frozenset({"llama", "qwen2", "gemma2", "phi3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next",
                            "gpt-oss", "lfm2", "granitehybrid", "nemotron_h"})


def verified(info: ModelInfo) -> bool:
    """The model's per-layer facts come from verified rules (no dry run needed)."""
    return info.arch in VERIFIED_ARCHS


def accounting_at(src: GGUFFile, info: ModelInfo, **settings) -> Accounting:
    """llama.cpp's accounting of src at these settings (llama.accounting's keywords); a model llama.cpp
    cannot load is one line naming its architecture and llama.cpp's reason."""
    try:
        return accounting(model_path(src), **settings)
    except CtxqError as e:
        if (err := load_error(src, e)) is e:
            raise
        raise err from e


def facts_for(src: GGUFFile, info: ModelInfo, *, n_ctx: int, n_ubatch: int, n_batch: int,
              flash_attn: bool) -> Accounting:
    """llama.cpp's accounting at the plan's context, with an f16 cache (its widths hold for every type)."""
    return accounting_at(src, info, n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch, type_k="f16",
                         type_v="f16", flash_attn=flash_attn)


def with_facts(info: ModelInfo, acc: Accounting) -> ModelInfo:
    """`info` with each layer's attention, sliding window, KV widths and recurrent state as llama.cpp
    accounts them; the weights stay those of the tensor index (exact). A recurrent rule, where the
    architecture has one, keeps its exact state bytes; otherwise llama.cpp's printed total is shared out."""
    if acc.n_layer != info.n_layer:
        log.info("llama.cpp counts %d layers, the header %d: facts not applied", acc.n_layer, info.n_layer)
        return info
    rule_state = info.arch in RECURRENT_RULES
    per_state = acc.state_per_layer()
    recurrent = set(acc.recurrent)
    layers = []
    for il, la in enumerate(info.layers):
        if la.mtp:
            layers.append(la)
            continue
        attn = acc.attention(il)
        own = acc.cache_of(il) is not None
        rec = il in recurrent
        layers.append(replace(
            la, attention=attn, sliding=attn and acc.sliding(il), recurrent=rec,
            n_head_kv=la.n_head_kv if attn else 0,
            state_bytes=(la.state_bytes if rule_state and la.recurrent else per_state) if rec else 0,
            k_width=acc.n_embd_k_gqa[il] if own else 0,
            # accounted at the plan's flash attention: without it a transposed V pads to the widest layer
            v_width=acc.v_width(il, acc.flash_attn) if own else 0))
    out = replace(info, layers=layers, n_swa=acc.n_swa if any(la.sliding for la in layers) else 0)
    out.kv_bytes_per_token = kv_per_token(out)
    return out


def model_facts(src: GGUFFile, info: ModelInfo, *, n_ctx: int, n_ubatch: int, n_batch: int,
                flash_attn: bool) -> ModelInfo:
    """The verified rules' facts, else llama.cpp's (one cached dry run)."""
    if verified(info):
        return info
    acc = facts_for(src, info, n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch, flash_attn=flash_attn)
    return with_facts(info, acc)
