"""What each tensor group's precision costs the answers: the table `ctxq convert MODEL fit` chooses by.

A group is one layer's attention, its dense FFN or its experts, the token embeddings or the output head
(`groups`). For every candidate type (`CANDIDATES`: llama.cpp's K-types, the IQ types from IQ2_XXS to IQ4_XS, Q8_0)
llama.cpp's quantizer says, in a dry run, which type each tensor really gets (a row too short for a 256-block falls
back as its rules say) and so each group's bytes; an IQ type that no tensor takes (every row falls back) is left out.
Its loss at each type is then predicted from two measurements:

- the error e_g(t) = sum_j a_j ||W_:j - Q_t(W)_:j||^2 of the group's weights at type t, a_j the mean squared input of
  column j from the model's importance matrix (`weight_errors`; ctxq's own, made once per file as `ctxq convert`
  makes it): the whole model quantized `pure` to t by llama.cpp's quantizer (the IQ types with the matrix), read
  back and dequantized (gguf-py), against the source's weights;
- the sensitivity s_g: the KL divergence (next-token distributions against the source, `ctxq.quality.measure` on a
  calibration text) that the group adds when it alone moves from Q8_0 to the probe type, everything else at Q8_0
  (ExLlamaV3's measurement), per unit of the error that move adds.

The predicted loss of group g at type t is s_g * e_g(t): KL is second order in a small change of the weights, so
at a given place it grows with the squared error; the model's loss is the sum over groups. `method="error"` takes
s_g = 1, the weights' error alone (llama.cpp PR 15550's criterion, here weighted as llama.cpp's quantizers weight
it), which docs/quantize.md compares on held-out text. A header without weights (a Hub checkpoint's) gets `prior`:
each group's bits against the weights llama.cpp's own mixes give its kinds, no measurement. IQ2_XXS and IQ2_XS
need an importance matrix entry, which only blk.* weights have: the embeddings and the output head never take them.
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

# By bits per weight (ggml-common.h blocks). The IQ types below 3.5 bits are measured with the model's importance
# matrix (ctxq's own: `imatrix`), and kept only where some tensor takes them (`layout`).
CANDIDATES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K", "IQ3_XXS", "IQ3_S", "Q3_K", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K",
              "Q8_0")
IMATRIX_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")  # quantization.IMATRIX_TENSOR_TYPES's candidates
# ggml asserts an importance matrix for these (quantize_row_iq2_xxs_impl, _iq2_xs_impl: "missing quantization
# weights"), and the matrix holds only blk.* weights: the token embeddings and the output head cannot take them.
NEEDS_WEIGHTS = ("IQ2_XXS", "IQ2_XS")
# The file type whose tensors a pure run gives each candidate: llama_ftype_get_default_type maps the IQ2_S file type
# to IQ2_XS tensors and IQ2_M to IQ2_S. (As a tensor type, `tensor_types`, a candidate is its own name.)
FTYPE = {"IQ2_S": "IQ2_M"}
BASE, PROBE = "Q8_0", "Q3_K"  # the probes: one group at PROBE, the rest at BASE
METHODS = ("kl", "error")
VERSION = 2  # of the table's computation, in its cache key (2: errors weighted by the importance matrix)
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
    excluded: list = field(default_factory=list)  # [group, type] a group cannot take: loss inf, its largest bytes

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

    runs = {t: dry_run(src, FTYPE.get(t, t), pure=True) for t in types}
    types = [t for t in types if t not in IMATRIX_TYPES or _taken(runs[t], t)]  # an IQ type all rows refuse: a copy
    runs = {t: runs[t] for t in types}
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
    excluded = []
    for g in groups.values():
        size[g.name] = [sum(_nbytes(*index[t][n]) for n in g.tensors) for t in types]
        ttypes[g.name] = [{n: index[t][n][1] for n in g.tensors} for t in types]
        for j, t in enumerate(types):  # never chosen: no byte saved, an infinite loss
            if t in NEEDS_WEIGHTS and any(_unweighted(n, t, index[t][n][1]) for n in g.tensors):
                excluded.append([g.name, t])
                size[g.name][j] = max(size[g.name])
    moving = set(movable)
    from ..gguf.writer import DEFAULT_ALIGNMENT, round_up

    fixed = round_up(header_bytes(src), DEFAULT_ALIGNMENT) + sum(_nbytes(shape, ggml) for n, shape, ggml in base if n not in moving)
    order = sorted(groups.values(), key=lambda x: (x.layer if x.layer is not None else (-1 if x.kind == "embeddings"
                                                                                         else 1 << 30), x.name))
    return Table(str(src), list(types), order, size, ttypes, {}, fixed, "", excluded=excluded)


def _unweighted(name: str, type: str, ggml: int) -> bool:
    """A tensor that would get `type` (one of NEEDS_WEIGHTS) with no importance matrix entry (not a blk.* weight)."""
    from gguf import GGMLQuantizationType as T

    return not name.startswith("blk.") and ggml == int(T[type])


def _exclude(table: Table) -> Table:
    for gname, t in table.excluded:
        if t in table.types and gname in table.loss:
            table.loss[gname][table.types.index(t)] = math.inf
    return table


def _taken(run, type: str) -> bool:
    """Whether some tensor gets `type` itself in its pure dry run (not the fallback of rows it cannot hold: IQ4_NL)."""
    from gguf import GGMLQuantizationType as T

    return any(ggml == int(T[type]) for _, _, ggml in run)


def without(table: Table, drop) -> Table:
    """The table without the candidate types `drop` (the IQ types, when no importance matrix can be made)."""
    keep = [i for i, t in enumerate(table.types) if t not in drop]
    pick = lambda d: {g: [v[i] for i in keep] for g, v in d.items()}  # noqa: E731
    return Table(table.source, [table.types[i] for i in keep], table.groups, pick(table.bytes),
                 pick(table.tensor_types), pick(table.loss), table.fixed_bytes, table.method,
                 excluded=[e for e in table.excluded if e[1] not in drop])


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
    return _exclude(table)


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


def _key(src: Path, types, text: Path | None, n_ctx: int, imatrix: Path | None) -> str:
    from ..digest import file_digest
    from ..planning.quality_store import file_id

    stamp = [VERSION, file_id(str(src)), list(types), text.name if text else None, n_ctx,
             md.version("llama_cpp_python"), file_digest(imatrix) if imatrix else None]
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24]


def model_imatrix(src: Path, progress=None) -> Path | None:
    """ctxq's importance matrix of `src` (made once per file, as `ctxq convert` makes it for a type that needs one,
    so the file written later takes the same); None, said in the log, where llama.cpp cannot make one."""
    from .imatrix import auto_chunks, make_imatrix

    try:
        return make_imatrix(src, chunks=auto_chunks(), progress=progress).path
    except ConversionError as e:
        log.warning("no importance matrix for %s (%s): the fit leaves out %s and weights no error", src.name, e,
                    ", ".join(IMATRIX_TYPES))
        return None


def measure(table: Table, src: Path, *, method: str = "kl", text: Path | None = None, n_ctx: int = CALIBRATION_CTX,
            progress=None, plan_options: dict | None = None, imatrix: Path | None | bool = True) -> Table:
    """Errors at every type and, for the kl method, each group's measured sensitivity; `table.loss` by `method`.
    `imatrix` True: ctxq's own importance matrix of `src` (`model_imatrix`) quantizes the IQ types and weights every
    error; a path: that matrix; False: none (the IQ types are left out, the errors unweighted). Cached per source
    file, types and matrix (and text and context for the sensitivities). The table returned may be a new one
    (`without` the IQ types)."""
    if method not in METHODS:
        raise ConversionError(f"unknown fit method {method!r}: use one of {', '.join(METHODS)}")
    imatrix = model_imatrix(src, progress) if imatrix is True else (Path(imatrix) if imatrix else None)
    if imatrix is None:
        table = without(table, IMATRIX_TYPES)
    label = text.name if text else "licences (calibration half)"
    text = text or calibration_text()
    cached = _cache_dir() / f"table-{_key(src, table.types, text, n_ctx, imatrix)}.json"
    errors_file = _cache_dir() / f"errors-{_key(src, table.types, None, 0, imatrix)}.json"
    with tempfiles.building(cached):  # a second process measuring the same table waits for the first one's
        d = json.loads(cached.read_text()) if cached.exists() else None
        if d is None or (method == "error" and errors_file.exists()):
            if d is None:
                d = {"details": {"sensitivity": None}, "base_kl": None, "measured_on": ""}
            if errors_file.exists():
                d["details"].update(json.loads(errors_file.read_text()))
            else:
                with _work() as tmp:
                    d["details"]["error"], d["details"]["error_unweighted"] = _errors(table, src, Path(tmp), progress,
                                                                                      imatrix)
                _write(errors_file, {k: d["details"][k] for k in ("error", "error_unweighted")})
            if method == "kl":
                with _work() as tmp:
                    d["details"]["sensitivity"], d["base_kl"] = _sensitivities(
                        table, src, d["details"]["error"], Path(tmp), text, n_ctx, progress, plan_options or {})
                d["measured_on"] = f"{label}, {n_ctx:,} tokens"
                _write(cached, d)
    table.details, table.base_kl = d["details"], d["base_kl"]
    table.details["imatrix"] = str(imatrix) if imatrix else None
    weights = "the weights, by the importance matrix" if imatrix else "the weights (no text)"
    table.measured_on = d["measured_on"] if method == "kl" else weights
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
    return _exclude(table)


def _quantize(src: Path, out: Path, type: str, tensor_types: dict[str, str] | None = None) -> None:
    from .weight_errors import quantize_pure

    quantize_pure(src, out, type, tensor_types)


def weighted_error(w, q, a) -> float:
    """sum_j a_j sum_i (W_ij - Q_ij)^2 (`weight_errors.weighted_error`): the criterion of method "error"."""
    from .weight_errors import weighted_error as we

    return we(w, q, a)


def _errors(table: Table, src: Path, tmp: Path, progress, imatrix: Path | None = None) -> tuple[dict, dict]:
    """e_g(t) for every group and type, weighted by the importance matrix and unweighted (`weight_errors.errors`):
    the IMATRIX_TYPES quantized with the matrix, the others without, as a written mix is
    (`quantize.IMATRIX_TENSOR_TYPES`); an excluded tensor at Q8_0 (its option is never chosen)."""
    from .weight_errors import errors

    spare = {qt: {n: BASE for gn, t in table.excluded if t == qt for n in _group(table, gn).tensors
                  if not n.startswith("blk.")} for qt in table.types}
    return errors(table, src, tmp, progress, imatrix, IMATRIX_TYPES, spare, FTYPE)


def _group(table: Table, name: str) -> Group:
    return next(g for g in table.groups if g.name == name)


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
