"""`ctxq convert`: a Hugging Face checkpoint (local folder or hub id) to a GGUF llama.cpp loads.

Float types (f32, f16, bf16) and q8_0 are written here, tensor by tensor from memory-mapped
safetensors; any other llama.cpp type is made from a temporary f16/bf16 GGUF by
`ctxq.conversion.quantize.quantize_gguf`. Architectures without a native converter (`ctxq.converters`)
are written by llama.cpp's own converter instead (`ctxq.conversion.fallback`). The output appears at
its destination only complete and verified: it is written under a temporary name beside it, loaded by
llama.cpp, then renamed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .. import tempfiles
from . import output as _out
from ..llama import backend
from ..converters import family_for, knows, supported
from ..converters.base import resolve
from ..converters.checkpoint import Checkpoint
from ..converters.tokenizer import Vocab, load_vocab
from ..errors import ConversionError
from ..gguf.once import one_parse
from ..hub.download import cached_checkpoint, download_checkpoint
from ..hub.http import ask_commit, offline
from ..hub.ref import HubRef, parse_ref
from .tensors import FLOAT_TYPES, Progress, nbytes, plan_tensors, write  # noqa: F401 (plan_tensors: API)
from ..models import models_dir
from ..units import MiB

log = logging.getLogger(__name__)

_DISK_MARGIN = 64 * MiB  # header, alignment padding and the filesystem's own slack
_COMMIT = re.compile(r"[0-9a-f]{40}")  # a commit id (huggingface_hub's REGEX_COMMIT_HASH)


@dataclass
class ConvertResult:
    path: Path
    type: str
    arch: str  # GGUF architecture
    size: int  # bytes of the output file
    n_tensors: int  # tensors in the output file (read from its header when quantized or cached)
    pre: str | None  # BPE pre-tokenizer name written, None for SentencePiece
    source: str  # the folder that was read
    seconds: float
    cached: bool = False
    quality: dict | None = None  # the quantization quality gate's numbers (ctxq.conversion.quality), when it ran
    source_was_quantized: bool = False  # requantized from an already quantized GGUF
    up_to_date: bool = False  # the same conversion was already at `path`: nothing was written
    imatrix: object = None  # the ImatrixResult ctxq made (or took from its cache) for a type that needs one


@one_parse  # the model's header parsed once in the call
def convert(model: str | os.PathLike, type: str | None = None, output: str | os.PathLike | None = None, *,
            revision: str | None = None, pre: str | None = None, progress: Progress | None = None,
            force: bool = False, **quant_options) -> ConvertResult:
    """Convert `model` (HF folder, hub id, or a GGUF to quantize) to `type` at `output`.

    `type` defaults to the checkpoint's own float type; `output` to
    `<ctxq models dir>/<name>-<TYPE>.gguf`. `quant_options` go to `ctxq.conversion.quantize.quantize_gguf`
    for types other than f32/f16/bf16/q8_0. The same conversion into the same path again returns
    at once (`up_to_date`, the file untouched; a hub id's from the Hugging Face cache, the Hub asked only
    whether the revision moved, and not needed); another source or type into an existing file needs
    `force` (`ctxq.conversion.output`).
    """
    t0 = time.perf_counter()
    kind = type.lower() if type else None
    if kind and kind not in FLOAT_TYPES:
        _quantize_module().parse_type(kind)  # a bad type name fails before any download or read
    src = Path(str(model)).expanduser()
    if src.is_file() and src.suffix == ".gguf":
        return _quantize_gguf_file(src, kind, output, force, progress, quant_options, t0)
    if src.is_file():
        raise ConversionError(f"{src}: pass a Hugging Face model folder, a hub id (owner/name) or a .gguf to quantize")
    ref = None if src.is_dir() else _hub_ref(str(model))
    rev = revision or (ref.revision if ref else None)
    if ref is not None and not force and (t := _up_to_date_in_cache(model, src, ref.repo, rev, kind, output, pre,
                                                                     quant_options)):
        return _cached_result(t.dest, t.qname, pre, t.ckpt, t0, up_to_date=True)
    folder = src if ref is None else download_checkpoint(ref.repo, rev)
    t = _target(model, src, folder, kind, output, pre, quant_options)
    if _up_to_date(t, force):
        return _cached_result(t.dest, t.qname, pre, t.ckpt, t0, up_to_date=True)
    _out.writable(t.dest)
    tempfiles.sweep(t.dest.parent)  # what killed runs left here
    if t.kind in FLOAT_TYPES:
        r = _convert_float(t.ckpt, t.name, t.kind, t.dest, pre, progress, t0)
    else:
        r = _convert_quantized(t.ckpt, t.name, t.qname, t.dest, t.key, pre, progress, quant_options, t0)
    _out.remember(t.dest, t.source, t.qname, t.key)
    return r


@dataclass
class _Target:
    """One conversion: what it reads, what it writes, and the key of what determines the bytes."""

    ckpt: Checkpoint
    name: str  # the model's name (general.name, the default output's stem)
    kind: str  # f32, f16, bf16, q8_0 or a quantized type, lower case
    qname: str  # the type as written in names and records (f16, Q4_K_M)
    key: dict
    dest: Path
    source: str  # what the output record names as the source: the folder, or the hub id


def _target(model, src: Path, folder: Path, kind: str | None, output, pre: str | None, quant_options: dict) -> _Target:
    ckpt = Checkpoint(folder)
    kind = kind or ckpt.source_float_type()
    name = _model_name(model, folder)
    source = str(folder.resolve()) if src.is_dir() else str(model).split("@")[0]
    if kind in FLOAT_TYPES:
        if quant_options:
            names = ", ".join(f"`{k}`" for k in sorted(quant_options))
            raise ConversionError(f"{names}: only for quantized types (e.g. q4_k_m), not {kind}")
        qname, key = kind, _float_key(ckpt, kind, pre)
    else:
        q = _quantize_module()
        qname, _ = q.parse_type(kind)
        # a type that needs an importance matrix, none given: ctxq's own, made of the f16 conversion (quantize_gguf)
        auto = q.needs_imatrix(qname) and not quant_options.get("imatrix")
        key = q.make_cache_key(qname, cache_key_extra=_hf_extra(ckpt, pre), auto_imatrix=_auto_chunks() if auto else
                               None, **{k: v for k, v in quant_options.items() if k in _KEYED_OPTIONS})
    return _Target(ckpt, name, kind, qname, key, _dest_path(output, name, qname), source)


def _up_to_date(t: _Target, force: bool) -> bool:
    if t.kind not in FLOAT_TYPES and not force and t.dest.exists() and _is_cached_at(t.key, t.dest):
        _out.remember(t.dest, t.source, t.qname, t.key)  # (recorded by a ctxq from before the output records)
    return _out.state(t.dest, t.source, t.qname, t.key, force) is _out.State.UP_TO_DATE


def _up_to_date_in_cache(model, src: Path, repo: str, rev: str | None, kind: str | None, output, pre: str | None,
                         quant_options: dict) -> _Target | None:
    """A hub id's rerun answered from the Hugging Face cache, before any download: the output is the conversion of
    the cached snapshot, and the Hub says the revision still names that commit, or cannot say (offline,
    unreachable, rate-limited, down: a rerun needs no network). None: download (the revision moved) and convert."""
    folder = cached_checkpoint(repo, rev)
    if folder is None:
        return None
    t = _target(model, src, folder, kind, output, pre, quant_options)
    if not t.dest.exists() or not _up_to_date(t, force=False):
        return None
    if _COMMIT.fullmatch(rev or ""):  # a commit never moves
        return t
    asked = ask_commit(repo, rev)
    if asked.commit is None:
        (log.info if offline() else log.warning)(
            "%s: up to date with the cached %s@%s (commit %s); could not ask the Hub whether it moved (%s)",
            t.dest, repo, rev or "main", folder.name[:12], asked.why_not)
        return t
    return t if asked.commit == folder.name else None  # a snapshot's folder is named by its commit


# The quantization options that change a quantized file's bytes (`check` does not).
_KEYED_OPTIONS = ("imatrix", "output_tensor_type", "token_embedding_type", "leave_output_tensor", "pure")
_CONVERTER = "ctxq.conversion/2"  # bump when this module's output for the same input changes


def _converter(ckpt: Checkpoint) -> str:
    """Which converter makes the file: ctxq's own, or llama.cpp's (ctxq.conversion.fallback) of its version."""
    if knows(ckpt.config):
        return _CONVERTER
    from .fallback import tag

    return tag()


def _hf_extra(ckpt: Checkpoint, pre: str | None) -> dict:
    return {"hf_source": _source_digest(ckpt), "pre": pre, "converter": _converter(ckpt)}


def _float_key(ckpt: Checkpoint, kind: str, pre: str | None) -> dict:
    """What determines a float/q8_0 conversion's bytes, as make_cache_key does for quantized types.
    The source files by size and mtime, not digest: hashing them first would read a large
    checkpoint twice on its first conversion (the quantized types' cache needs the digests)."""
    import importlib.metadata as md

    files = [[f.name, (st := f.stat()).st_size, st.st_mtime_ns] for f in _source_files(ckpt)]
    return {"extra": {"hf_files": files, "pre": pre, "converter": _converter(ckpt)}, "type": kind,
            "ctxq": md.version("ctxq"), "llama_cpp_python": md.version("llama_cpp_python")}


def _hub_ref(model: str) -> HubRef:
    ref = parse_ref(model)
    if ref is None or ref.is_gguf:
        raise ConversionError(f"{model}: no such folder, and not a hub id of a safetensors checkpoint (owner/name)")
    return ref


def _model_name(model, folder: Path) -> str:
    text = str(model).rstrip("/")
    if Path(text).exists():
        return folder.resolve().name
    return text.split("/")[-1].split("@")[0]  # USER/REPO@REVISION: the repo's name


def _dest_path(output, name: str, kind: str) -> Path:
    dest = Path(output).expanduser() if output else models_dir() / f"{name}-{kind.upper()}.gguf"
    return dest / f"{name}-{kind.upper()}.gguf" if dest.is_dir() else dest


# --- float and q8_0 output ------------------------------------------------------------------------

def _convert_float(ckpt: Checkpoint, name: str, kind: str, dest: Path, pre: str | None,
                   progress: Progress | None, t0: float) -> ConvertResult:
    tmp = tempfiles.create(dest, "gguf")
    try:
        arch, n_tensors, written_pre = _write_checked(ckpt, name, kind, tmp, pre, progress)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("wrote %s (%d tensors, %d bytes) in %.1f s", dest, n_tensors, dest.stat().st_size, time.perf_counter() - t0)
    return ConvertResult(dest, kind, arch, dest.stat().st_size, n_tensors, written_pre,
                         str(ckpt.folder), time.perf_counter() - t0)


def _write_checked(ckpt: Checkpoint, name: str, kind: str, tmp: Path, pre: str | None,
                   progress: Progress | None) -> tuple[str, int, str | None]:
    """Write the checkpoint as a `kind` GGUF into the temporary `tmp` and have llama.cpp load it back;
    returns the GGUF architecture, the tensor count and the BPE pre-tokenizer written."""
    if not knows(ckpt.config):  # llama.cpp's own converter, or one line saying neither knows it
        from . import fallback

        if pre:
            raise ConversionError(f"--pre is for ctxq's native converters; llama.cpp's converter names the "
                                  f"pre-tokenizer itself (natively: {', '.join(supported())})")
        fallback.write(ckpt, kind, tmp, progress)
        verify_loads(tmp)
        arch, n = _arch_and_count(tmp)
        return arch, n, None
    _, family = family_for(ckpt.config)
    family, cfg = resolve(family, ckpt.config)
    # a MoE config may have no dense intermediate_size (Qwen3.5-MoE: every layer has experts)
    optional = ("intermediate_size",) if family.experts is not None else ()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        v = cfg.get(key)  # (a list per layer for hybrids, from Family.config)
        if not (isinstance(v, int) or isinstance(v, list) and v and all(isinstance(x, int) for x in v)) \
                and not (key in optional and v is None):
            raise ConversionError(f"{ckpt.folder / 'config.json'}: {key} is missing or not an integer")
    if family.check:
        family.check(cfg)
    if family.configure:
        cfg = family.configure(cfg, ckpt)
    plans = plan_tensors(ckpt, family, cfg, kind)
    embd = next(p for p in plans if p.name == "token_embd.weight")
    vocab = load_vocab(ckpt.folder, cfg, embd.shape[0], pre)
    for what, text in family.special_tokens:  # where the tokenizer names none (gguf's SpecialVocab._set_special_token)
        if text in vocab.tokens and what not in vocab.special:
            vocab.special[what] = vocab.tokens.index(text)
    total = sum(nbytes(p) for p in plans)
    free = shutil.disk_usage(tmp.parent).free
    if free < total + _DISK_MARGIN:
        raise ConversionError(f"{tmp.parent} has {free / MiB:.1f} MiB free, the output needs about "
                              f"{(total + _DISK_MARGIN) / MiB:.1f} MiB; free space or write the `output` on another disk")
    write(tmp, family, cfg, vocab, plans, kind, _safe_name(name, vocab), progress, total)
    verify_loads(tmp)
    return family.arch_name, len(plans), vocab.pre


# llama_vocab::impl::load sets Phi-3 token attributes when general.name contains "phi3"/"phi-3",
# looking these tokens up with unordered_map::at: a vocabulary without them would not load.
_PHI3_NAME_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def _safe_name(name: str, vocab: Vocab) -> str:
    if re.search(r"phi-?3", name, re.I) and not set(_PHI3_NAME_TOKENS) <= set(vocab.tokens):
        log.warning("general.name %r would make llama.cpp expect Phi-3's special tokens; writing it as %r",
                    name, re.sub(r"(?i)phi-?3", "phi_3", name))
        return re.sub(r"(?i)phi-?3", "phi_3", name)
    return name


def verify_loads(path: Path) -> None:
    """Load the file's metadata, vocabulary and tensor index in llama.cpp; a rejection becomes a
    ConversionError. A dry run (no_alloc, no mmap: see NOTES) reads no weights, so checking costs
    no memory; llama_model_loader still checks every tensor's name, shape and file bounds."""
    lc = backend.llama_cpp()
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.no_alloc = True
    mp.load_mode = lc.LLAMA_LOAD_MODE_NONE
    with backend.capture_log() as lines:
        model = lc.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        why = next((ln.strip() for ln in reversed(lines) if "error" in ln.lower() or "unknown" in ln.lower()),
                   "see CTXQ_DEBUG=1 output")
        raise ConversionError(f"llama.cpp rejects the converted file ({why}); nothing was written")
    lc.llama_model_free(model)


# --- other llama.cpp types: through ctxq.conversion.quantize ---------------------------------------------------

def _quantize_module():
    try:
        from . import quantize
    except ImportError as e:  # pragma: no cover - part of ctxq
        raise ConversionError(f"quantized types need ctxq.conversion.quantize ({e})") from None
    return quantize


def _quantize_gguf_file(src: Path, kind: str | None, output, force: bool, progress, options: dict,
                        t0: float) -> ConvertResult:
    if not kind:
        raise ConversionError(f"{src} is already a GGUF; pass a TYPE to quantize it to (e.g. q4_k_m)")
    q = _quantize_module()
    if q.needs_imatrix(kind) and not options.get("imatrix"):  # ctxq's own, made by quantize_gguf (cached per file)
        options = {**options, "imatrix": q.OWN}
    r = q.quantize_gguf(src, Path(output) if output else None, kind, force=force, progress=_qprogress(progress),
                        **options)
    arch, n_tensors = _arch_and_count(r.path)
    return ConvertResult(Path(r.path), r.type, arch, r.size, n_tensors, None, str(src),
                         time.perf_counter() - t0, cached=r.cached, quality=r.quality,
                         source_was_quantized=r.source_was_quantized, imatrix=r.imatrix)


def _qprogress(progress: Progress | None):
    """The quantizer's progress as the "quantize:" phase; ctxq's importance matrix keeps its own "imatrix:"."""
    if progress is None:
        return None
    return lambda d, t, w: progress(d, t, w if w.startswith("imatrix:") else f"quantize:{w}")


def _auto_chunks() -> int:
    from .imatrix import auto_chunks

    return auto_chunks()


def _arch_and_count(path) -> tuple[str, int]:
    """A GGUF's architecture and tensor count, from its header."""
    from ..gguf.reader import read_gguf

    g = read_gguf(path, skip_arrays=True)
    return g.arch, len(g.tensors)


def _convert_quantized(ckpt: Checkpoint, name: str, qname: str, dest: Path, key: dict, pre, progress,
                       options: dict, t0: float) -> ConvertResult:
    q = _quantize_module()
    cached = q.cache_lookup(key)
    if cached is not None and cached.resolve() != dest.resolve():
        _out.place(cached, dest)  # done before, elsewhere: linked or copied instead of converting again
        return _cached_result(dest, qname, pre, ckpt, t0)
    mid = "bf16" if ckpt.source_float_type() == "bf16" else "f16"
    tmp = tempfiles.create(dest, mid)  # beside the destination, then deleted
    try:
        _write_checked(ckpt, name, mid, tmp, pre, progress)
        if qname != "MXFP4_MOE" and any(t.dtype == "U8" and t.name.endswith("_blocks") for t in ckpt.tensors.values()):
            log.warning("%s stores its experts as MXFP4: %s requantizes them (MXFP4_MOE keeps them as they are)",
                        ckpt.folder, qname)
        if q.needs_imatrix(qname) and not options.get("imatrix"):  # ctxq's own, of the f16 conversion
            options = {**options, "imatrix": q.OWN}
        r = q.quantize_gguf(tmp, dest, qname, force=True, cache_key_extra=key["extra"], progress=_qprogress(progress),
                            **options)
    finally:
        tmp.unlink(missing_ok=True)
    if r.quality and r.quality.get("reference") == str(tmp):  # the temporary is gone: name what it was
        r.quality["reference"] = f"the {mid} conversion"
    arch, n_tensors = _arch_and_count(r.path)
    return ConvertResult(Path(r.path), r.type, arch, r.size, n_tensors, pre, str(ckpt.folder),
                         time.perf_counter() - t0, quality=r.quality, imatrix=r.imatrix)


def _is_cached_at(key: dict, dest: Path) -> bool:
    cached = _quantize_module().cache_lookup(key)
    return cached is not None and cached.resolve() == dest.resolve()


def _cached_result(path: Path, qname: str, pre, ckpt: Checkpoint, t0: float, up_to_date: bool = False) -> ConvertResult:
    arch, n_tensors = _arch_and_count(path)
    return ConvertResult(path, qname, arch, path.stat().st_size, n_tensors, pre, str(ckpt.folder),
                         time.perf_counter() - t0, cached=True, up_to_date=up_to_date)


def _source_digest(ckpt: Checkpoint) -> str:
    """SHA-256 over the checkpoint files' digests (memoized per file by ctxq.digest.file_digest)."""
    import hashlib

    from ..digest import file_digest

    h = hashlib.sha256()
    for f in _source_files(ckpt):
        h.update(f.name.encode() + b"\0" + file_digest(f).encode())
    return h.hexdigest()


def _source_files(ckpt: Checkpoint) -> list[Path]:
    """The files a conversion reads: weights, configs, tokenizer, chat template."""
    return sorted({t.file for t in ckpt.tensors.values()} |
                  {p for p in ckpt.folder.iterdir() if p.suffix in (".json", ".model", ".jinja")})
