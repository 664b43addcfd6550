"""A strict, bounded reader for a GGUF file's header and tensor index.

It reads only the key/value metadata and the tensor infos (never the weights), so a 40 GB
file is read in milliseconds. Every length and count is checked against the file's size before
anything is allocated, so a hostile or truncated file ends in a `GGUFError`, never a crash,
a hang or a huge allocation. gguf's `GGUFReader` maps the whole file and trusts the counts,
which is why ctxq does not use it here.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import GGUFError
from ..units import round_up
from . import once


def _gguf_constants():
    """The gguf package's `constants` module (ggml types, block sizes, file types) without running the
    package's __init__, which imports numpy and all of gguf: 0.16 of the 0.25 CPU s that importing the
    planner took (scripts/bench_plan.py). The same file the package loads, so the tables cannot drift."""
    if (mod := sys.modules.get("gguf.constants")) is not None:
        return mod
    name = "ctxq.gguf._gguf_constants"
    if (mod := sys.modules.get(name)) is not None:
        return mod
    spec = importlib.util.find_spec("gguf")
    spec = importlib.util.spec_from_file_location(name, Path(spec.submodule_search_locations[0]) / "constants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# Plain tables, so that no member of that module's enums (not gguf's own classes) leaves this one.
_constants = _gguf_constants()
GGML_TYPES = {t.name: int(t) for t in _constants.GGMLQuantizationType}  # "Q4_K" -> ggml_type number
GGML_BLOCKS = {int(t): sizes for t, sizes in _constants.GGML_QUANT_SIZES.items()}  # number -> (block, bytes)
FILE_TYPES = {int(t): t.name for t in _constants.LlamaFileType}  # general.file_type -> "MOSTLY_Q4_K_M"
_TYPE_NAMES = {n: name for name, n in GGML_TYPES.items()}

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT in ggml/include/gguf.h
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF value types (gguf.h, enum gguf_type) -> struct format; 8 = string, 9 = array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length (ne0)
    type: int  # ggml_type number
    offset: int  # bytes from the start of the data section
    nbytes: int

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES.get(self.type) or f"TYPE_{self.type}"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, object]
    tensors: list[TensorInfo]
    data_offset: int  # file offset of the tensor data section
    file_size: int  # bytes
    alignment: int = DEFAULT_ALIGNMENT
    value_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # key -> (gguf type, array elem type)
    source: str | None = None  # the Hub reference a header-only copy was read for (path: that copy)
    bytes_read: int | None = None  # bytes fetched over the network for it (0: all from the cache)
    _by_name: dict[str, TensorInfo] = field(default_factory=dict, repr=False)

    def tensor(self, name: str) -> TensorInfo | None:
        if not self._by_name:
            self._by_name = {t.name: t for t in self.tensors}
        return self._by_name.get(name)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture key; not a model GGUF")
        return arch

    def copy(self, path: Path, *, skip_arrays: bool = False) -> GGUFFile:
        """The same header with lists and dicts of its own, under `path`; `skip_arrays`: the tokenizer's arrays as
        their lengths, as `read_gguf(skip_arrays=True)` reads them."""
        meta = {k: _ArrayLen(len(v)) if skip_arrays and isinstance(v, list) and k.startswith("tokenizer.") else v
                for k, v in self.metadata.items()}
        return replace(self, path=path, metadata=meta, tensors=list(self.tensors), value_types=dict(self.value_types),
                       _by_name={})

    def arch_get(self, key: str, default=None):
        """`<arch>.<key>`, e.g. arch_get("block_count")."""
        return self.metadata.get(f"{self.arch}.{key}", default)


def tensor_nbytes(type_: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor in ggml's layout (ggml_nbytes for a contiguous tensor)."""
    try:
        block, type_size = GGML_BLOCKS[type_]  # by number: an enum call per tensor cost more than its parsing
    except (KeyError, TypeError):
        raise GGUFError(f"unknown ggml tensor type {type_}") from None
    if shape[0] % block:
        raise GGUFError(f"tensor row of {shape[0]} is not a multiple of the block size {block}")
    n_rows = 1
    for d in shape[1:]:
        n_rows *= d
    return shape[0] // block * type_size * n_rows


_STRUCTS = {fmt: struct.Struct("<" + fmt) for fmt in {*_SCALAR.values(), "I", "Q"}}
_U64 = _STRUCTS["Q"]


