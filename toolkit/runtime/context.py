"""The llama.cpp context an engine makes from a loaded model: the model's planned settings, one
unified KV cache for many sequences."""

from __future__ import annotations

from ..errors import InvalidOption
from ..llama import backend

# Context fields an engine never takes from the loaded Llama: callbacks and samplers belong to that
# context, and these three are what the engine is for.
_CALLBACKS = {"cb_eval", "cb_eval_user_data", "abort_callback", "abort_callback_data", "samplers", "n_samplers",
              "ctx_other"}
_NOT_COPIED = _CALLBACKS | {"n_seq_max", "kv_unified", "n_outputs_max"}


def context_params(llm, n_seq_max: int, n_ctx: int | None, overrides: dict):
    """The loaded Llama's context settings (its plan's type_k, flash_attn, n_batch, threads, ...)
    with a unified KV cache for `n_seq_max` sequences. One output per sequence per step is all the
    engine reads, so `n_outputs_max = n_seq_max` (llama.cpp's default of n_batch reserves logits for a
    whole batch: `llama_context::output_reserve`)."""
    lc = backend.llama_cpp()
    cp = lc.llama_context_default_params()
    src = llm.context_params
    for name, _ in type(cp)._fields_:
        if name not in _NOT_COPIED:
            setattr(cp, name, getattr(src, name))
    cp.n_ctx = n_ctx or llm.n_ctx()
    cp.n_seq_max, cp.kv_unified, cp.n_outputs_max = n_seq_max, True, n_seq_max
    known = {n for n, _ in type(cp)._fields_} - _CALLBACKS
    for key, value in overrides.items():
        if key not in known:
            raise InvalidOption(f"{key} is not a llama.cpp context setting", option=key, value=value)
        setattr(cp, key, value)
    return cp
