"""What each tensor group's precision costs the answers: the table `ctxq convert MODEL fit` chooses by.

A group is one layer's attention, its dense FFN or its experts, the token embeddings or the output head
(`groups`). For every candidate type (`CANDIDATES`, llama.cpp's K-types, IQ4_XS and Q8_0) llama.cpp's quantizer
says, in a dry run, which type each tensor really gets (a row too short for a 256-block falls back as its rules
say) and so each group's bytes. Its loss at each type is then predicted from two measurements:

- the error e_g(t) = sum ||W - Q_t(W)||^2 of the group's weights at type t: the whole model quantized `pure` to t
  by llama.cpp's quantizer, read back and dequantized (gguf-py), against the source's weights;
- the sensitivity s_g: the KL divergence (next-token distributions against the source, `ctxq.quality.measure` on a
  calibration text) that the group adds when it alone moves from Q8_0 to the probe type, everything else at Q8_0
  (ExLlamaV3's measurement), per unit of the error that move adds.

The predicted loss of group g at type t is s_g * e_g(t): KL is second order in a small change of the weights, so
at a given place it grows with the squared error; the model's loss is the sum over groups. `method="error"` takes
s_g = 1, the weights' error alone (llama.cpp PR 15550's criterion, without an importance matrix), which
docs/quantize.md compares on held-out text. A header without weights (a Hub checkpoint's) gets `prior`: each
group's bits against the weights llama.cpp's own mixes give its kinds, no measurement.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import stages, tempfiles
from ..errors import ConversionError
from ..gguf.reader import read_gguf
from ..paths import ctxq_home

log = logging.getLogger(__name__)

CANDIDATES = ("Q2_K", "Q3_K", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
BASE, PROBE = "Q8_0", "Q3_K"  # the probes: one group at PROBE, the rest at BASE
METHODS = ("kl", "error")
VERSION = 1  # of the table's computation, in its cache key
CALIBRATION_CTX = 1024  # tokens a probe reads (the second half scored)
# A header without weights: llama.cpp's mixes give the output head and attention's V more bits than the rest
# (llama_tensor_get_type_impl: output Q6_K in every K mix, attn_v and half the ffn_down one step up).
PRIOR_WEIGHT = {"output": 4.0, "attn": 1.5, "ffn": 1.0, "experts": 1.0, "embeddings": 0.25}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_FLOATS = {0, 1, 30}  # ggml F32, F16, BF16


@dataclass
class Group:
    name: str  # blk.3.attn, blk.3.ffn, blk.3.experts, token_embd, output
    kind: str  # attn, ffn, experts, embeddings, output
    tensors: list[str]
    layer: int | None = None


@dataclass
class Table:
    """Per group and candidate type: bytes in the file, the ggml type each tensor gets, the predicted loss."""

    source: str
    types: list[str]
    groups: list[Group]
    bytes: dict[str, list[int]]  # group -> bytes at each type (32-byte aligned, as in the file)
    tensor_types: dict[str, list[dict[str, int]]]  # group -> at each type, {tensor: ggml type after fallbacks}
    loss: dict[str, list[float]]  # group -> predicted KL (nats) at each type
    fixed_bytes: int  # the header and the tensors no candidate changes (norms, ...)
    method: str  # kl, error or prior
    measured_on: str = ""  # the calibration: text, tokens
    base_kl: float | None = None  # the all-Q8_0 model's measured KL
    details: dict = field(default_factory=dict)  # error and sensitivity per group (kl/error methods)

    def option_costs(self) -> list[list[tuple[int, float]]]:
        return [list(zip(self.bytes[g.name], self.loss[g.name])) for g in self.groups]


def group_of(name: str) -> tuple[str, str, int | None]:
    """A tensor's group (name, kind, layer)."""
    if name.startswith("token_embd") or name.startswith("per_layer_token_embd"):
        return "token_embd", "embeddings", None
    if name.startswith("output"):
        return "output", "output", None
    m = _LAYER.match(name)
    if not m:
        return name.rsplit(".", 1)[0], "other", None
    il, rest = int(m.group(1)), m.group(2)
    kind = "experts" if "_exps" in rest else "ffn" if rest.startswith("ffn") else "attn"
    return f"blk.{il}.{kind}", kind, il


def _nbytes(shape, ggml: int) -> int:
    from ..gguf.writer import DEFAULT_ALIGNMENT, round_up, tensor_nbytes

    return round_up(tensor_nbytes(ggml, tuple(shape)), DEFAULT_ALIGNMENT)


