"""`ctxq quality`: what a precision saving costs the answers, measured on the user's own text.

One reference and any number of candidates read the same N tokens once each, in order, at the context asked;
the second half of the positions (the long-range part, each predicting its next token with at least N/2 tokens
before it) is scored: mean and 99th-percentile KL(reference || candidate) in nats, top-1 agreement and the
candidate's perplexity. KV pairs are measured against an f16 cache with the same weights; weights (`against`)
against a more precise file of the same model with the same cache types; the whole configuration (`against` and
`whole`: the weights with each cache pair) against the more precise file with an f16 cache.

Each run is a plan (`ctxq.plan` with that cache type and the devices given: what does not fit moves to the CPU)
loaded in a child process (`quality.worker`). The reference's distributions are kept as their top entries plus
the rest of the mass (`quality.stats`); results are cached per model file, text, context, configuration and
llama.cpp version (`results()` lists them for the planner).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata as md
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .. import children, interrupts, tempfiles
from ..errors import CtxqError, InvalidOption
from ..gguf.once import one_parse
from ..units import default_threads, last_error_line
from . import stats
from ..planning.quality_store import METHOD, Result, cache_dir as _cache, file_id as _file_id, results  # noqa: F401 (the API)

log = logging.getLogger(__name__)

BUILTIN_TEXT = "licences"  # the built-in text's name in results
_BUILTIN = Path(__file__).with_name("licences.txt.gz")


class QualityError(CtxqError):
    """A measurement could not be made (bad text, another model, llama.cpp failed); one line."""


def parse_pairs(spec: str | list | None) -> list[tuple[str, str]]:
    """"f16,q8_0,q8_0/q4_0" -> [(f16, f16), (q8_0, q8_0), (q8_0, q4_0)]; InvalidOption for an unknown type."""
    from ..gguf.info import KV_TYPES

    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    out = []
    for item in items:
        k, _, v = str(item).strip().partition("/")
        v = v or k
        for t in (k, v):
            if t not in KV_TYPES:
                raise InvalidOption(f"unknown KV type {t!r}: use one of {', '.join(KV_TYPES)}, or K/V such as "
                                    "q8_0/q4_0", option="kv", value=item)
        out.append((k, v))
    return out


def builtin_text() -> bytes:
    """The built-in English text: licence texts (GPL, LGPL, MPL, Apache, GFDL, CC0, Artistic), verbatim."""
    with gzip.open(_BUILTIN, "rb") as f:
        return f.read()


def _key(*parts) -> str:
    stamp = [METHOD, stats.TAIL, md.version("llama_cpp_python"), *parts]  # top_k is among the parts
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:32]


def kv_bytes_per_token(model: str, type_k: str, type_v: str) -> int:
    """Bytes one token of context takes in the KV cache of the attention layers (windows aside)."""
    from ..gguf.info import kv_bytes, model_info

    info = model_info(model)
    return sum(kv_bytes(type_k, info.n_embd_k_gqa(il)) + kv_bytes(type_v, info.n_embd_v_gqa(il))
               for il, layer in enumerate(info.layers) if layer.attention)


class _Child:
    """One worker process: started in a session of its own (a terminal's Ctrl-C reaches only ctxq, which kills it),
    its stderr (llama.cpp's log, an assert's message) in a file for the one-line failure."""

    def __init__(self, job: dict, workdir: Path, progress, label: str):
        self.job, self.progress, self.label = job, progress, label
        self.err = workdir / "stderr.txt"
        with open(self.err, "wb") as err:  # the lifeline: it ends at once when ctxq does (ctxq.children)
            self.proc = subprocess.Popen([sys.executable, "-m", "ctxq.quality.worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                         **children.lifeline())

    def run(self) -> dict:
        try:
            self.proc.stdin.write(json.dumps(self.job).encode())
            self.proc.stdin.close()
            for line in interrupts.lines(self.proc.stdout.fileno()):  # a stop signal ends the wait (issue 56)
                parts = line.split()
                if len(parts) == 3 and parts[0] == b"progress" and self.progress:
                    self.progress(self.label, int(parts[1]), int(parts[2]))
            rc = self.proc.wait()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
        try:
            result = json.loads(Path(self.job["out"] + ".json").read_text())
        except (OSError, ValueError):
            result = {}
        if "error" in result:
            raise QualityError(f"{self.label}: {result['error']}")
        if rc != 0:
            tail = self.err.read_text(errors="replace").splitlines()[-60:]
            why = last_error_line(tail, "") or (tail[-1] if tail else "")
            died = f"died with {signal.Signals(-rc).name}" if rc < 0 else f"failed (exit status {rc})"
            raise QualityError(f"{self.label}: llama.cpp {died}" + (f": {why[:200]}" if why else ""))
        return result


@dataclass
class Measurement:
    """What `measure` needs besides the configurations: the text, context, devices and progress."""

    n_ctx: int
    text: str | None = None  # a file; None: the built-in text
    plan_options: dict = field(default_factory=dict)  # devices and settings for ctxq.plan (gpus, rpc, ...)
    progress: object = None  # progress(label, done_tokens, total_tokens)
    top_k: int = stats.TOP_K
    use_cache: bool = True
    keep_results: bool = True  # False: candidates' results neither read from nor written to the cache (temporary
    # files, such as `ctxq convert fit`'s probes); the reference is cached as `use_cache` says

    def open_text(self):
        """The text file, open and its first block checked (`ctxq.textfile.TextFile`: NotText for a binary);
        None for the built-in text."""
        from ..textfile import TextFile

        return None if self.text is None else TextFile(self.text)

    def text_bytes(self, opened=None, limit: int | None = None) -> bytes:
        """The text (from `opened`, `open_text()`'s file, when given), at most `limit` bytes of it."""
        if self.text is None:
            return builtin_text()
        opened = opened or self.open_text()
        return opened.read(limit)[0]

    @property
    def text_name(self) -> str:
        return BUILTIN_TEXT if self.text is None else Path(self.text).name


def _plan(model: str, m: Measurement, type_k: str, type_v: str):
    from ..planning.planner import plan

    return plan(model, m.n_ctx, type_k=type_k, type_v=type_v, **m.plan_options)


def _run(model: str, m: Measurement, type_k: str, type_v: str, label: str, job: dict, dest: Path) -> dict:
    """Plan, run the worker into a temporary beside `dest`, move it into place; the worker's result."""
    p = _plan(model, m, type_k, type_v)
    with tempfile.TemporaryDirectory(prefix="ctxq-quality-") as tmp:
        work = Path(tmp)
        (work / "plan.pkl").write_bytes(pickle.dumps(p))
        part = tempfiles.create(dest, "npz")
        try:
            job = {**job, "plan": str(work / "plan.pkl"), "n_tokens": m.n_ctx, "score_from": m.n_ctx // 2,
                   "top_k": m.top_k, "out": str(part), "threads": default_threads()}
            result = _Child(job, work, m.progress, label).run()
            os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)
            Path(str(part) + ".json").unlink(missing_ok=True)
    return result


def _reference(ref_model: str, m: Measurement, type_k: str, type_v: str, text_file: Path, sha: str) -> Path:
    """The reference's compact distributions (and the tokens), computed once per model, text, context and types."""
    dest = _cache() / f"ref-{_key(_file_id(ref_model), sha, m.n_ctx, type_k, type_v, m.top_k)}.npz"
    if m.use_cache and dest.exists():
        return dest
    _run(ref_model, m, type_k, type_v, f"reference {Path(ref_model).name} {type_k}/{type_v}",
         {"text": str(text_file), "tokens": None, "reference": None}, dest)
    return dest


@one_parse  # the model's header parsed once in the call
def measure(model: str | os.PathLike, m: Measurement, pairs: list[tuple[str, str]] | None = None, *,
            against: str | os.PathLike | None = None, whole: bool = False) -> list[Result]:
    """Measure each KV pair of `pairs` (default: f16/f16 and q8_0/q8_0) against an f16 cache of `model`; or, with
    `against`, `model`'s weights against that file's at each pair (default f16/f16); with `whole` too, `model` at
    each pair against that file with an f16 cache (what weights and cache cost together). Results are cached."""
    from ..models import resolve_model

    model = str(resolve_model(model))
    if m.n_ctx < 16:
        raise InvalidOption(f"a quality measurement needs a context of 16 tokens or more, not {m.n_ctx}",
                            option="n_ctx", value=m.n_ctx, limit=16)
    opened = m.open_text()  # a file that is not text is refused here, from its first block
    if whole and not against:
        raise InvalidOption("a whole-configuration measurement needs the more precise file to measure against",
                            option="whole", value=True)
    mode = ("whole" if whole else "weights") if against else "kv"
    ref_model = str(resolve_model(against)) if against else model
    if against:
        _same_model(model, ref_model)
    from ..runtime.runner import check_vocabulary

    for path in {model, ref_model}:  # the text is tokenized with each: refused here, not by a worker's abort
        check_vocabulary(path)
    data = m.text_bytes(opened, None if opened is None else _text_limit(model, ref_model, m.n_ctx))
    sha = hashlib.sha256(data).hexdigest()
    if mode == "kv":
        pairs = pairs or [("f16", "f16"), ("q8_0", "q8_0")]
    elif mode == "whole":
        pairs = pairs or [("q8_0", "q8_0")]
    else:
        pairs = pairs or [("f16", "f16")]
    out = []
    with tempfile.TemporaryDirectory(prefix="ctxq-text-") as tmp:
        text_file = Path(tmp) / "text"
        text_file.write_bytes(data)
        ref_pairs = set(pairs) if mode == "weights" else {("f16", "f16")}
        refs = {rp: None for rp in sorted(ref_pairs)}
        for tk, tv in pairs:
            key = _key(mode, _file_id(model), _file_id(ref_model), sha, m.n_ctx, tk, tv, m.top_k)
            dest = _cache() / "results" / f"{key}.json"
            if m.use_cache and m.keep_results and dest.exists():
                r = Result(**json.loads(dest.read_text()))
                r.cached = True
                out.append(r)
                continue
            t0 = time.perf_counter()
            rp = (tk, tv) if mode == "weights" else ("f16", "f16")
            if refs[rp] is None:
                refs[rp] = _reference(ref_model, m, *rp, text_file, sha)
            if mode == "kv" and (tk, tv) == ("f16", "f16"):
                scores = _self_scores(refs[rp])  # the reference itself: nothing lost
            else:
                scored = dest.with_suffix(".npz")
                try:
                    _run(model, m, tk, tv, f"{Path(model).name} {tk}/{tv}",
                         {"text": None if mode == "kv" else str(text_file), "tokens": str(_tokens(refs[rp], tmp)),
                          "reference": str(refs[rp])}, scored)
                    with np.load(scored) as z:
                        scores = stats.Scores(z["kl"], z["same_top"], z["nll"])
                finally:
                    scored.unlink(missing_ok=True)
            size = kv_bytes_per_token(model, tk, tv) if mode == "kv" else os.path.getsize(model)
            r = Result(model=model, type_k=tk, type_v=tv, **scores.summary(), bytes=size, n_ctx=m.n_ctx,
                       text=m.text_name, text_sha256=sha,
                       reference=_reference_name(mode, ref_model), mode=mode,
                       llama_cpp=md.version("llama_cpp_python"), seconds=round(time.perf_counter() - t0, 2),
                       model_id=_file_id(model))
            if m.keep_results:
                _save(dest, r)
            out.append(r)
    return out


def _reference_name(mode: str, ref_model: str) -> str:
    return {"kv": "f16/f16 cache", "weights": Path(ref_model).name}.get(mode, f"{Path(ref_model).name}, f16/f16 cache")


def _text_limit(model: str, ref_model: str, n_ctx: int) -> int | None:
    """Bytes of the text that hold its first n_ctx tokens under both vocabularies (`ctxq.textfile.byte_limit`), and
    a block more for the word the limit cuts, which may tokenize otherwise than in the whole text. None: all of it."""
    from ..textfile import BLOCK, byte_limit

    limits = [byte_limit(path, n_ctx + 1) for path in {model, ref_model}]
    return None if None in limits else max(limits) + BLOCK


def _same_model(model: str, ref: str) -> None:
    """QualityError unless both files hold the same network (architecture, layers, width, vocabulary)."""
    from ..gguf.info import model_info

    def shape(path):
        i = model_info(path)
        return f"{i.arch}, {i.n_layer} layers, {i.n_embd} wide, {i.n_vocab:,} tokens"

    a, b = shape(model), shape(ref)
    if a != b:
        raise QualityError(f"{Path(ref).name} is not the same model as {Path(model).name} ({b}, against {a}): "
                           "--against takes the same model at a higher precision")


def _tokens(ref: Path, tmp: str) -> Path:
    path = Path(tmp) / f"tokens-{ref.stem}.npy"
    if not path.exists():
        with np.load(ref) as z:
            np.save(path, z["tokens"])
    return path


def _self_scores(ref: Path) -> stats.Scores:
    with np.load(ref) as z:
        nll, top = z["nll"], z["ids"][:, 0]
    return stats.Scores(np.zeros(len(nll)), np.ones(len(top), dtype=bool), nll)


def _save(dest: Path, r: Result) -> None:
    part = tempfiles.create(dest, "json")
    try:
        part.write_text(json.dumps(asdict(r) | {"cached": False}, indent=1))
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