class _Cursor:
    """Bounded sequential reads from the start of a file; any overrun is a truncation. The bytes
    read so far are kept in one growing buffer, so parsing is `unpack_from` on memory."""

    def __init__(self, f, size: int, path: Path, limit: int | None = None):
        self.f, self.size, self.path, self.limit = f, size, path, limit
        self.buf = bytearray()  # the file's bytes [0, len(buf))
        self.pos = 0

    def _truncated(self) -> GGUFError:
        return GGUFError(f"{self.path}: truncated or corrupted GGUF (header ends past the end of the file)")

    def _fill(self, end: int) -> None:
        """Have bytes [0, end) in the buffer (end <= size, checked by the callers)."""
        have = len(self.buf)
        if end > have:
            if self.limit is not None and end > self.limit:
                raise GGUFError(f"{self.path}: GGUF header larger than {self.limit:,} bytes; "
                                "corrupted or hostile, not read further")
            stop = min(self.size, max(end, 2 * have, 1 << 16))  # doubling: few reads for any header
            self.f.seek(have)
            self.buf += self.f.read((min(stop, self.limit) if self.limit else stop) - have)
            if len(self.buf) < end:  # the file shrank while being read
                raise GGUFError(f"{self.path}: truncated GGUF (read {len(self.buf)} of {end} bytes)")

    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self._truncated()
        self._fill(self.pos + n)
        data = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return data

    def unpack(self, fmt: str):
        s = _STRUCTS[fmt]
        if self.pos + s.size > self.size:
            raise self._truncated()
        self._fill(self.pos + s.size)
        value = s.unpack_from(self.buf, self.pos)[0]
        self.pos += s.size
        return value

    def unpack_struct(self, s: struct.Struct) -> tuple:
        """Several values at once (a tensor info's shape, type and offset)."""
        if self.pos + s.size > self.size:
            raise self._truncated()
        self._fill(self.pos + s.size)
        values = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return values

    def peek_u32(self) -> int | None:
        """The next uint32 without moving (an array's element type); None at the end of the file."""
        if self.pos + 4 > self.size:
            return None
        self._fill(self.pos + 4)
        return _STRUCTS["I"].unpack_from(self.buf, self.pos)[0]

    def string(self) -> str:
        n = self.unpack("Q")
        raw = self.read(n)  # bounded by the file size
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings without decoding them (a vocabulary: 100k+ of them)."""
        buf, pos, size, u64 = self.buf, self.pos, self.size, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > len(buf):
                if pos + 8 > size:
                    raise self._truncated()
                self._fill(pos + 8)
            pos += 8 + u64(buf, pos)[0]
            if pos > size:
                raise self._truncated()
        self.pos = pos

    def longest_string(self, count: int) -> int:
        """Step over `count` strings like `skip_strings`; the longest one's length in bytes."""
        buf, pos, size, u64 = self.buf, self.pos, self.size, _U64.unpack_from
        longest = 0
        for _ in range(count):
            if pos + 8 > len(buf):
                if pos + 8 > size:
                    raise self._truncated()
                self._fill(pos + 8)
            n = u64(buf, pos)[0]
            longest = max(longest, n)
            pos += 8 + n
            if pos > size:
                raise self._truncated()
        self.pos = pos
        return longest

    def value(self, vtype: int, depth: int = 0, *, skip: bool = False):
        """The value of type `vtype` at the cursor; with `skip`, an array's length instead of its items."""
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth > 0:
                raise GGUFError(f"{self.path}: corrupted GGUF (nested arrays)")
            etype = self.unpack("I")
            count = self.unpack("Q")
            if etype in _SCALAR:
                width = _STRUCTS[_SCALAR[etype]].size
                if skip:
                    if count * width > self.size - self.pos:
                        raise self._truncated()
                    self.pos += count * width
                    return _ArrayLen(count)
                raw = self.read(count * width)  # bounded by the file size before reading
                return list(struct.unpack(f"<{count}{_SCALAR[etype]}", raw)) if count else []
            if etype == _STRING:
                if count * 8 > self.size - self.pos:
                    raise GGUFError(f"{self.path}: truncated or corrupted GGUF (array of {count} strings)")
                if skip:
                    self.skip_strings(count)
                    return _ArrayLen(count)
                return [self.string() for _ in range(count)]
            raise GGUFError(f"{self.path}: corrupted GGUF (array of unknown type {etype})")
        raise GGUFError(f"{self.path}: corrupted GGUF (unknown value type {vtype})")


