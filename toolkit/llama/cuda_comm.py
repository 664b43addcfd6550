"""How llama.cpp's CUDA backend will talk between cards, told without a GPU: `ctxq doctor`'s multi-GPU lines.

Three things decide it (llama.cpp as vendored by llama-cpp-python 0.3.36, ggml/src/ggml-cuda/):
- NCCL, chosen at build time: CMake's GGML_CUDA_NCCL (default ON) defines GGML_USE_NCCL and links NCCL::NCCL
  only where `find_package(NCCL)` succeeds (CMakeLists.txt). ggml reports no feature for it, so ctxq reads the
  backend library's DT_NEEDED entries (`elf.dynamic`) for libnccl, and for a static link the message compiled
  in only with it;
- GGML_CUDA_ALLREDUCE (`ggml_backend_cuda_comm_init`): which all-reduce tensor split mode (-sm tensor) uses;
- GGML_CUDA_P2P (`ggml_cuda_init`, the VMM pool): peer access between the cards.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import elf

ALLREDUCE_VALUES = ("nccl", "internal", "none")
# the soname NCCL (or AMD's RCCL, for the HIP build of the same code) is linked by
_NCCL_RE = re.compile(r"^lib[nr]ccl\.so(\.\d+)*$")
# compiled in under #ifdef GGML_USE_NCCL / its #else (ggml_backend_cuda_comm_init_nccl): a static NCCL leaves
# no DT_NEEDED entry, but one of these strings is always there
_WITH_NCCL = b"NCCL init failed (%s); falling back"
_WITHOUT_NCCL = b"NCCL not compiled in; falling back"
_BUTTERFLY = "the meta backend's generic all-reduce (butterfly copies between the cards)"


@dataclass
class CudaComm:
    library: str | None  # the ggml CUDA backend llama-cpp-python loads; None: this build has none
    needed: list[str] = field(default_factory=list)  # its DT_NEEDED sonames
    nccl: bool = False  # built with NCCL (GGML_USE_NCCL)
    nccl_soname: str | None = None  # the NCCL library it links dynamically ("libnccl.so.2"); None: static or none
    nccl_found: bool | None = None  # the loader finds nccl_soname (None: nothing to find)
    nccl_error: str | None = None  # why it does not
    allreduce_env: str | None = None  # GGML_CUDA_ALLREDUCE as set; None: unset
    allreduce: str | None = None  # what -sm tensor uses between CUDA cards: nccl | internal | butterfly
    allreduce_why: str = ""
    p2p_env: str | None = None  # GGML_CUDA_P2P as set; None: unset
    peer_access: bool | None = None  # llama.cpp enables peer access between the cards that can
    peer_access_why: str = ""
    error: str | None = None  # the library could not be read


def cuda_library(lib_dir: Path) -> Path | None:
    """libggml-cuda in llama-cpp-python's lib folder: the SONAME file libggml links in a plain CUDA build,
    the module ggml loads in a GGML_BACKEND_DL build (scripts/setup.sh's)."""
    return next((p for p in (lib_dir / "libggml-cuda.so.0", lib_dir / "libggml-cuda.so") if p.is_file()), None)


def nccl_soname(needed: list[str]) -> str | None:
    return next((n for n in needed if _NCCL_RE.match(n)), None)


def allreduce(value: str | None, nccl: bool, n_gpus: int | None = None, linux: bool = True) -> tuple[str, str]:
    """(method, why): the all-reduce llama.cpp's tensor split mode runs between CUDA cards, for
    GGML_CUDA_ALLREDUCE=`value` (None: unset), a build with or without NCCL, and `n_gpus` cards (None: not known).
    As `ggml_backend_cuda_comm_init` chooses: unset is nccl on Linux, internal elsewhere; nccl without NCCL
    compiled in, or when it cannot start, falls to internal; internal needs exactly 2 cards of compute
    capability 7.0+ (`ggml_cuda_ar_pipeline_init`), else the meta backend's butterfly; an unknown value warns
    and means none (not the default)."""
    if value is None:
        want = "nccl" if linux else "internal"
        said = f"llama.cpp's default {'on' if linux else 'off'} Linux, "
    elif value in ALLREDUCE_VALUES:
        want, said = value, ""
    else:
        return "butterfly", (f"{value!r} is not one of {'|'.join(ALLREDUCE_VALUES)}: llama.cpp warns "
                             f"\"unknown GGML_CUDA_ALLREDUCE value\" and uses none, {_BUTTERFLY}")

    def internal(prefix: str) -> tuple[str, str]:
        if n_gpus is not None and n_gpus != 2:
            return "butterfly", (f"{prefix}the internal all-reduce, which takes exactly 2 cards ({n_gpus} here), "
                                 f"so {_BUTTERFLY}")
        return "internal", (f"{prefix}the internal all-reduce (2 cards, compute capability 7.0+; "
                            f"otherwise {_BUTTERFLY})")

    if want == "nccl":
        if nccl:
            return "nccl", (f"{said}NCCL (falling back to the internal all-reduce if NCCL cannot start or "
                            "virtual devices are in use)")
        return internal(f"{said}nccl, but NCCL is not compiled in: llama.cpp warns and uses ")
    if want == "internal":
        return internal(said)
    return "butterfly", f"none: {_BUTTERFLY}"


def peer_access(value: str | None, nccl: bool) -> tuple[bool, str]:
    """(enabled, why) for GGML_CUDA_P2P=`value` (None: unset): llama.cpp tests only that it is set."""
    if value is not None:
        shown = f" (to {value!r}: llama.cpp only checks that it is set)" if value.strip().lower() in (
            "", "0", "false", "no", "off") else ""
        return True, (f"GGML_CUDA_P2P is set{shown}: peer access between every pair of cards that can "
                      "(unset it if a board with the IOMMU on crashes: llama.cpp docs/multi-gpu.md)")
    if nccl:
        return True, "GGML_CUDA_P2P unset, but with NCCL: NCCL enables peer access and ggml's memory pool allows it"
    return False, ("GGML_CUDA_P2P unset: no peer access, copies between cards go through host memory "
                   "(set GGML_CUDA_P2P=1 to enable it)")


def _loader_finds(lib: Path, soname: str, runpath: list[str]) -> tuple[bool, str | None]:
    """Whether the dynamic loader resolves `soname` for `lib`: its RUNPATH ($ORIGIN), then the usual search."""
    for d in runpath:
        if Path(d.replace("$ORIGIN", str(lib.parent)).replace("${ORIGIN}", str(lib.parent)), soname).is_file():
            return True, None
    try:
        ctypes.CDLL(soname)
    except OSError as e:
        return False, str(e)
    return True, None


def cuda_comm(lib_dir: Path, n_gpus: int | None = None, environ=None) -> CudaComm:
    """The report for the llama-cpp-python whose lib folder is `lib_dir`; environment read now (`environ`,
    default os.environ)."""
    env = os.environ if environ is None else environ
    lib = cuda_library(lib_dir)
    out = CudaComm(library=str(lib) if lib else None, allreduce_env=env.get("GGML_CUDA_ALLREDUCE"),
                   p2p_env=env.get("GGML_CUDA_P2P"))
    if lib is None:
        bad = out.allreduce_env is not None and out.allreduce_env not in ALLREDUCE_VALUES
        out.allreduce_why = "no CUDA backend in this build: GGML_CUDA_ALLREDUCE has no effect" + (
            f" (and {out.allreduce_env!r} is not one of {'|'.join(ALLREDUCE_VALUES)})" if bad else "")
        out.peer_access_why = "no CUDA backend in this build: GGML_CUDA_P2P has no effect"
        return out
    try:
        dyn = elf.dynamic(lib)
        out.needed, out.nccl_soname = dyn.needed, nccl_soname(dyn.needed)
        out.nccl = out.nccl_soname is not None or (elf.contains(lib, _WITH_NCCL)
                                                   and not elf.contains(lib, _WITHOUT_NCCL))
    except (elf.ElfError, OSError) as e:
        out.error = str(e)
        return out
    if out.nccl_soname:
        out.nccl_found, out.nccl_error = _loader_finds(lib, out.nccl_soname, dyn.runpath)
    out.allreduce, out.allreduce_why = allreduce(out.allreduce_env, out.nccl, n_gpus, sys.platform.startswith("linux"))
    out.peer_access, out.peer_access_why = peer_access(out.p2p_env, out.nccl)
    return out
