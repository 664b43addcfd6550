"""Quantize a GGUF model with llama.cpp's own quantizer: every type, cached, atomic, checked.

    result = quantize_gguf(Path("model-F16.gguf"), Path("model-Q4_K_M.gguf"), "q4_k_m")
    result.path, result.size, result.cached, result.quality["top1_agreement"]

`llama_model_quantize` runs in a child process (`ctxq.conversion.quantize_worker`, watched by
`ctxq.conversion.quantize_process.Worker`), so Ctrl-C stops it at once and an abort inside llama.cpp
becomes a `ConversionError`. It writes to a temporary beside the destination (`ctxq.tempfiles`);
ctxq renames it only after llama.cpp has loaded it back, so an interrupted or killed run never
leaves a file under the destination name, and the next run into that folder removes what a killed
one left. A JSON record under
`ctxq_home()/cache/quantize/` remembers each finished conversion, keyed by what determines its
bytes: the source content (or the caller's `cache_key_extra`, e.g. a Hugging Face revision), the
type, the options, the imatrix and the ctxq and llama.cpp versions.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from .. import tempfiles
from ..digest import file_digest  # noqa: F401 (this module's API too)
from ..errors import ConversionError, CtxqError
from ..gguf.reader import GGUFFile, read_gguf
from ..paths import ctxq_home
from ..units import GiB
from . import output as _out
from .output import writable
from .quantize_process import Worker, tensor_overrides

log = logging.getLogger(__name__)

# llama.cpp's quantize tool list (tools/quantize/quantize.cpp, QUANT_OPTIONS), in its order, with
# the llama_ftype numbers of include/llama.h. Q3_K, Q4_K and Q5_K are its aliases for the _M mixes;
# COPY copies tensors unchanged. NVFP4 (39) is a llama_ftype but the quantizer has no default type
# for it (llama_ftype_get_default_type), so it is not offered.
QUANT_TYPES: dict[str, int] = {
    "Q1_0": 40, "Q2_0": 41, "Q4_0": 2, "Q4_1": 3, "MXFP4_MOE": 38, "Q5_0": 8, "Q5_1": 9,
    "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28, "IQ2_M": 29, "IQ1_S": 24, "IQ1_M": 31,
    "TQ1_0": 36, "TQ2_0": 37, "Q2_K": 10, "Q2_K_S": 21, "IQ3_XXS": 23, "IQ3_S": 26, "IQ3_M": 27,
    "Q3_K": 12, "IQ3_XS": 22, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "IQ4_NL": 25, "IQ4_XS": 30,
    "Q4_K": 15, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K": 17, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18,
    "Q8_0": 7, "F16": 1, "BF16": 32, "F32": 0, "COPY": 0,
}

# Types whose tensors llama.cpp refuses to quantize without an importance matrix
# (tensor_requires_imatrix in src/llama-quant.cpp; IQ3_XS puts some tensors in IQ3_XXS, Q2_K_S
# requires it for its Q2_K tensors). tests/test_quantize_types.py checks this set against
# llama.cpp's own dry run.
NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"})
# Tensor types quantized with an importance matrix when a mix holds them (`tensor_types`): those llama.cpp requires
# one for (tensor_requires_imatrix: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS) and IQ3_S, which fit's table
# measures with one (ctxq.conversion.sensitivity), so that a written mix is the mix the table predicted.
IMATRIX_TENSOR_TYPES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"})
OWN = "ctxq"  # imatrix=OWN: ctxq's own importance matrix of the source (made once per file, cached)

# Default tensor type per file type (llama_ftype_get_default_type) as (bits per weight, block
# size), from ggml-common.h block layouts; the fallback for rows that are not a multiple of the
# block follows llama_tensor_get_type's table (IQ -> IQ4_NL, Q2_K/Q3_K/TQ/Q2_0 -> Q4_0, Q4_K ->
# Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, all 32-blocks at 4.5 to 8.5 bits).
_IQ, _Q4_0 = (4.5, 32), (4.5, 32)
_BASE: dict[str, tuple[float, int, tuple[float, int]]] = {
    "Q1_0": (1.125, 128, _Q4_0), "Q2_0": (2.25, 64, _Q4_0), "Q4_0": (4.5, 32, _Q4_0),
    "Q4_1": (5.0, 32, _Q4_0), "MXFP4_MOE": (8.5, 32, _Q4_0),  # dense tensors go to Q8_0
    "Q5_0": (5.5, 32, _Q4_0), "Q5_1": (6.0, 32, _Q4_0), "IQ2_XXS": (2.0625, 256, _IQ),
    "IQ2_XS": (2.3125, 256, _IQ), "IQ2_S": (2.3125, 256, _IQ), "IQ2_M": (2.5625, 256, _IQ),
    "IQ1_S": (1.5625, 256, _IQ), "IQ1_M": (1.75, 256, _IQ), "TQ1_0": (1.6875, 256, _Q4_0),
    "TQ2_0": (2.0625, 256, _Q4_0), "Q2_K": (2.625, 256, _Q4_0), "Q2_K_S": (2.625, 256, _Q4_0),
    "IQ3_XXS": (3.0625, 256, _IQ), "IQ3_S": (3.4375, 256, _IQ), "IQ3_M": (3.4375, 256, _IQ),
    "IQ3_XS": (3.4375, 256, _IQ), "Q3_K": (3.4375, 256, _Q4_0), "Q3_K_S": (3.4375, 256, _Q4_0),
    "Q3_K_M": (3.4375, 256, _Q4_0), "Q3_K_L": (3.4375, 256, _Q4_0), "IQ4_NL": (4.5, 32, _IQ),
    "IQ4_XS": (4.25, 256, _IQ), "Q4_K": (4.5, 256, (5.5, 32)), "Q4_K_S": (4.5, 256, (5.5, 32)),
    "Q4_K_M": (4.5, 256, (5.5, 32)), "Q5_K": (5.5, 256, (6.0, 32)), "Q5_K_S": (5.5, 256, (6.0, 32)),
    "Q5_K_M": (5.5, 256, (6.0, 32)), "Q6_K": (6.5625, 256, (8.5, 32)), "Q8_0": (8.5, 32, _Q4_0),
}
# Mixes give some tensors (output, attn_v, ffn_down) more bits: Q4_K_M is 4.95 bits per weight on
# tests' tiny llama and 4.89 on Llama-3-8B against 4.5 for Q4_K, so allow one bit more.
_MIX_MARGIN_BITS = 1.0
_HEADER_SLACK = 1 << 16  # keys llama.cpp adds to the header: quantization_version, quantize.imatrix.*
_UNQUANTIZED = {0: 32.0, 1: 16.0, 30: 16.0}  # ggml types F32, F16, BF16 -> bits per weight

Progress = Callable[[int, int, str], None]  # (tensors done, tensors in all, tensor being quantized)


@dataclass
class QuantizeResult:
    path: Path
    type: str
    size: int  # bytes of the quantized file
    cached: bool  # found in the cache: nothing was done
    seconds: float  # wall time of this call
    quality: dict | None  # top1_agreement, mean_kl (nats), max_kl, n_tokens, reference, ...
    source_was_quantized: bool  # requantized: quality is measured against an already quantized model
    quantize_seconds: float | None = None  # the llama_model_quantize call alone (None when cached)
    imatrix: object = None  # the ImatrixResult ctxq made (or took from its cache) because none was given


def parse_type(name: str) -> tuple[str, int]:
    """llama.cpp's name and llama_ftype for a type name in any case; CtxqError lists valid ones."""
    key = str(name).strip().upper()
    if key not in QUANT_TYPES:
        raise CtxqError(f"unknown quantization type {name!r}; choose one of: {', '.join(QUANT_TYPES)}")
    return key, QUANT_TYPES[key]


