"""`ctxq convert`: a Hugging Face checkpoint (local folder or hub id) to a GGUF llama.cpp loads.

Float types (f32, f16, bf16) and q8_0 are written here, tensor by tensor from memory-mapped
safetensors; any other llama.cpp type is made from a temporary f16/bf16 GGUF by
`ctxq.conversion.quantize.quantize_gguf`. The output appears at its destination only complete and verified:
it is written under a temporary name beside it, loaded by llama.cpp, then renamed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as FT

from .. import tempfiles
from ..llama import backend
from ..converters import family_for
from ..converters.base import (Family, TensorPlan, head_dim, output_is_token_embd, permute_rope, text_config,
                               write_common)
from ..converters.checkpoint import Checkpoint
from ..converters.tokenizer import Vocab, load_vocab
from ..errors import ConversionError
from ..gguf.reader import tensor_nbytes
from ..models import models_dir
from ..units import MiB

log = logging.getLogger(__name__)

# progress(done, total, what): what is "write:<tensor>" while bytes are written here, and
# "quantize:<tensor>" while ctxq.conversion.quantize works tensor by tensor.
Progress = Callable[[int, int, str], None]

FLOAT_TYPES = {"f32": (T.F32, FT.ALL_F32), "f16": (T.F16, FT.MOSTLY_F16), "bf16": (T.BF16, FT.MOSTLY_BF16),
               "q8_0": (T.Q8_0, FT.MOSTLY_Q8_0)}
_QK8_0 = gguf.GGML_QUANT_SIZES[T.Q8_0][0]  # 32 weights per Q8_0 block
_DISK_MARGIN = 64 * MiB  # header, alignment padding and the filesystem's own slack


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


def convert(model: str | os.PathLike, type: str | None = None, output: str | os.PathLike | None = None, *,
            revision: str | None = None, pre: str | None = None, progress: Progress | None = None,
            force: bool = False, **quant_options) -> ConvertResult:
    """Convert `model` (HF folder, hub id, or a GGUF to quantize) to `type` at `output`.

    `type` defaults to the checkpoint's own float type; `output` to
    `<ctxq models dir>/<name>-<TYPE>.gguf`. `quant_options` go to `ctxq.conversion.quantize.quantize_gguf`
    for types other than f32/f16/bf16/q8_0.
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
    folder = src if src.is_dir() else _download(str(model), revision)
    ckpt = Checkpoint(folder)
    kind = kind or ckpt.source_float_type()
    name = _model_name(model, folder)
    if kind in FLOAT_TYPES:
        if quant_options:
            names = ", ".join(f"`{k}`" for k in sorted(quant_options))
            raise ConversionError(f"{names}: only for quantized types (e.g. q4_k_m), not {kind}")
        dest = _dest(output, name, kind, force)
        return _convert_float(ckpt, name, kind, dest, pre, progress, t0)
    return _convert_quantized(ckpt, name, kind, output, pre, force, progress, quant_options, t0)


def _download(model: str, revision: str | None) -> Path:
    from ..hub import parse_ref
    from ..hub.download import download_checkpoint

    ref = parse_ref(model)
    if ref is None or ref.is_gguf:
        raise ConversionError(f"{model}: no such folder, and not a hub id of a safetensors checkpoint (owner/name)")
    return download_checkpoint(ref.repo, revision or ref.revision)


def _model_name(model, folder: Path) -> str:
    text = str(model).rstrip("/")
    if Path(text).exists():
        return folder.resolve().name
    return text.split("/")[-1].split("@")[0]  # USER/REPO@REVISION: the repo's name


def _dest_path(output, name: str, kind: str) -> Path:
    dest = Path(output).expanduser() if output else models_dir() / f"{name}-{kind.upper()}.gguf"
    return dest / f"{name}-{kind.upper()}.gguf" if dest.is_dir() else dest


