"""Which quantization fits? Plan a Hugging Face model before converting it.

From the checkpoint's config.json and safetensors headers alone (no weights are read):

1. `header_gguf()` writes the GGUF that `ctxq convert` would write at f16/bf16, header only, with
   the data region as a sparse hole (same metadata, vocabulary and tensor index).
2. `predict()` runs llama.cpp's own quantizer on it with `dry_run` (`llama_model_quantize` computes
   each tensor's target type by its recipe and logs it without touching data) and reads the
   per-tensor types and sizes from its log: the prediction is llama.cpp's, not a copy of its rules.
3. The predicted file is written header-only too, and `ctxq.planning.planner.plan_for()` plans it at the
   required context on the given devices.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from ..errors import CtxqError, DoesNotFit, InvalidOption
from ..gguf.writer import sparse_size, write_sparse_gguf
from ..paths import ctxq_home
from ..planning.devices import resolve_devices
from ..planning.options import PlanOptions
from ..planning.plan import Plan
from ..planning.planner import plan_for
from .dryrun import QVERSION_KV as _QVERSION_KV, dry_run_needs

log = logging.getLogger(__name__)

CANDIDATES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS")
# Mixture-of-experts checkpoints also get llama.cpp's MXFP4_MOE (experts MXFP4 at 4.25 bits, the rest
# Q8_0; gpt-oss's own expert format), placed before Q4_K_M: its experts have as many bits, its
# attention more.
MOE_CANDIDATES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "MXFP4_MOE", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS")
# llama.cpp's published quality figures (tools/quantize/quantize.cpp, QUANT_OPTIONS of the
# installed version): perplexity increase over f16 on the named model.
QUALITY = {
    "F16": "+0.0020 ppl @ Mistral-7B", "Q8_0": "+0.0026 ppl @ Llama-3-8B", "Q6_K": "+0.0217 ppl @ Llama-3-8B",
    "Q5_K_M": "+0.0569 ppl @ Llama-3-8B", "Q4_K_M": "+0.1754 ppl @ Llama-3-8B",
    "Q3_K_M": "+0.6569 ppl @ Llama-3-8B", "Q2_K": "+3.5199 ppl @ Llama-3-8B",
    "IQ4_XS": "4.25 bpw (no ppl figure published)",
    "MXFP4_MOE": "experts MXFP4 4.25 bpw, the rest Q8_0 (no ppl figure published)",
}
QUALITY_SOURCE = "llama.cpp tools/quantize/quantize.cpp (QUANT_OPTIONS), llama-cpp-python 0.3.36"


@dataclass
class Candidate:
    type: str
    size: int  # predicted bytes of the GGUF file
    fits: bool
    plan: Plan | None
    why_not: str = ""
    quality: str = ""
    # an importance matrix is used: llama.cpp's quantizer needs one for this type, and `ctxq convert` makes ctxq's
    # own (of the f16 conversion, cached) where --imatrix gives none
    needs_imatrix: bool = False
    recommended: bool = False


@dataclass
class HFPlan:
    model: str
    n_ctx: int
    candidates: list[Candidate] = field(default_factory=list)
    source: Path | None = None  # the header-only f16/bf16 GGUF the candidates were predicted from

    @property
    def recommended(self) -> Candidate | None:
        return next((c for c in self.candidates if c.recommended), None)


def _cache_dir() -> Path:
    d = ctxq_home() / "hfplan"
    d.mkdir(parents=True, exist_ok=True)
    return d


def header_gguf(folder: str | os.PathLike, kind: str | None = None) -> Path:
    """The f16/bf16 GGUF `ctxq convert` would write for this checkpoint, with no tensor data."""
    from .convert import plan_tensors
    from ..converters import family_for
    from ..converters.base import resolve, write_common
    from ..converters.checkpoint import Checkpoint
    from ..converters.tokenizer import load_vocab

    ckpt = Checkpoint(Path(folder))
    kind = kind or ("bf16" if ckpt.source_float_type() == "bf16" else "f16")
    _, family = family_for(ckpt.config)
    family, cfg = resolve(family, ckpt.config)  # as ctxq.conversion.convert writes it (hybrids: per-layer keys)
    plans = plan_tensors(ckpt, family, cfg, kind)
    embd = next(p for p in plans if p.name == "token_embd.weight")
    vocab = load_vocab(ckpt.folder, cfg, embd.shape[0], None)
    sig = hashlib.sha256(repr((str(ckpt.folder.resolve()), kind, [(p.name, p.shape, int(p.type)) for p in plans],
                               sorted(ckpt.config.items(), key=str))).encode()).hexdigest()[:20]
    out = _cache_dir() / f"{sig}-{kind}.gguf"
    if out.exists():
        return out

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(ckpt.folder.name)
        w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[kind])
        write_common(cfg, w)
        w.add_vocab_size(len(vocab.tokens))
        if family.extra_hparams:
            family.extra_hparams(cfg, w)
        vocab.write(w)

    # TensorPlan shapes are in numpy order; the writer takes ggml's
    return write_sparse_gguf(out, family.arch_name, [(p.name, tuple(reversed(p.shape)), p.type) for p in plans],
                             metadata)


def predict(src: Path, qtype: str) -> tuple[list[tuple[str, tuple, int]], bool]:
    """Each tensor's (name, ggml shape, ggml type) after quantizing src to qtype, by llama.cpp's
    quantizer in dry-run mode (in its worker process: llama.cpp may abort); and whether that type needs an
    importance matrix."""
    return dry_run_needs(src, qtype)


def predicted_gguf(src: Path, qtype: str) -> tuple[Path, int, bool]:
    """A header-only GGUF with the predicted types (for the planner), its predicted real file size,
    and whether the type needs an imatrix."""
    from ..gguf.reader import read_gguf
    from ..planning.derived import write_sparse

    tensors, needs = predict(src, qtype)
    g = read_gguf(src)
    size = sparse_size(g.data_offset + _QVERSION_KV, tensors)
    out = src.with_name(src.stem + f"-{qtype.upper()}.gguf")
    if not out.exists():
        write_sparse(g, out, tensors)
    return out, size, needs


def plan_hf(model: str | os.PathLike, n_ctx: int | None = None, *, types=None,
            options: PlanOptions | None = None, **settings) -> HFPlan:
    """For each candidate type (default CANDIDATES, or MOE_CANDIDATES for a mixture of experts):
    the predicted size and the plan at n_ctx; one recommended.
    `settings` (or `options`) are the `PlanOptions` each candidate is planned with, on devices
    resolved once; a `split` is refused (it is evaluated for one file, not a choice of types)."""
    opts = (options or PlanOptions()).updated(n_ctx=n_ctx, **settings).resolved()
    if opts.split is not None:
        raise InvalidOption("a `split` is evaluated for one GGUF file, not for a choice of types; "
                            "plan the converted file with it", option="split", value=opts.split)
    devices, cpu = resolve_devices(opts)
    folder = _resolve(model)
    src = header_gguf(folder)
    if types is None:
        types = MOE_CANDIDATES if _is_moe(src) else CANDIDATES
    result = HFPlan(str(model), opts.n_ctx, source=src)
    for qt in types:
        if qt.upper() in ("F16", "BF16"):
            path, size, needs = src, src.stat().st_size, False  # the sparse file has the full size
        else:
            path, size, needs = predicted_gguf(src, qt)
        c = Candidate(qt.upper(), size, False, None, quality=QUALITY.get(qt.upper(), ""), needs_imatrix=needs)
        try:
            c.plan = plan_for(path, devices, cpu, opts)
            c.fits = True
        except DoesNotFit as e:
            c.why_not = str(e)
        result.candidates.append(c)
    # a type that needs an importance matrix may be recommended: `ctxq convert` makes one when none is given
    fitting = [c for c in result.candidates if c.fits]
    on_gpu = [c for c in fitting if c.plan.on_cards and c.plan.gpus]
    # the candidates come in quality order: the first that fits all on the GPUs, else the one
    # with the fewest layers on the CPU
    best = on_gpu[0] if on_gpu else (min(fitting, key=lambda c: c.plan.cpu_layers) if fitting else None)
    if best:
        best.recommended = True
    return result


def _is_moe(src: Path) -> bool:
    """From the header ctxq wrote: {arch}.expert_count > 0 (what llama.cpp's load_hparams reads)."""
    from ..gguf.reader import read_gguf

    g = read_gguf(src, skip_arrays=True)
    return int(g.get(f"{g.arch}.expert_count") or 0) > 0


def _resolve(model) -> Path:
    p = Path(str(model)).expanduser()
    if p.is_dir():
        return p
    from ..hub import parse_ref
    from ..hub.headers import checkpoint_headers

    ref = parse_ref(model)
    if ref is not None and not ref.is_gguf:
        # config, tokenizer files and the safetensors headers are all it takes: never the weights
        folder, fetched = checkpoint_headers(ref.repo, ref.revision)
        log.info("%s: %d bytes read from the Hub (headers, config, tokenizer)", model, fetched)
        return folder
    raise CtxqError(f"{model}: not a Hugging Face model folder or hub id")