def read_gguf(path: str | os.PathLike, *, skip_arrays: bool = False) -> GGUFFile:
    """Read a GGUF file's metadata and tensor index; raise `GGUFError` on anything malformed.

    `skip_arrays` leaves the tokenizer's arrays (vocabulary, merges) out of the metadata, keeping
    only their length, which is what the planner needs.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GGUFError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        st = os.fstat(f.fileno())
        key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        g = once.recall((*key, skip_arrays)) or (skip_arrays and once.recall((*key, False)))
        if g:  # parsed before in this command (`once`): a copy of that parse, not the file again
            return g.copy(path, skip_arrays=skip_arrays)
        g = parse_gguf(f, st.st_size, path, skip_arrays=skip_arrays)
    return once.keep((*key, skip_arrays), g).copy(path) if once.active() else g


def vocabulary_bound(path: str | os.PathLike) -> tuple[str | None, int]:
    """(tokenizer.ggml.model, the longest entry of tokenizer.ggml.tokens in bytes), the header read only as far as
    both: what bounds the bytes of text one token can stand for (`ctxq.textfile`). (None, 0) without a vocabulary."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        cur = _Cursor(f, size, path)
        if size < 4 or cur.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (wrong magic); expected a llama.cpp .gguf model")
        cur.unpack("I")  # version
        cur.unpack("Q")  # tensors
        model, longest = None, None
        for _ in range(cur.unpack("Q")):
            key = cur.string()
            vtype = cur.unpack("I")
            if key == "tokenizer.ggml.tokens" and vtype == _ARRAY and cur.peek_u32() == _STRING:
                cur.unpack("I")
                longest = cur.longest_string(cur.unpack("Q"))
            elif key == "tokenizer.ggml.model" and vtype == _STRING:
                model = cur.string()
            else:
                cur.value(vtype, skip=True)
            if model is not None and longest is not None:
                break
    return model, longest or 0


def parse_gguf(f, size: int, path: Path, *, skip_arrays: bool = False, limit: int | None = None) -> GGUFFile:
    """The header of a GGUF of `size` bytes read from `f`, any object with `seek` and `read` (a local
    file, or a ranged HTTP source: then `path` names it); `limit` bounds the header's bytes."""
    cur = _Cursor(f, size, path, limit)
    if size < 4 or cur.read(4) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (wrong magic); expected a llama.cpp .gguf model")
    version = cur.unpack("I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (ctxq reads versions 2 and 3)")
    n_tensors = cur.unpack("Q")
    n_kv = cur.unpack("Q")
    # Each KV needs >= 12 bytes and each tensor info >= 24: reject absurd counts at once.
    if n_kv * 12 + n_tensors * 24 > min(size, limit or size):
        raise GGUFError(f"{path}: truncated or corrupted GGUF ({n_tensors} tensors, {n_kv} keys "
                        f"cannot fit in {min(size, limit or size)} bytes)")
    metadata: dict[str, object] = {}
    value_types: dict[str, tuple[int, int | None]] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.unpack("I")
        value_types[key] = (vtype, cur.peek_u32() if vtype == _ARRAY else None)
        metadata[key] = cur.value(vtype, skip=skip_arrays and vtype == _ARRAY and key.startswith("tokenizer."))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: corrupted GGUF (general.alignment = {alignment!r})")
    tensors = [_tensor_info(cur, alignment) for _ in range(n_tensors)]
    data_offset = round_up(cur.pos, alignment)
    data_size = size - data_offset
    for t in tensors:
        if t.offset + t.nbytes > data_size:
            raise GGUFError(f"{path}: truncated GGUF: tensor {t.name!r} ends at byte "
                            f"{data_offset + t.offset + t.nbytes:,} but the file has {size:,} bytes; "
                            "download or convert it again")
    return GGUFFile(path, version, metadata, tensors, data_offset, size, alignment, value_types)


_TENSOR_INFO = {n: struct.Struct(f"<{n}QIQ") for n in range(1, MAX_DIMS + 1)}  # ne[n], ggml_type, offset


def _tensor_info(cur: _Cursor, alignment: int) -> TensorInfo:
    name = cur.string()
    n_dims = cur.unpack("I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"{cur.path}: corrupted GGUF (tensor {name!r} has {n_dims} dimensions)")
    *dims, ttype, offset = cur.unpack_struct(_TENSOR_INFO[n_dims])
    shape = tuple(dims)
    if any(d <= 0 for d in shape):
        raise GGUFError(f"{cur.path}: corrupted GGUF (tensor {name!r} has shape {shape})")
    if offset % alignment:
        raise GGUFError(f"{cur.path}: corrupted GGUF (tensor {name!r} offset not aligned)")
    return TensorInfo(name, shape, ttype, offset, tensor_nbytes(ttype, shape))


class _ArrayLen(int):
    """Stands in for an array left out by `skip_arrays`: its value is the array's length."""
