"""llama.cpp's quantizer run for what it decides rather than for a file: a dry run says each tensor's type (after
the mix's rules, `--tensor-type` overrides and the fallbacks for short rows) without reading a weight; a plain run
writes a temporary file with no cache and no quality gate (`ctxq convert fit`'s measurements). Both run in the
quantizer's worker process."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CtxqError
from ..gguf.reader import read_gguf
from .quantize import _is_quantized, parse_type
from .quantize_process import Worker, tensor_overrides

# llama_model_quantize adds general.quantization_version (u32) to the header: key length (8) +
# 28 characters + type (4) + value (4).
QVERSION_KV = 8 + len("general.quantization_version") + 4 + 4
# a tensor's line in the quantizer's log: name, its type, size, and the new type and size when it changes
_LINE_RE = re.compile(r"\]\s+(\S+)\s+- \[.*?type =\s*(\S+),.*size =\s*([\d.]+) MiB(?: ->\s*([\d.]+) MiB \((\S+)\))?")


def quantize_raw(src: Path, dst: Path, type: str, *, tensor_types: dict[str, str] | None = None,
                 pure: bool = True) -> None:
    """llama.cpp's quantizer from `src` into `dst` and nothing else (no cache, no quality gate): the temporary files
    `ctxq convert fit` measures."""
    name, ftype = parse_type(type)
    g = read_gguf(src, skip_arrays=True)
    job = {"src": str(src), "out": str(dst), "ftype": ftype, "nthread": 0, "pure": pure,
           "allow_requantize": _is_quantized(g), "tensor_types": tensor_overrides(tensor_types)}
    with Worker(lean=True) as worker:
        worker.run(job)


def dry_run(src: Path, type: str, *, tensor_types: dict[str, str] | None = None, pure: bool = False,
            imatrix: Path | None = None) -> list[tuple[str, tuple, int]]:
    """Each tensor's (name, ggml shape, ggml type) after quantizing `src` to `type`, by llama.cpp's quantizer in
    dry-run mode in its worker (nothing is read but the header, nothing written)."""
    return dry_run_needs(src, type, tensor_types=tensor_types, pure=pure, imatrix=imatrix)[0]


def dry_run_needs(src: Path, type: str, *, tensor_types: dict[str, str] | None = None, pure: bool = False,
                  imatrix: Path | None = None) -> tuple[list[tuple[str, tuple, int]], bool]:
    """`dry_run`, and whether the job needs an importance matrix llama.cpp was not given."""
    name, ftype = parse_type(type)
    g = read_gguf(src, skip_arrays=True)
    job = {"src": str(src), "out": os.devnull, "ftype": ftype, "nthread": 1, "dry_run": True, "pure": pure,
           "allow_requantize": _is_quantized(g), "imatrix": str(imatrix) if imatrix else None,
           "tensor_types": tensor_overrides(tensor_types)}
    with Worker(lean=imatrix is None) as worker:
        lines = worker.run(job)["log"]
    return read_dry_run(lines, {t.name: t.shape for t in g.tensors}, name)


def read_dry_run(lines: list[str], shapes: dict[str, tuple], name: str) -> tuple[list[tuple[str, tuple, int]], bool]:
    """The quantizer's dry-run log -> each tensor's (name, ggml shape, new ggml type), and whether the type needs
    an imatrix."""
    from gguf import GGMLQuantizationType

    out = []
    for line in lines:
        m = _LINE_RE.search(line)
        if not m:
            continue
        tname, new = m.group(1), m.group(5) or m.group(2)  # the new type, or the current one kept
        out.append((tname, shapes[tname], int(GGMLQuantizationType[new.upper()])))
    if len(out) != len(shapes):
        raise CtxqError(f"could not read llama.cpp's dry-run log for {name}: {len(out)} of {len(shapes)} tensors")
    needs = any("will require an imatrix" in ln for ln in lines)
    return out, needs


