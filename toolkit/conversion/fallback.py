"""Conversion through llama.cpp's own `convert_hf_to_gguf.py`, for architectures ctxq has no native
converter for.

The converter is the one of the llama.cpp that llama-cpp-python vendors (`ctxq.conversion.upstream`,
fetched once from its sdist on PyPI), so it writes what the runtime loads. It runs in a child process
(it imports torch and transformers, and holds tensors the way it likes) into ctxq's temporary file;
`ctxq.conversion.convert` then checks the result loads, renames it into place or quantizes it with
ctxq's quantizer and quality gate, as for native conversions.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

from ..converters import supported
from ..converters.checkpoint import Checkpoint
from ..errors import ConversionError
from .tensors import Progress

log = logging.getLogger(__name__)

# the packages convert_hf_to_gguf.py imports at its top (torch, transformers) or for SentencePiece vocabularies
_NEEDS = ("torch", "transformers")
_INSTALL = "pip install 'ctxq[convert-any]'"
_MAP_ENTRY = re.compile(r'^\s*"(\w+)":\s*"\w+",?\s*$', re.M)  # conversion/__init__.py TEXT_MODEL_MAP lines


def tag() -> str:
    """What identifies this converter's output in conversion keys: the vendored llama.cpp's version."""
    from .upstream import llama_cpp_python_version

    return f"llama.cpp convert_hf_to_gguf.py of llama-cpp-python {llama_cpp_python_version()}"


def known_architectures(folder: Path | None = None) -> set[str]:
    """The Hugging Face architectures llama.cpp's converter registers (conversion/__init__.py maps each
    to its module); read as text, since importing it needs torch."""
    from .upstream import converter_dir

    text = ((folder or converter_dir()) / "conversion" / "__init__.py").read_text(encoding="utf-8")
    return set(_MAP_ENTRY.findall(text))


def missing_packages(ckpt: Checkpoint) -> list[str]:
    needs = list(_NEEDS)
    if (ckpt.folder / "tokenizer.model").is_file():
        needs.append("sentencepiece")
    return [m for m in needs if not _importable(m)]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked (None) in sys.modules
        return False


def write(ckpt: Checkpoint, kind: str, tmp: Path, progress: Progress | None) -> None:
    """Convert `ckpt` to `kind` (f32, f16, bf16 or q8_0) into the temporary `tmp` with llama.cpp's converter."""
    from .upstream import run_converter

    names = ckpt.config.get("architectures") or []
    known = known_architectures()
    if not any(n in known for n in names):
        got = ", ".join(names) or "none listed"
        raise ConversionError(f"architecture {got} is not supported by ctxq convert nor by llama.cpp's converter "
                              f"(of llama-cpp-python {tag().rsplit(' ', 1)[-1]}); ctxq converts natively: "
                              f"{', '.join(supported())}")
    if missing := missing_packages(ckpt):
        raise ConversionError(f"{names[0]} converts through llama.cpp's converter, which needs "
                              f"{', '.join(missing)}: {_INSTALL}")
    log.info("%s: no native ctxq converter for %s; running llama.cpp's convert_hf_to_gguf.py", ckpt.folder, names[0])
    if progress:
        progress(0, 1, "convert:llama.cpp")
    run_converter(ckpt.folder, tmp, kind)
    if progress:
        progress(1, 1, "convert:llama.cpp")
