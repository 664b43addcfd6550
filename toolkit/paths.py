"""Where ctxq keeps its files: one folder, read from the environment when asked (not at import)."""

from __future__ import annotations

import os
from pathlib import Path


def ctxq_home() -> Path:
    """`CTXQ_HOME`, else `$XDG_CACHE_HOME/ctxq`, else `~/.cache/ctxq`; read when called."""
    if os.environ.get("CTXQ_HOME"):
        return Path(os.environ["CTXQ_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ctxq"
