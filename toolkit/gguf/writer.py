"""The one writer of header-only GGUF files: real metadata and tensor index, no weights.

The data region is left as a sparse hole of the right size, so a 70B-shaped file takes a few MB
of disk and llama.cpp loads it like the real thing (in a dry run it never reads the weights). The
planner's derived one-layer models, the header a Hugging Face checkpoint would convert to, the
quantizer's predicted files and the synthetic test models are all written here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

import gguf
import numpy as np

from .. import tempfiles
from ..units import round_up
from .reader import DEFAULT_ALIGNMENT, tensor_nbytes


def write_sparse_gguf(out: str | os.PathLike, arch: str, tensors: Iterable[tuple[str, tuple[int, ...], int]],
                      metadata: Callable[[gguf.GGUFWriter], None]) -> Path:
    """Write `metadata(writer)`'s keys and `tensors` (name, ggml shape, ggml type) to `out`,
    atomically; the tensor data is a hole of exactly the bytes the tensors take."""
    out = Path(out)
    tmp = tempfiles.create(out, "header")  # a killed writer's is removed by `ctxq cache clean`
    try:
        w = gguf.GGUFWriter(tmp, arch)
        metadata(w)
        data = 0
        for name, shape, ttype in tensors:
            nbytes = tensor_nbytes(ttype, tuple(shape))
            # GGUFWriter takes numpy-order shapes (ggml's reversed); with raw_dtype and a non-byte
            # dtype the shape is in elements, for every type
            w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType(ttype))
            data += round_up(nbytes, DEFAULT_ALIGNMENT)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        with open(tmp, "r+b") as f:
            f.truncate(round_up(os.path.getsize(tmp), DEFAULT_ALIGNMENT) + data)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def sparse_size(header_bytes: int, tensors: Iterable[tuple[str, tuple[int, ...], int]]) -> int:
    """The size of a GGUF whose header takes `header_bytes`, holding `tensors` (name, shape, type)."""
    return round_up(header_bytes, DEFAULT_ALIGNMENT) + sum(
        round_up(tensor_nbytes(t, tuple(s)), DEFAULT_ALIGNMENT) for _, s, t in tensors)
