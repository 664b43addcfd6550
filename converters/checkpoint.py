"""Reading a Hugging Face checkpoint folder: config, and safetensors tensors one at a time.

Tensors are read through a memory map of just that tensor's bytes, which is dropped as soon as the
tensor is converted, so the resident set stays at a few tensors however large the model is.
The safetensors header (8-byte little-endian length, then JSON) is read here directly: the
`safetensors` package cannot hand bf16 to numpy, and numpy is all the converter needs.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConversionError

# safetensors dtype names -> numpy dtypes; bf16 is read as its raw 16 bits.
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
FLOAT_DTYPES = ("F32", "F16", "BF16")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: file, dtype (safetensors name), shape, byte range in the file."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    def load_f32(self) -> np.ndarray:
        """The whole tensor as float32."""
        return self._rows(0, self.shape[0] if self.shape else 1)

    def iter_f32(self, max_bytes: int = 32 << 20):
        """The tensor as float32 blocks of whole rows (axis 0), each from about `max_bytes` of source."""
        if len(self.shape) < 2:
            yield self.load_f32()
            return
        row_bytes = max(1, self.nbytes // self.shape[0])
        step = max(1, max_bytes // row_bytes)
        for r in range(0, self.shape[0], step):
            yield self._rows(r, min(step, self.shape[0] - r))

    def equals(self, other: "TensorRef", max_bytes: int = 32 << 20) -> bool:
        """Whether both tensors hold the same values (as float32), compared a block of rows at a time;
        the first differing block ends the comparison."""
        if self.shape != other.shape:
            return False
        if len(self.shape) < 2:
            return bool(np.array_equal(self.load_f32(), other.load_f32()))
        rows = self.shape[0]
        step = max(1, max_bytes // max(1, self.nbytes // rows))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            if not np.array_equal(self._rows(r, n), other._rows(r, n)):
                return False
        return True

    def rows(self, first: int, count: int) -> np.ndarray:
        """Rows [first, first+count) as float32 (along axis 0: for a packed expert tensor, experts)."""
        return self._rows(first, count)

    def raw(self, row: int) -> np.ndarray:
        """Row `row` (axis 0) as stored, undecoded (e.g. MXFP4 bytes)."""
        return self._rows(row, 1, decode=False)[0]

    def _rows(self, first: int, count: int, decode: bool = True) -> np.ndarray:
        """Rows [first, first+count) as float32, read through a map of only those bytes."""
        np_dtype = _DTYPES[self.dtype]
        shape = (count, *self.shape[1:]) if self.shape else ()
        n = int(np.prod(shape, dtype=np.int64))
        if n == 0:
            return np.zeros(shape, np.float32)
        size = np.dtype(np_dtype).itemsize
        start = self.start + first * (self.nbytes // max(1, self.shape[0] if self.shape else 1))
        page = mmap.ALLOCATIONGRANULARITY
        base = start // page * page
        with open(self.file, "rb") as f:
            mm = mmap.mmap(f.fileno(), start - base + n * size, access=mmap.ACCESS_READ, offset=base)
        try:
            raw = np.frombuffer(mm, dtype=np_dtype, count=n, offset=start - base).reshape(shape)
            if not decode:
                out = raw.copy()
            elif self.dtype == "BF16":
                out = (raw.astype(np.uint32) << 16).view(np.float32)  # bf16 is the top half of an f32
            else:
                out = raw.astype(np.float32)  # always a copy, so the map can close
            del raw
        finally:
            mm.close()
        return out


class Checkpoint:
    """A local Hugging Face model folder with safetensors weights."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        cfg = self.folder / "config.json"
        if not cfg.is_file():
            raise ConversionError(f"{self.folder}: no config.json; pass a Hugging Face model folder or hub id")
        try:
            self.config: dict = json.loads(cfg.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConversionError(f"{cfg}: not valid JSON ({e}); download it again") from None
        self.tensors: dict[str, TensorRef] = {}
        files = self._weight_files()
        for f in files:
            self._read_header(f)
        if not self.tensors:
            raise ConversionError(f"{self.folder}: the safetensors files hold no tensors")

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [n for n in names if not (self.folder / n).is_file()]
            if missing:
                raise ConversionError(f"{self.folder}: {missing[0]} named in model.safetensors.index.json is missing; "
                                      "download the complete checkpoint")
            return [self.folder / n for n in names]
        files = sorted(self.folder.glob("*.safetensors"))
        if files:
            return files
        pickles = sorted(p.name for p in self.folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ConversionError(f"{self.folder}: only PyTorch pickle weights ({pickles[0]}); ctxq reads safetensors only "
                                  "(pickles can run code): save the model with save_pretrained(safe_serialization=True)")
        raise ConversionError(f"{self.folder}: no *.safetensors weights found")

    def _read_header(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"{path}: not a safetensors file (truncated)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 1024 * 1024):  # safetensors caps headers at 100 MB
                raise ConversionError(f"{path}: not a safetensors file (bad header length)")
            try:
                header = json.loads(f.read(n))
            except ValueError:
                raise ConversionError(f"{path}: not a safetensors file (header is not JSON)") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (a, b) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if dtype not in _DTYPES:
                raise ConversionError(f"{path}: tensor {name} has dtype {dtype}, which ctxq cannot convert")
            if 8 + n + b > size:
                raise ConversionError(f"{path}: truncated (tensor {name} runs past the end); download it again")
            self.tensors[name] = TensorRef(path, name, dtype, shape, 8 + n + a, b - a)

    def source_float_type(self) -> str:
        """The float type most weight bytes are stored in: f32, f16 or bf16."""
        by_type: dict[str, int] = {}
        for t in self.tensors.values():
            if t.dtype in FLOAT_DTYPES:
                by_type[t.dtype] = by_type.get(t.dtype, 0) + t.nbytes
        return max(by_type, key=by_type.get).lower() if by_type else "f32"

    def json(self, name: str) -> dict | None:
        p = self.folder / name
        return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None