def layout(src: Path, types=CANDIDATES) -> Table:
    """The groups, their bytes and tensor types at each candidate (dry runs of llama.cpp's quantizer); no loss yet."""
    from .dryrun import dry_run

    runs = {t: dry_run(src, t, pure=True) for t in types}
    index = {t: {n: (shape, ggml) for n, shape, ggml in r} for t, r in runs.items()}
    base = runs[types[-1]]
    # a tensor some candidate quantizes (norms stay F32 whatever the type)
    movable = [n for n, _, _ in base if any(index[t][n][1] not in _FLOATS for t in types)]
    groups: dict[str, Group] = {}
    for n in movable:
        gname, kind, il = group_of(n)
        groups.setdefault(gname, Group(gname, kind, [], il)).tensors.append(n)
    index = {t: {n: (shape, ggml) for n, shape, ggml in r} for t, r in runs.items()}
    size, ttypes = {}, {}
    for g in groups.values():
        size[g.name] = [sum(_nbytes(*index[t][n]) for n in g.tensors) for t in types]
        ttypes[g.name] = [{n: index[t][n][1] for n in g.tensors} for t in types]
    moving = set(movable)
    from ..gguf.writer import DEFAULT_ALIGNMENT, round_up

    fixed = round_up(header_bytes(src), DEFAULT_ALIGNMENT) + sum(_nbytes(shape, ggml) for n, shape, ggml in base if n not in moving)
    order = sorted(groups.values(), key=lambda x: (x.layer if x.layer is not None else (-1 if x.kind == "embeddings"
                                                                                         else 1 << 30), x.name))
    return Table(str(src), list(types), order, size, ttypes, {}, fixed, "")


def header_bytes(src: Path) -> int:
    """A quantized file's header: the source's, plus general.quantization_version if the source lacks it."""
    from .dryrun import QVERSION_KV

    g = read_gguf(src, skip_arrays=True)
    return g.data_offset + (0 if "general.quantization_version" in g.metadata else QVERSION_KV)


def prior(table: Table, src: Path) -> Table:
    """Losses without weights: a group's squared error falls by 4x per bit (2^(-2 b)), weighted by its kind."""
    shapes = {t.name: t.shape for t in read_gguf(src, skip_arrays=True).tensors}
    for g in table.groups:
        numel = sum(math.prod(shapes[n]) for n in g.tensors)
        table.loss[g.name] = [PRIOR_WEIGHT.get(g.kind, 1.0) * numel * 2.0 ** (-2 * 8 * b / numel)
                              for b in table.bytes[g.name]]
    table.method = "prior"
    return table


def _cache_dir() -> Path:
    d = ctxq_home() / "fit"
    d.mkdir(parents=True, exist_ok=True)
    return d


def calibration_text() -> Path:
    """The first half of the built-in text (the held-out half is `held_out_text`), as a file."""
    return _text_half(0)


def held_out_text() -> Path:
    return _text_half(1)


def _text_half(i: int) -> Path:
    from ..quality.measurement import builtin_text

    data = builtin_text()
    cut = data.find(b"\n\n", len(data) // 2)
    part = data[:cut] if i == 0 else data[cut + 2:]
    path = _cache_dir() / f"text-{('calibration', 'held-out')[i]}-{hashlib.sha256(part).hexdigest()[:12]}.txt"
    if not path.exists():
        tmp = tempfiles.create(path, "txt")
        try:
            tmp.write_bytes(part)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _key(src: Path, types, text: Path | None, n_ctx: int) -> str:
    from ..planning.quality_store import file_id

    stamp = [VERSION, file_id(str(src)), list(types), text.name if text else None, n_ctx,
             md.version("llama_cpp_python")]
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24]


def measure(table: Table, src: Path, *, method: str = "kl", text: Path | None = None, n_ctx: int = CALIBRATION_CTX,
            progress=None, plan_options: dict | None = None) -> Table:
    """Errors at every type and, for the kl method, each group's measured sensitivity; `table.loss` by `method`.
    Cached per source file and types (and text and context for the sensitivities)."""
    if method not in METHODS:
        raise ConversionError(f"unknown fit method {method!r}: use one of {', '.join(METHODS)}")
    label = text.name if text else "licences (calibration half)"
    text = text or calibration_text()
    cached = _cache_dir() / f"table-{_key(src, table.types, text, n_ctx)}.json"
    errors_file = _cache_dir() / f"errors-{_key(src, table.types, None, 0)}.json"
    d = json.loads(cached.read_text()) if cached.exists() else None
    if d is None or (method == "error" and errors_file.exists()):
        if d is None:
            d = {"details": {"sensitivity": None}, "base_kl": None, "measured_on": ""}
        if errors_file.exists():
            d["details"]["error"] = json.loads(errors_file.read_text())
        else:
            with _work() as tmp:
                d["details"]["error"] = _errors(table, src, Path(tmp), progress)
            _write(errors_file, d["details"]["error"])
        if method == "kl":
            with _work() as tmp:
                d["details"]["sensitivity"], d["base_kl"] = _sensitivities(
                    table, src, d["details"]["error"], Path(tmp), text, n_ctx, progress, plan_options or {})
            d["measured_on"] = f"{label}, {n_ctx:,} tokens"
            _write(cached, d)
    table.details, table.base_kl = d["details"], d["base_kl"]
    table.measured_on = d["measured_on"] if method == "kl" else "the weights (no text)"
    return losses(table, method)


