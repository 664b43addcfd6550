"""ctxq: run long-context LLMs on the GPUs you own, with llama.cpp underneath.

    import ctxq
    plan = ctxq.plan("model.gguf", n_ctx=65536, gpus=[16, 16, 16, 8, 8])
    llm = ctxq.load("model.gguf", n_ctx=65536, kv="q8_0")
    answers = ctxq.ask("model.gguf", document, ["Who signed?", "When?"])  # the document read once

`plan()` and `load()` take the plan's settings as keywords (the fields of `PlanOptions`, the same
words as llama.cpp: n_ctx, type_k, flash_attn, n_batch, ...) or as one `options=PlanOptions(...)`.

Names are imported lazily so that `import ctxq` stays fast and does not load llama.cpp.
"""

from .errors import CtxqError

__all__ = ["load", "plan", "convert", "inspect", "ask", "Engine", "SamplingParams", "Plan", "PlanOptions", "Device",
           "CtxqError"]

_LAZY = {
    "load": ("ctxq.runtime.runner", "load"),
    "plan": ("ctxq.planning.planner", "plan"),
    "Plan": ("ctxq.planning.plan", "Plan"),
    "PlanOptions": ("ctxq.planning.options", "PlanOptions"),
    "Device": ("ctxq.planning.devices", "Device"),
    "convert": ("ctxq.conversion.convert", "convert"),
    "inspect": ("ctxq.models", "inspect"),
    "ask": ("ctxq.runtime.many", "ask"),
    "Engine": ("ctxq.runtime.engine", "Engine"),
    "SamplingParams": ("ctxq.runtime.engine", "SamplingParams"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'ctxq' has no attribute {name!r}")