def needs_imatrix(name: str) -> bool:
    return parse_type(name)[0] in NEEDS_IMATRIX


def wants_imatrix(name: str, tensor_types: dict[str, str] | None = None) -> bool:
    """Whether quantizing to `name` with these per-tensor types takes an importance matrix (ctxq makes its own when
    none is given): the file type needs one, or a tensor type is one of IMATRIX_TENSOR_TYPES."""
    return needs_imatrix(name) or any(str(t).strip().upper() in IMATRIX_TENSOR_TYPES
                                      for t in (tensor_types or {}).values())


def ggml_type(name: str | None, what: str) -> int | None:
    """A ggml tensor type number from its name (for output_tensor_type/token_embedding_type)."""
    if name is None:
        return None
    from gguf.constants import GGMLQuantizationType as T

    try:
        return int(T[str(name).strip().upper()])
    except KeyError:
        raise CtxqError(f"unknown tensor type {name!r} for `{what}`; choose one of: "
                        f"{', '.join(t.name.lower() for t in T)}") from None


def default_output_name(src: str | os.PathLike, type: str) -> str:
    """`<model-name>-<TYPE>.gguf`; a precision suffix on the source name (F16, Q4_1, ...) is dropped."""
    stem = Path(src).name
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    kinds = "|".join(sorted(QUANT_TYPES, key=len, reverse=True))
    stem = re.sub(rf"[-._](?:{kinds}|fp16|fp32)$", "", stem, flags=re.I) or stem
    return f"{stem}-{parse_type(type)[0]}.gguf"


