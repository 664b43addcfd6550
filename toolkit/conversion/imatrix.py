"""An importance matrix made by ctxq, in llama.cpp's imatrix GGUF format, cached per model file and text.

`make_imatrix(model)` runs `ctxq.conversion.imatrix_worker` in a child (llama.cpp aborts instead of returning errors)
over the built-in text of `ctxq quality` or a text file, in chunks of 512 tokens as `llama-imatrix` does, and keeps
the result under `<ctxq home>/imatrix/`, keyed by the model file's SHA-256, the text's, the chunk settings and the
llama-cpp-python version. The file is written beside its destination under a temporary name and renamed when the
child has finished: a failed or killed run leaves nothing. llama.cpp's quantizer and `llama-quantize --imatrix` read
it (`<name>.in_sum2`, `<name>.counts`, `imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import children, interrupts, tempfiles
from ..digest import file_digest
from ..errors import ConversionError, GGUFError
from ..paths import ctxq_home

log = logging.getLogger(__name__)

CHUNK = 512  # llama-imatrix's default context (tools/imatrix/imatrix.cpp main: params.n_ctx = 512)
BUILTIN = "licences"  # the dataset name written for ctxq quality's built-in text
AUTO_CHUNKS = 32  # chunks of 512 tokens of the built-in text in the matrix ctxq makes when a quantization needs one


@dataclass
class ImatrixResult:
    """A made (or cached) importance matrix."""

    path: Path
    cached: bool
    chunks: int  # chunks of `chunk` tokens evaluated
    chunk: int  # tokens per chunk
    tensors: int  # weight tensors with an entry
    seconds: float  # the child's evaluation time (0 from the cache)
    peak_rss_bytes: int  # the child's peak resident memory, bytes (0 from the cache)
    dataset: str


def _text_bytes(text: str | os.PathLike | None) -> tuple[bytes, str]:
    """(the text, its dataset name); one line for a missing, binary or non-UTF-8 file."""
    if text is None:
        from ..quality import builtin_text

        return builtin_text(), BUILTIN
    from ..textfile import check_text

    try:
        data = Path(text).read_bytes()
    except OSError as e:
        raise ConversionError(f"cannot read {text}: {e.strerror}") from None
    check_text(data, str(text), complete=True)  # NotText: a GGUF, an image, NUL bytes, not UTF-8
    if not data.strip():
        raise ConversionError(f"{text} is empty: give a text of at least {CHUNK} tokens")
    return data, os.path.basename(str(text))


def _check_model(model: Path) -> None:
    from ..gguf.reader import read_gguf

    if not model.is_file():
        raise ConversionError(f"{model}: no such file; give a GGUF model")
    try:
        g = read_gguf(model, skip_arrays=True)
    except GGUFError as e:
        raise ConversionError(f"{e}; give a GGUF model (ctxq convert makes one)") from None
    if str(g.metadata.get("general.type", "model")) == "imatrix" or not g.tensors:
        raise ConversionError(f"{model} holds no model weights (an imatrix or a vocabulary file?); give a GGUF model")


def auto_chunks() -> int:
    """The chunks of the matrix ctxq makes itself: AUTO_CHUNKS, or CTXQ_IMATRIX_CHUNKS (read when used; tests: 1)."""
    return int(os.environ.get("CTXQ_IMATRIX_CHUNKS") or AUTO_CHUNKS)


def check_matches(path: Path, model: Path) -> None:
    """One line (ConversionError) unless `path` is a GGUF importance matrix whose every entry names a weight of the
    GGUF `model` with the same input width and matrix count: another model's matrix is refused before any work (llama.cpp
    would skip the names it lacks and quantize those tensors without one, or abort on a size it does not expect)."""
    from ..gguf.reader import read_gguf

    g = read_gguf(path, skip_arrays=True)  # GGUFError (one line) for a missing or broken file
    entries = {t.name[: -len(".in_sum2")]: tuple(t.shape) for t in g.tensors if t.name.endswith(".in_sum2")}
    if not entries or "imatrix.chunk_count" not in g.metadata:
        raise ConversionError(f"{path} is not a GGUF importance matrix (no *.in_sum2 tensors or imatrix.* keys); "
                              "make one with `ctxq imatrix MODEL`")
    weights = {t.name: tuple(t.shape) for t in read_gguf(model, skip_arrays=True).tensors}
    missing = sorted(n for n in entries if n not in weights)
    # llama_model_quantize takes an entry of ne0 x ne2 values (llama-quant.cpp): columns, and one row per expert
    wrong = [(n, e, weights[n]) for n, e in sorted(entries.items()) if n in weights and
             (e[0] != weights[n][0] or (e + (1,))[1] != (weights[n] + (1, 1))[2])]
    if missing or wrong:
        what = (_size_line(*wrong[0]) if wrong
                else f"{len(missing)} of its {len(entries)} entries name no tensor of it ({missing[0]}, ...)")
        raise ConversionError(f"{path} is not an importance matrix of {model.name}: {what}; make this model's with "
                              f"`ctxq imatrix {model}` or leave --imatrix out (ctxq makes it)")


def _size_line(name: str, entry: tuple, weight: tuple) -> str:
    """llama.cpp's words for the mismatch (llama-quant.cpp), with the shapes."""
    e, w = entry + (1,), weight + (1, 1)
    return (f"imatrix size {e[0] * e[1]} is different from tensor size {w[0] * w[2]} for {name} ({e[0]} columns x "
            f"{e[1]} matrices in the matrix, {w[0]} x {w[2]} in the model)")