def _dest(output, name: str, kind: str, force: bool) -> Path:
    """The output path, refused when it exists (unless force); its folder is created."""
    dest = _dest_path(output, name, kind)
    if dest.exists() and not force:
        raise ConversionError(f"{dest} exists; pass force=True to replace it or another `output` path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tempfiles.sweep(dest.parent)  # what killed runs left here
    return dest


# --- float and q8_0 output ------------------------------------------------------------------------

def _convert_float(ckpt: Checkpoint, name: str, kind: str, dest: Path, pre: str | None,
                   progress: Progress | None, t0: float) -> ConvertResult:
    tmp = tempfiles.create(dest, "gguf")
    try:
        family, n_tensors, vocab = _write_checked(ckpt, name, kind, tmp, pre, progress)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("wrote %s (%d tensors, %d bytes) in %.1f s", dest, n_tensors, dest.stat().st_size, time.perf_counter() - t0)
    return ConvertResult(dest, kind, family.arch_name, dest.stat().st_size, n_tensors, vocab.pre,
                         str(ckpt.folder), time.perf_counter() - t0)


def _write_checked(ckpt: Checkpoint, name: str, kind: str, tmp: Path, pre: str | None,
                   progress: Progress | None) -> tuple[Family, int, Vocab]:
    """Write the checkpoint as a `kind` GGUF into the temporary `tmp` and have llama.cpp load it back."""
    _, family = family_for(ckpt.config)
    cfg = text_config(ckpt.config)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(cfg.get(key), int):
            raise ConversionError(f"{ckpt.folder / 'config.json'}: {key} is missing or not an integer")
    if family.check:
        family.check(cfg)
    plans = plan_tensors(ckpt, family, cfg, kind)
    embd = next(p for p in plans if p.name == "token_embd.weight")
    vocab = load_vocab(ckpt.folder, cfg, embd.shape[0], pre)
    total = sum(_nbytes(p) for p in plans)
    free = shutil.disk_usage(tmp.parent).free
    if free < total + _DISK_MARGIN:
        raise ConversionError(f"{tmp.parent} has {free / MiB:.1f} MiB free, the output needs about "
                              f"{(total + _DISK_MARGIN) / MiB:.1f} MiB; free space or write the `output` on another disk")
    _write(tmp, family, cfg, vocab, plans, kind, _safe_name(name, vocab), progress, total)
    verify_loads(tmp)
    return family, len(plans), vocab


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# llama_vocab::impl::load sets Phi-3 token attributes when general.name contains "phi3"/"phi-3",
# looking these tokens up with unordered_map::at: a vocabulary without them would not load.
_PHI3_NAME_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def _safe_name(name: str, vocab: Vocab) -> str:
    if re.search(r"phi-?3", name, re.I) and not set(_PHI3_NAME_TOKENS) <= set(vocab.tokens):
        log.warning("general.name %r would make llama.cpp expect Phi-3's special tokens; writing it as %r",
                    name, re.sub(r"(?i)phi-?3", "phi_3", name))
        return re.sub(r"(?i)phi-?3", "phi_3", name)
    return name


def plan_tensors(ckpt: Checkpoint, family: Family, cfg: dict, kind: str) -> list[TensorPlan]:
    """Every output tensor in llama.cpp's naming with its type and a loader applying the family's transforms."""
    n_layer = cfg["num_hidden_layers"]
    nmap = gguf.get_tensor_name_map(family.arch, n_layer)
    n_head = cfg["num_attention_heads"]
    n_head_kv = cfg.get("num_key_value_heads") or n_head
    skip_head = output_is_token_embd(ckpt, family, cfg)
    plans: list[TensorPlan] = []
    for hf_name, ref in ckpt.tensors.items():
        if hf_name.endswith("rotary_emb.inv_freq") or (skip_head and hf_name == "lm_head.weight"):
            continue  # llama.cpp derives these (or duplicates token_embd for a tied output)
        name = nmap.get_name(hf_name.removeprefix("language_model."), try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConversionError(f"tensor {hf_name} has no place in llama.cpp's {family.arch_name} architecture")
        transform = None
        if family.permute_qk and re.search(r"\.attn_(q|k)\.", name):
            heads = n_head if ".attn_q." in name else n_head_kv
            transform = (lambda h: lambda x: permute_rope(x, h))(heads)
        elif family.norm_shift and name.endswith("norm.weight"):
            transform = (lambda s: lambda x: x + np.float32(s))(family.norm_shift)
        # Whole tensor when a transform needs it (Q/K permutation mixes rows within a head, and
        # those tensors are small); otherwise row blocks, so the embedding never sits in memory whole.
        blocks = (lambda r, f: (lambda: [f(r.load_f32())]) if f else r.iter_f32)(ref, transform)
        plans.append(TensorPlan(name, ref.shape, _out_type(name, ref.shape, kind), blocks))
    for name, arr in (family.extra_tensors(cfg) if family.extra_tensors else {}).items():
        plans.append(TensorPlan(name, arr.shape, T.F32, (lambda a: lambda: [a])(arr)))
    if not any(p.name == "token_embd.weight" for p in plans):
        raise ConversionError(f"{ckpt.folder}: no token embedding tensor (model.embed_tokens.weight)")
    if head_dim(cfg) % 2:
        raise ConversionError(f"head_dim {head_dim(cfg)} is odd; rotary embeddings need an even head size")
    plans.sort(key=lambda p: (int(m.group(1)) if (m := _BLOCK_RE.match(p.name)) else
                              (-1 if p.name.startswith("token_embd") else n_layer), p.name))
    return plans


def _out_type(name: str, shape: tuple[int, ...], kind: str) -> T:
    # As llama.cpp's converter: norms, biases and other 1-D tensors stay F32 (they are tiny and
    # several ops need F32 for them); Q8_0 needs rows that are whole blocks, else F16.
    if len(shape) < 2 or name.endswith("norm.weight"):
        return T.F32
    target = FLOAT_TYPES[kind][0]
    if target == T.Q8_0 and shape[-1] % _QK8_0:
        return T.F16
    return target


def _nbytes(p: TensorPlan) -> int:
    return tensor_nbytes(p.type, tuple(reversed(p.shape)))  # TensorPlan shapes are in numpy order


def _encode(x: np.ndarray, t: T) -> np.ndarray:
    if t == T.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if t == T.F16:
        return x.astype(np.float16)
    return gguf.quants.quantize(x, t)  # BF16 (round to nearest even) and Q8_0, in numpy


def _write(path: Path, family: Family, cfg: dict, vocab: Vocab, plans: list[TensorPlan], kind: str,
           name: str, progress: Progress | None, total: int) -> None:
    w = gguf.GGUFWriter(path, family.arch_name)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_file_type(FLOAT_TYPES[kind][1])
    if kind == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_common(cfg, w)
    w.add_vocab_size(len(vocab.tokens))
    if family.extra_hparams:
        family.extra_hparams(cfg, w)
    vocab.write(w)
    for p in plans:
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), _nbytes(p), raw_dtype=p.type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # Tensor data is written here block by block (GGUFWriter.write_tensor_data takes whole
    # tensors): each tensor starts at the next multiple of the alignment, as the offsets it wrote say.
    f = w.fout[0]
    align = w.data_alignment
    done = 0
    try:
        for p in plans:
            f.write(b"\0" * (-f.tell() % align))
            start = f.tell()
            for block in p.blocks():
                data = _encode(block, p.type)
                data.tofile(f)
                done += data.nbytes
                del data, block
                if progress:
                    progress(done, total, f"write:{p.name}")
            if f.tell() - start != _nbytes(p):
                raise ConversionError(f"{p.name}: wrote {f.tell() - start} bytes, expected {_nbytes(p)}")
        f.write(b"\0" * (-f.tell() % align))
    finally:
        w.close()


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
    qprogress = (lambda d, t, w: progress(d, t, f"quantize:{w}")) if progress else None
    r = q.quantize_gguf(src, Path(output) if output else None, kind, force=force, progress=qprogress, **options)
    arch, n_tensors = _arch_and_count(r.path)
    return ConvertResult(Path(r.path), r.type, arch, r.size, n_tensors, None, str(src),
                         time.perf_counter() - t0, cached=r.cached, quality=r.quality,
                         source_was_quantized=r.source_was_quantized)


def _arch_and_count(path) -> tuple[str, int]:
    """A GGUF's architecture and tensor count, from its header."""
    from ..gguf.reader import read_gguf

    g = read_gguf(path, skip_arrays=True)
    return g.arch, len(g.tensors)


def _convert_quantized(ckpt: Checkpoint, name: str, kind: str, output, pre, force: bool, progress, options: dict,
                       t0: float) -> ConvertResult:
    q = _quantize_module()
    qname, _ = q.parse_type(kind)
    if q.needs_imatrix(qname) and not options.get("imatrix"):  # refuse before converting anything
        raise ConversionError(f"{qname} needs an importance matrix: pass imatrix=FILE.gguf (llama-imatrix output)")
    extra = {"hf_source": _source_digest(ckpt), "pre": pre, "converter": "ctxq.conversion/1"}
    key = q.make_cache_key(qname, cache_key_extra=extra, **{k: v for k, v in options.items() if k in (
        "imatrix", "output_tensor_type", "token_embedding_type", "leave_output_tensor", "pure")})
    cached = None if force else q.cache_lookup(key)
    wanted = _dest_path(output, name, qname)
    if cached is not None and wanted.exists() and cached.resolve() == wanted.resolve():
        return _cached_result(wanted, qname, pre, ckpt, t0)  # the same conversion is already there
    dest = _dest(output, name, qname, force)
    if cached is not None:  # done before, elsewhere: copy it instead of converting again
        part = tempfiles.create(dest, "copy")
        try:
            shutil.copyfile(cached, part)
            os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)
        return _cached_result(dest, qname, pre, ckpt, t0)
    mid = "bf16" if ckpt.source_float_type() == "bf16" else "f16"
    tmp = tempfiles.create(dest, mid)  # beside the destination, then deleted
    try:
        _write_checked(ckpt, name, mid, tmp, pre, progress)
        qprogress = (lambda d, t, w: progress(d, t, f"quantize:{w}")) if progress else None
        r = q.quantize_gguf(tmp, dest, qname, force=True, cache_key_extra=extra, progress=qprogress, **options)
    finally:
        tmp.unlink(missing_ok=True)
    arch, n_tensors = _arch_and_count(r.path)
    return ConvertResult(Path(r.path), r.type, arch, r.size, n_tensors, pre, str(ckpt.folder),
                         time.perf_counter() - t0, quality=r.quality)


def _cached_result(path: Path, qname: str, pre, ckpt: Checkpoint, t0: float) -> ConvertResult:
    arch, n_tensors = _arch_and_count(path)
    return ConvertResult(path, qname, arch, path.stat().st_size, n_tensors, pre, str(ckpt.folder),
                         time.perf_counter() - t0, cached=True)


def _source_digest(ckpt: Checkpoint) -> str:
    """SHA-256 over the checkpoint files' digests (memoized per file by ctxq.conversion.quantize.file_digest)."""
    import hashlib

    from .quantize import file_digest

    h = hashlib.sha256()
    files = sorted({t.file for t in ckpt.tensors.values()} |
                   {p for p in ckpt.folder.iterdir() if p.suffix in (".json", ".model", ".jinja")})
    for f in files:
        h.update(f.name.encode() + b"\0" + file_digest(f).encode())
    return h.hexdigest()