def estimate_size(src: str | os.PathLike | GGUFFile, type: str) -> int:
    """An upper estimate of the quantized file's bytes: the header plus, per tensor, the bits per
    weight of the type's default tensor type (its fallback for odd rows) and a margin for mixes."""
    name, _ = parse_type(type)
    g = src if isinstance(src, GGUFFile) else read_gguf(src, skip_arrays=True)
    total = g.data_offset + _HEADER_SLACK
    for t in g.tensors:
        if name in ("COPY",) or len(t.shape) < 2:
            total += t.nbytes + g.alignment  # copied, or 1-D (norms, biases) kept as they are
            continue
        if name in ("F32", "F16", "BF16"):
            bits = {"F32": 32.0, "F16": 16.0, "BF16": 16.0}[name]
        else:
            bits, block, (fb_bits, fb_block) = _BASE[name]
            if t.shape[0] % block:
                bits = fb_bits if t.shape[0] % fb_block == 0 else 16.0  # F16 when nothing fits
            bits += _MIX_MARGIN_BITS
        total += int(t.n_elements * bits / 8) + g.alignment
    return total


def _is_quantized(g: GGUFFile) -> bool:
    return any(len(t.shape) >= 2 and t.type not in _UNQUANTIZED for t in g.tensors)


# --- the cache ----------------------------------------------------------------------------------

def cache_dir() -> Path:
    return ctxq_home() / "cache" / "quantize"


def _logits_cache() -> Path:
    """The quality gate's reference logits (float32, n_tokens x n_vocab: 57 MB for SmolLM2)."""
    return ctxq_home() / "cache" / "reference-logits"


def _reference_id(key: dict) -> str | None:
    """What the quality gate's reference logits are kept under when the source is named by the
    caller's `cache_key_extra` (the Hugging Face route's f16 temporary: a new path every run)."""
    return None if key["extra"] is None else json.dumps([key["extra"], key["ctxq"]], sort_keys=True)


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = tempfiles.create(path, "json")
    try:
        part.write_text(json.dumps(obj, indent=1, default=str))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def make_cache_key(type: str, *, source: str | os.PathLike | None = None, cache_key_extra: dict | None = None,
                   imatrix: str | os.PathLike | None = None, output_tensor_type: str | None = None,
                   token_embedding_type: str | None = None, leave_output_tensor: bool = False,
                   pure: bool = False, tensor_types: dict[str, str] | None = None,
                   auto_imatrix: int | None = None) -> dict:
    """What determines a quantized file's bytes. `cache_key_extra` (e.g. {"hf_repo": ..., "revision":
    ...}) stands for the source when given, so a caller can look up a result before making the source.
    `auto_imatrix`: the chunks of ctxq's own importance matrix, made of the source when none is given (it follows
    from the source, the built-in text and the versions, so a key needs no matrix file)."""
    if cache_key_extra is None and source is None:
        raise ValueError("make_cache_key needs a source file or cache_key_extra")
    name, ftype = parse_type(type)
    key = {
        "source": None if cache_key_extra is not None else file_digest(source),
        "extra": cache_key_extra,
        "ftype": ftype,
        "copy": name == "COPY",
        "imatrix": file_digest(imatrix) if imatrix else None,
        "output_tensor_type": ggml_type(output_tensor_type, "output_tensor_type"),
        "token_embedding_type": ggml_type(token_embedding_type, "token_embedding_type"),
        "leave_output_tensor": bool(leave_output_tensor),
        "pure": bool(pure),
        "ctxq": md.version("ctxq"),
        "llama_cpp_python": md.version("llama_cpp_python"),  # pins the vendored llama.cpp
    }
    if tensor_types:  # (absent otherwise: the keys of files made before it stay valid)
        key["tensor_types"] = sorted((n, ggml_type(t, n)) for n, t in tensor_types.items())
    if auto_imatrix is not None and not imatrix:
        key["imatrix"] = {"ctxq": auto_imatrix, "chunk": 512}
    return json.loads(json.dumps(key, sort_keys=True))  # as stored: tuples in `cache_key_extra` become lists


def _record_path(key: dict) -> Path:
    return cache_dir() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".json")


def cache_record(key: dict) -> dict | None:
    """The stored record for a key, when its file is still there unchanged."""
    try:
        rec = json.loads(_record_path(key).read_text())
        st = Path(rec["path"]).stat()
    except (OSError, ValueError, KeyError):
        return None
    if rec.get("key") != key or (st.st_size, st.st_mtime_ns) != (rec["size"], rec["mtime_ns"]):
        return None
    return rec


