"""llama.cpp's quantizer run for what it decides rather than for a file: a dry run says each tensor's type (after
the mix's rules, `--tensor-type` overrides and the fallbacks for short rows) without reading a weight; a plain run
writes a temporary file with no cache and no quality gate (`ctxq convert fit`'s measurements). Both run in the
quantizer's worker process."""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from ..errors import CtxqError
from ..gguf.reader import read_gguf
from .quantize import _is_quantized, parse_type
from .quantize_process import Worker, tensor_overrides

# llama_model_quantize adds general.quantization_version (u32) to the header: key length (8) +
# 28 characters + type (4) + value (4).
QVERSION_KV = 8 + len("general.quantization_version") + 4 + 4
# GGUF value types -> bytes of a scalar (gguf.h: GGUF_TYPE_UINT8 ... FLOAT64; 8 is a string, 9 an array)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING = 8
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




def written_header_bytes(src: Path, imatrix: Path | None = None) -> int:
    """The bytes of the header llama.cpp's quantizer writes from `src` (before its alignment padding): the source's
    keys and tensor index, with general.quantization_version and general.file_type set (llama_model_quantize_impl,
    u32 each) and, with an importance matrix, the provenance keys ctxq's worker passes with it
    (`quantize_worker._imatrix_params`, as llama.cpp's quantize tool does: written as given, an integer as u32). The
    tensor index does not change with the types, so with the dry run's tensors this is the file's size exactly."""
    g = read_gguf(src, skip_arrays=True)
    keys: dict[str, tuple[int, object]] = {"general.quantization_version": (4, 0), "general.file_type": (4, 0)}
    if imatrix is not None:
        keys.update({k: (_STRING, v) if isinstance(v, str) else (4, v) for k, v in imatrix_keys(Path(imatrix))})
    size = _header_end(g)
    for key, (vtype, value) in keys.items():
        if key in g.metadata:  # set again: replaced in place
            size -= _kv_bytes(key, g.value_types[key][0], g.metadata[key])
        size += _kv_bytes(key, vtype, value)
    return size


def imatrix_keys(imatrix: Path) -> list[tuple[str, str | int]]:
    """The keys `quantize_worker._imatrix_params` adds to the file quantized with `imatrix`, with their values."""
    m = read_gguf(imatrix)
    entries = sum(t.name.endswith(".in_sum2") for t in m.tensors)
    datasets, chunks = m.metadata.get("imatrix.datasets") or [], m.metadata.get("imatrix.chunk_count") or 0
    out: list[tuple[str, str | int]] = [("quantize.imatrix.file", str(imatrix)),
                                        ("quantize.imatrix.entries_count", entries)]
    if datasets:
        out.append(("quantize.imatrix.dataset", str(datasets[0])))
    if chunks > 0:
        out.append(("quantize.imatrix.chunks_count", int(chunks)))
    return out


def _kv_bytes(key: str, vtype: int, value) -> int:
    """A key-value pair's bytes in a GGUF header: the key (u64 length + bytes), the type (u32), the value (a string
    as the worker passes it: llama_model_kv_override.val_str holds 127 bytes and a NUL)."""
    if vtype == _STRING:
        return 8 + len(key.encode()) + 4 + 8 + min(len(str(value).encode()), 127)
    return 8 + len(key.encode()) + 4 + _SCALAR.get(vtype, 0)


def _header_end(g) -> int:
    """Where `g`'s header ends before the padding to its data: the end of its last tensor's index entry (name,
    dimensions, type, offset: gguf.cpp's gguf_write_to_buf), found within the last alignment's bytes."""
    if not g.tensors:
        return g.data_offset
    t = g.tensors[-1]
    name = t.name.encode()
    entry = struct.pack(f"<Q{len(name)}sI{len(t.shape)}QIQ", len(name), name, len(t.shape), *t.shape, t.type,
                        t.offset)
    start = max(0, g.data_offset - g.alignment - len(entry))
    with open(g.path, "rb") as f:
        f.seek(start)
        tail = f.read(g.data_offset - start)
    at = tail.rfind(entry)
    return start + at + len(entry) if at >= 0 else g.data_offset
