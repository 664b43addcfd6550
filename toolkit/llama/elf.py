"""What a shared library asks the dynamic loader for, read from its ELF file (no readelf needed).

`dynamic(path)` reads the dynamic section the way the loader finds it: the PT_DYNAMIC program header,
its DT_NEEDED / DT_SONAME / DT_RUNPATH / DT_RPATH string offsets, resolved in the DT_STRTAB table whose
address a PT_LOAD header maps to a file offset (System V gABI, "Dynamic Section"). `ctxq doctor` uses it
to tell whether llama.cpp's CUDA backend was linked against NCCL without loading it (no GPU needed).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CtxqError

# gABI values: e_ident[EI_CLASS], e_ident[EI_DATA], p_type, d_tag
_CLASS64, _LITTLE = 2, 1
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_SONAME, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 14, 15, 29


class ElfError(CtxqError):
    """A file is not an ELF shared object or executable ctxq can read."""


@dataclass
class Dynamic:
    needed: list[str] = field(default_factory=list)  # DT_NEEDED sonames, in the file's order
    soname: str | None = None
    runpath: list[str] = field(default_factory=list)  # DT_RUNPATH, else DT_RPATH, split at ':'


def dynamic(path: str | Path) -> Dynamic:
    """The dynamic section of an ELF file; empty for a static executable. ElfError for anything else."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise ElfError(f"{path} is not an ELF file")
            # mapped, not read: a CUDA backend built for several architectures is hundreds of MiB
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _dynamic(path, data)
    except OSError as e:
        raise ElfError(f"cannot read {path}: {e.strerror}") from None


def _dynamic(path: Path, data) -> Dynamic:
    if len(data) < 0x34:  # the smaller (32-bit) ELF header
        raise ElfError(f"{path} is a truncated ELF file")
    is64, end = data[4] == _CLASS64, "<" if data[5] == _LITTLE else ">"
    try:
        if is64:
            phoff, = struct.unpack_from(end + "Q", data, 0x20)
            phentsize, phnum = struct.unpack_from(end + "HH", data, 0x36)
            ph_fmt, dyn_fmt = end + "IIQQQQQQ", end + "qQ"  # p_type p_flags p_offset p_vaddr p_paddr p_filesz ...
        else:
            phoff, = struct.unpack_from(end + "I", data, 0x1C)
            phentsize, phnum = struct.unpack_from(end + "HH", data, 0x2A)
            ph_fmt, dyn_fmt = end + "IIIIIIII", end + "iI"  # p_type p_offset p_vaddr p_paddr p_filesz ...
        loads, dyn = [], None
        for i in range(phnum):
            f = struct.unpack_from(ph_fmt, data, phoff + i * phentsize)
            p_type, p_offset, p_vaddr, p_filesz = (f[0], f[2], f[3], f[5]) if is64 else (f[0], f[1], f[2], f[4])
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dyn = (p_offset, p_filesz)
        if dyn is None:
            return Dynamic()
        entries, size = [], struct.calcsize(dyn_fmt)
        for off in range(dyn[0], dyn[0] + dyn[1] - size + 1, size):
            tag, val = struct.unpack_from(dyn_fmt, data, off)
            if tag == _DT_NULL:
                break
            entries.append((tag, val))
    except struct.error:
        raise ElfError(f"{path} is a truncated ELF file") from None
    strtab = next((v for t, v in entries if t == _DT_STRTAB), None)
    base = next((strtab - vaddr + off for vaddr, off, size in loads
                 if strtab is not None and vaddr <= strtab < vaddr + size), None)
    if base is None:
        raise ElfError(f"{path}: its dynamic string table is outside every loaded segment")

    def string(offset: int) -> str:
        start = base + offset
        stop = data.find(b"\0", start)
        if start >= len(data) or stop < 0:
            raise ElfError(f"{path} is a truncated ELF file")
        return data[start:stop].decode("utf-8", "replace")

    out = Dynamic(needed=[string(v) for t, v in entries if t == _DT_NEEDED])
    out.soname = next((string(v) for t, v in entries if t == _DT_SONAME), None)
    rpath = next((string(v) for t, v in entries if t == _DT_RUNPATH), None)
    rpath = rpath if rpath is not None else next((string(v) for t, v in entries if t == _DT_RPATH), None)
    out.runpath = [p for p in (rpath or "").split(":") if p]
    return out


def contains(path: str | Path, needle: bytes) -> bool:
    """Whether the file's bytes hold `needle` (e.g. a message compiled in only under one #ifdef)."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(needle) >= 0
