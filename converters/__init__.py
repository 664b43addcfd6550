"""Hugging Face checkpoint converters: one small module per architecture family, registered by the
names in a checkpoint's `config.json` `architectures` list."""

from __future__ import annotations

import importlib

from ..errors import ConversionError
from .base import Family

FAMILIES: dict[str, Family] = {}
_MODULES = ("llama", "qwen", "gemma", "phi3", "gpt_oss", "qwen35", "glm4moe", "smollm3", "lfm2", "granite_hybrid",
            "nemotron_h", "gemma4")


def register(family: Family, *hf_names: str) -> Family:
    for name in hf_names:
        FAMILIES[name] = family
    return family


def _load_all() -> None:
    for m in _MODULES:
        importlib.import_module(f"{__name__}.{m}")


def supported() -> list[str]:
    _load_all()
    return sorted(FAMILIES)


def knows(config: dict) -> bool:
    """Whether a native converter is registered for one of the config's `architectures`."""
    _load_all()
    return any(name in FAMILIES for name in config.get("architectures") or [])


def family_for(config: dict) -> tuple[str, Family]:
    """The family for a config's `architectures` entry, or a one-line error naming what is supported."""
    _load_all()
    names = config.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return name, FAMILIES[name]
    got = ", ".join(names) or "none listed"
    raise ConversionError(f"architecture {got} is not supported by ctxq convert; supported: {', '.join(supported())}")
