"""The weights' error of fit's table (`ctxq.conversion.sensitivity`), weighted by the importance matrix.

llama.cpp's quantizers choose each block's scales to minimise sum_j a_j (W_ij - Q_ij)^2, with a_j the mean squared
input of column j (the importance matrix's in_sum2 / counts: ggml-quants.c, `quant_weights`). Summed over the tensor
that is E||(W - Q) x||^2, the squared error of the tensor's output per token when the inputs' columns are
uncorrelated: the error measured here, one quantization of the whole model per candidate type (`errors`).
"""

from __future__ import annotations

from pathlib import Path

from ..gguf.reader import read_gguf


def quantize_pure(src: Path, out: Path, type: str, tensor_types: dict[str, str] | None = None,
                  imatrix: Path | None = None) -> None:
    """llama.cpp's quantizer, `pure` to `type` (with `tensor_types` overrides), with the importance matrix when
    given; no cache, no quality gate: a temporary file to measure."""
    from .dryrun import quantize_raw

    if imatrix is None:
        quantize_raw(src, out, type, tensor_types=tensor_types)
        return
    from .quantize import _is_quantized, parse_type
    from .quantize_process import Worker, tensor_overrides

    job = {"src": str(src), "out": str(out), "ftype": parse_type(type)[1], "nthread": 0, "pure": True,
           "allow_requantize": _is_quantized(read_gguf(src, skip_arrays=True)), "imatrix": str(imatrix),
           "tensor_types": tensor_overrides(tensor_types)}
    with Worker() as worker:  # (a full worker: it reads the matrix with gguf)
        worker.run(job)


def importance(imatrix: Path | None) -> tuple[dict, float]:
    """({weight: its columns' mean squared input, (n_mat, n_cols)}, the mean over every entry) as llama.cpp's
    quantizer reads the matrix (in_sum2 / counts; 1 where an expert was never routed to)."""
    if imatrix is None:
        return {}, 1.0
    import numpy as np

    from .quantize_worker import load_imatrix

    cols = {t.name[: -len(".in_sum2")]: t.shape[0] for t in read_gguf(imatrix, skip_arrays=True).tensors}
    data = {n: v.astype(np.float64).reshape(-1, cols[n]) for n, v in load_imatrix(str(imatrix))[0].items()}
    return data, float(np.mean([v.mean() for v in data.values()]))


def weighted_error(w, q, a) -> float:
    """sum_j a_j sum_i (W_ij - Q_ij)^2 of a weight `w` and its dequantized quantization `q` (numpy order:
    (..., n_cols)); `a` (n_mat, n_cols), one row per expert, or a number (1: the plain squared error)."""
    import numpy as np

    d2 = np.square(np.asarray(w, np.float64) - np.asarray(q, np.float64))
    if np.ndim(a) == 0:
        return float(a * d2.sum())
    return float((d2.reshape(a.shape[0], -1, a.shape[1]) * a[:, None, :]).sum())


def errors(table, src: Path, tmp: Path, progress, imatrix: Path | None, imatrix_types, spare: dict,
           ftype: dict) -> tuple[dict, dict]:
    """({group: weighted error at each of table.types}, {group: plain squared error at each}): each type's pure file,
    dequantized (gguf-py), against the source's weights. Types in `imatrix_types` are quantized with the matrix;
    spare[type] {tensor: type} overrides tensors there; ftype[type] is the file type whose tensors are `type`. A tensor without an entry (the token embeddings, the output
    head: the matrix holds blk.* weights) is weighted by the matrix's mean column."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    source = GGUFReader(str(src))
    weights = {t.name: t for t in source.tensors}
    out = {g.name: [0.0] * len(table.types) for g in table.groups}
    plain = {g.name: [0.0] * len(table.types) for g in table.groups}
    owner = {n: g.name for g in table.groups for n in g.tensors}
    imp, mean = importance(imatrix)
    for j, qt in enumerate(table.types):
        if progress:
            progress(j, len(table.types) + len(table.groups) + 1, f"measure:error at {qt}")
        path = tmp / f"pure-{qt}.gguf"
        quantize_pure(src, path, ftype.get(qt, qt), spare.get(qt) or None, imatrix if qt in imatrix_types else None)
        for t in GGUFReader(str(path)).tensors:
            if t.name not in owner:
                continue
            s = weights[t.name]
            w, q = dequantize(s.data, s.tensor_type), dequantize(t.data, t.tensor_type)
            out[owner[t.name]][j] += weighted_error(w, q, imp.get(t.name, mean))
            plain[owner[t.name]][j] += weighted_error(w, q, 1.0)
        path.unlink()
    return out, plain