def _work():
    """A temporary folder in the fit cache for the pure and probe files: removed after, or by the next sweep
    (`ctxq cache clean`, the next fit) when this process is killed."""
    tempfiles.sweep(_cache_dir())
    return tempfiles.folder(_cache_dir() / "work", "fit")


def _write(path: Path, obj) -> None:
    part = tempfiles.create(path, "json")
    try:
        part.write_text(json.dumps(obj))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def losses(table: Table, method: str) -> Table:
    """table.loss from the measured details: s_g * e_g(t) ("kl") or e_g(t) ("error")."""
    if method not in METHODS:
        raise ConversionError(f"unknown fit method {method!r}: use one of {', '.join(METHODS)}")
    err, sens = table.details["error"], table.details["sensitivity"]
    table.loss = {g.name: [(sens[g.name] if method == "kl" else 1.0) * e for e in err[g.name]] for g in table.groups}
    table.method = method
    return table


def _quantize(src: Path, out: Path, type: str, tensor_types: dict[str, str] | None = None) -> None:
    from .dryrun import quantize_raw

    quantize_raw(src, out, type, tensor_types=tensor_types)


def _errors(table: Table, src: Path, tmp: Path, progress) -> dict[str, list[float]]:
    """e_g(t) for every group and type: each type's pure file, dequantized, against the source's weights."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    source = GGUFReader(str(src))
    weights = {t.name: t for t in source.tensors}
    out = {g.name: [0.0] * len(table.types) for g in table.groups}
    owner = {n: g.name for g in table.groups for n in g.tensors}
    for j, qt in enumerate(table.types):
        if progress:
            progress(j, len(table.types) + len(table.groups) + 1, f"measure:error at {qt}")
        path = tmp / f"pure-{qt}.gguf"
        _quantize(src, path, qt)
        for t in GGUFReader(str(path)).tensors:
            if t.name not in owner:
                continue
            s = weights[t.name]
            w = dequantize(s.data, s.tensor_type).astype(np.float32)
            q = dequantize(t.data, t.tensor_type).astype(np.float32)
            out[owner[t.name]][j] += float(np.square(w.reshape(-1) - q.reshape(-1), dtype=np.float64).sum())
        path.unlink()
    return out


def _sensitivities(table: Table, src: Path, errors: dict, tmp: Path, text: Path, n_ctx: int, progress,
                   plan_options: dict) -> tuple[dict[str, float], float]:
    """s_g = (KL with g at PROBE - KL with all at BASE) / (e_g(PROBE) - e_g(BASE)), the rest at BASE."""
    from ..quality.measurement import Measurement, measure as kl_measure

    m = Measurement(n_ctx=n_ctx, text=str(text), keep_results=False, plan_options=plan_options)
    ib, ip = table.types.index(BASE), table.types.index(PROBE)
    n = len(table.types) + len(table.groups) + 1

    def kl(path: Path) -> float:
        return kl_measure(path, m, against=src)[0].mean_kl

    base = tmp / "base.gguf"
    _quantize(src, base, BASE)
    base_kl = kl(base)
    base.unlink()
    sens = {}
    for i, g in enumerate(table.groups):
        if progress:
            progress(len(table.types) + 1 + i, n, f"measure:{g.name}")
        d_err = errors[g.name][ip] - errors[g.name][ib]
        if d_err <= 0:  # the probe changes nothing here (a type the shape cannot take)
            sens[g.name] = 0.0
            continue
        probe = tmp / "probe.gguf"
        _quantize(src, probe, BASE, {t: PROBE for t in g.tensors})
        stages.reached("fit-probe")  # tests only (ctxq.stages)
        d_kl = kl(probe) - base_kl
        probe.unlink()
        # below the noise of the measurement the group still costs something: a floor of 1 % of the base's KL
        sens[g.name] = max(d_kl, 0.01 * base_kl) / d_err
        log.debug("%s: dKL %.3g, d_err %.3g", g.name, d_kl, d_err)
    if progress:
        progress(n, n, "measure:")
    return sens, base_kl