def cache_lookup(key: dict) -> Path | None:
    rec = cache_record(key)
    return Path(rec["path"]) if rec else None


def _cache_store(key: dict, result: QuantizeResult) -> None:
    st = result.path.stat()
    rec = {**asdict(result), "path": str(result.path.resolve()), "key": key, "mtime_ns": st.st_mtime_ns,
           "size": st.st_size, "created": time.time()}
    rec.pop("cached")
    rec.pop("quantize_seconds")
    rec.pop("imatrix")
    _write_json(_record_path(key), rec)


def quantize_gguf(src: Path, dst: Path | None, type: str, *, imatrix: Path | None = None,
                  output_tensor_type: str | None = None, token_embedding_type: str | None = None,
                  leave_output_tensor: bool = False, pure: bool = False, check: bool = True,
                  force: bool = False, cache_key_extra: dict | None = None,
                  progress: Progress | None = None, nthread: int = 0,
                  tensor_types: dict[str, str] | None = None) -> QuantizeResult:
    """Quantize the GGUF `src` to `type` at `dst` (None: `default_output_name` next to `src`).

    A finished identical conversion in the cache is not made again (`cached=True`) unless `force`: it
    is returned where it is or, for a `dst` given, linked or copied there (`output.place`). With `check`,
    the quality gate compares the result with `src` on the built-in text. `progress(done, total, tensor)`
    follows the quantizer tensor by tensor. `nthread` 0 lets llama.cpp use every hardware thread, as its
    quantize tool does. `tensor_types` {tensor name: ggml type} overrides the mix tensor by tensor (llama.cpp's
    `--tensor-type`; a shape the type cannot hold falls back as llama.cpp's rules say). A type or tensor type that
    takes an importance matrix (`wants_imatrix`) gets ctxq's own of `src` with `imatrix=OWN`, or when a mix's
    `tensor_types` ask for it and none is given (cached per file: `result.imatrix`); a file type that needs one is
    refused without; a given one must be this model's (`imatrix.check_matches`).
    """
    t0 = time.perf_counter()
    src = Path(src)
    name, ftype = parse_type(type)
    asked = dst is not None  # a path the caller asked for gets the file, also from the cache
    dst = Path(dst) if asked else src.with_name(default_output_name(src, name))
    if not src.is_file():
        raise ConversionError(f"{src}: no such file; pass a GGUF model (or a Hugging Face model to `ctxq convert`)")
    from .imatrix import auto_chunks, check_matches, make_imatrix

    # ctxq's own matrix of the source: asked for, or a mix (`tensor_types`, fit's) holding a type that takes one
    auto = imatrix == OWN or (imatrix is None and bool(tensor_types) and wants_imatrix(name, tensor_types))
    imatrix = None if imatrix == OWN else imatrix
    if name in NEEDS_IMATRIX and imatrix is None and not auto:
        raise ConversionError(f"{name} needs an importance matrix: pass imatrix=FILE (a GGUF imatrix), imatrix="
                              f"\"{OWN}\" for ctxq's own, or choose a type without one, e.g. Q4_K_M or IQ4_XS")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ConversionError(f"{dst}: the output would overwrite the source; choose another `output` path")
    # The worker loads llama.cpp while this process prepares the job (cache, header, disk).
    with Worker(lean=not check and imatrix is None and not auto) as worker:
        key = make_cache_key(name, source=None if cache_key_extra else src, cache_key_extra=cache_key_extra,
                             imatrix=imatrix, output_tensor_type=output_tensor_type,
                             token_embedding_type=token_embedding_type, leave_output_tensor=leave_output_tensor,
                             pure=pure, tensor_types=tensor_types, auto_imatrix=auto_chunks() if auto else None)
        rec = None if force else (cache_record(key) or _adopted(dst, src, name, key))
        if rec is not None:
            res = _cached(worker, rec, key, src, name, check, t0)
            return _placed(res, dst, src, key) if asked else res
        if dst.exists() and not force:
            raise _not_ours(dst)
        g = read_gguf(src, skip_arrays=True)  # GGUFError for a file that is not a GGUF model
        was_quantized = _is_quantized(g)
        if was_quantized and cache_key_extra is None:  # (ctxq convert says it in its own words)
            log.warning("%s is already quantized: requantizing it to %s loses more quality than "
                        "quantizing the original f16/bf16 model", src, name)
        writable(dst)  # one line for an unwritable destination, before any work
        if imatrix is not None:
            check_matches(Path(imatrix), src)  # one line for a file that is no imatrix, or another model's
        tempfiles.sweep(dst.parent)  # what killed runs left here
        _refuse_second_writer(dst)
        need, free = estimate_size(g, name), shutil.disk_usage(dst.parent).free
        if need > free:
            raise ConversionError(f"not enough disk space in {dst.parent}: {name} needs about {need / GiB:.2f} "
                                  f"GiB, {free / GiB:.2f} GiB free; free space or write the `output` elsewhere")
        made = make_imatrix(src, chunks=auto_chunks(), progress=progress) if auto else None  # "imatrix:" chunks
        imatrix = made.path if made else imatrix
        part = tempfiles.create(dst, "quantize")
        try:
            job = {"src": str(src), "out": str(part), "ftype": ftype, "nthread": nthread,
                   "allow_requantize": was_quantized, "only_copy": name == "COPY", "pure": pure,
                   "leave_output_tensor": leave_output_tensor,
                   "output_tensor_type": key["output_tensor_type"],
                   "token_embedding_type": key["token_embedding_type"],
                   "imatrix": str(imatrix) if imatrix else None, "reference": str(src) if check else None,
                   "tensor_types": tensor_overrides(tensor_types), "logits_cache": str(_logits_cache()), "reference_id": _reference_id(key)}
            out = worker.run(job, progress)
            os.replace(part, dst)  # only a file llama.cpp has loaded back gets the real name
        finally:  # Ctrl-C included: the worker is killed on leaving the `with` block
            part.unlink(missing_ok=True)
        quality = out.get("quality")
        if quality is not None:
            quality["reference_is_quantized"] = was_quantized
        res = QuantizeResult(dst, name, dst.stat().st_size, False, time.perf_counter() - t0, quality, was_quantized,
                             out.get("quantize_seconds"), made)
        _cache_store(key, res)
        return res


