"""Quality: what a precision saving (a KV-cache type, a weight type) costs the answers, measured.

Names are imported when first used: the planner reads what they measured (`planning.quality_store`) without them."""

__all__ = ["Measurement", "QualityError", "Result", "builtin_text", "measure", "parse_pairs", "results"]


def __getattr__(name: str):
    if name in __all__:
        from . import measurement as _measure

        return getattr(_measure, name)
    raise AttributeError(f"module 'ctxq.quality' has no attribute {name!r}")