def cache_key(model: Path, data: bytes, chunk: int, chunks: int | None) -> str:
    stamp = ["imatrix-1", file_digest(model), hashlib.sha256(data).hexdigest(), chunk, chunks,
             md.version("llama_cpp_python")]
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:32]


def cache_dir() -> Path:
    return ctxq_home() / "imatrix"


def make_imatrix(model: str | os.PathLike, text: str | os.PathLike | None = None, *, chunks: int | None = None,
                 chunk: int = CHUNK, out: str | os.PathLike | None = None, force: bool = False, threads: int = 0,
                 progress: Callable[[int, int, str], None] | None = None) -> ImatrixResult:
    """The importance matrix of the GGUF `model` over `text` (None: ctxq quality's built-in text), `chunks` chunks of
    `chunk` tokens (None: all the text holds). Made once per model file, text and settings; `out` gets a copy
    (atomically). ConversionError (one line) for bad input or a failed evaluation; nothing is written then."""
    model = Path(model)
    if chunk < 16 or (chunks is not None and chunks < 1):
        raise ConversionError("--chunks must be at least 1 and the chunk at least 16 tokens (llama.cpp collects no "
                              "matrix multiplication of fewer rows)")
    _check_model(model)
    data, dataset = _text_bytes(text)
    key = cache_key(model, data, chunk, chunks)
    folder = cache_dir()
    path, meta_path = folder / f"{key}.imatrix.gguf", folder / f"{key}.json"
    if not force and path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        res = ImatrixResult(path, True, meta["chunks"], chunk, meta["tensors"], 0.0, 0, dataset)
    else:
        meta = _collect(model, data, dataset, chunk, chunks, threads, path, progress)
        part = tempfiles.create(meta_path, "json")
        part.write_text(json.dumps(meta))
        os.replace(part, meta_path)  # (a matrix without its record is made again, never read half-written)
        res = ImatrixResult(path, False, meta["chunks"], chunk, meta["tensors"], meta["seconds"],
                            meta["peak_rss_bytes"], dataset)
    if out is not None:
        out = Path(out)
        part = tempfiles.create(out, "imatrix")
        try:
            shutil.copyfile(path, part)
            os.replace(part, out)
        finally:
            part.unlink(missing_ok=True)
        res.path = out
    return res


def _collect(model: Path, data: bytes, dataset: str, chunk: int, chunks: int | None, threads: int, path: Path,
             progress) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    tempfiles.sweep(path.parent)
    part = tempfiles.create(path, "imatrix")
    with tempfile.TemporaryDirectory(prefix="ctxq-imatrix-") as tmp:
        text_file = Path(tmp) / "text.txt"
        text_file.write_bytes(data)
        job = {"model": str(model.resolve()), "text": str(text_file), "chunk": chunk, "chunks": chunks,
               "dataset": dataset, "out": str(part), "threads": threads or None}
        log_path = Path(tmp) / "llama.log"
        try:
            with open(log_path, "wb") as err:
                proc = subprocess.Popen([sys.executable, "-m", "ctxq.conversion.imatrix_worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                        **children.lifeline())
                try:
                    proc.stdin.write(json.dumps(job).encode())
                    proc.stdin.close()
                    for line in interrupts.lines(proc.stdout.fileno()):  # a stop signal ends the wait (issue 56)
                        f = line.split()
                        if len(f) == 3 and f[0] == b"progress" and progress:
                            progress(int(f[1]), int(f[2]), "imatrix:")
                    rc = proc.wait()
                finally:
                    if proc.poll() is None:  # interrupted: the child must not go on for nobody
                        proc.kill()
                        proc.wait()
            try:
                result = json.loads(Path(str(part) + ".json").read_text())
            except (OSError, ValueError):
                result = {}
            if rc != 0 or "error" in result or not part.is_file():
                raise ConversionError(result.get("error") or _died(rc, log_path))
            os.replace(part, path)
            return {k: result[k] for k in ("chunks", "tensors", "seconds", "peak_rss_bytes", "n_tokens")}
        finally:
            part.unlink(missing_ok=True)
            Path(str(part) + ".json").unlink(missing_ok=True)


def _died(rc: int, log_path: Path) -> str:
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "error" in ln.lower() or "abort" in ln.lower()),
                lines[-1] if lines else "")
    return f"collecting the importance matrix failed (exit status {rc})" + (f": {last.strip()[:200]}" if last else "")