def _cached(worker: Worker, rec: dict, key: dict, src: Path, name: str, check: bool, t0: float) -> QuantizeResult:
    quality = rec.get("quality")
    if check and quality is None:  # cached without the gate: run only the gate
        quality = worker.run({"check_only": True, "out": rec["path"], "reference": str(src),
                              "logits_cache": str(_logits_cache()), "reference_id": _reference_id(key)})["quality"]
        quality["reference_is_quantized"] = rec["source_was_quantized"]
    res = QuantizeResult(Path(rec["path"]), name, rec["size"], True, time.perf_counter() - t0,
                         quality, rec["source_was_quantized"])
    if quality is not rec.get("quality"):
        _cache_store(key, res)
    log.info("%s to %s is cached at %s", src.name, name, res.path)
    return res


def _not_ours(dst: Path) -> ConversionError:
    return ConversionError(f"{dst} exists and is not this conversion's cached result; "
                           "pass force=True to overwrite it or choose another `output` path")


def _placed(res: QuantizeResult, dst: Path, src: Path, key: dict) -> QuantizeResult:
    """The cached result `res` at `dst`, where the caller asked for it: linked or copied there (and recorded, so
    the same command again finds it in place); a file of another origin at `dst` is refused."""
    source = str(src.resolve())
    if dst.exists():
        if not (dst.samefile(res.path) or _out.holds(dst, source, res.type, key)):
            raise _not_ours(dst)
    else:
        writable(dst)
        _out.place(res.path, dst)
        _out.remember(dst, source, res.type, key)
        log.info("%s: the cached %s, linked or copied from %s", dst, res.type, res.path)
    return replace(res, path=dst)


def _adopted(dst: Path, src: Path, name: str, key: dict) -> dict | None:
    """A new cache record for `dst` when it holds a placed copy of a cached result whose own file is gone."""
    if not (dst.exists() and _out.holds(dst, str(src.resolve()), name, key)):
        return None
    was_quantized = _is_quantized(read_gguf(src, skip_arrays=True))
    _cache_store(key, QuantizeResult(dst, name, dst.stat().st_size, True, 0.0, None, was_quantized))
    return cache_record(key)


def _refuse_second_writer(dst: Path) -> None:
    """Two ctxq processes never quantize into one destination: a live one's temporary says it is busy."""
    for path in tempfiles.temporaries(dst.parent):
        info = tempfiles.parse(path)
        if info["dest"] == dst.name and info["what"].startswith("quantize") and info["pid"] != os.getpid() \
                and not tempfiles.is_stale(path):
            raise ConversionError(f"another ctxq process (pid {info['pid']}) is writing {dst}; wait for it to finish")

