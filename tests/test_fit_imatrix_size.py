"""fit's size before writing is the written file's to the byte, also for a mix with IQ types (issue 45): such a mix is
written with the importance matrix, whose `quantize.imatrix.*` keys llama.cpp adds to the header.

A tiny qwen3moe 256 wide (`ctxq.testing.moe`: its rows take the IQ types themselves), its matrix over one chunk."""

from __future__ import annotations

import logging

import gguf
import pytest

from ctxq.conversion import fit as F
from ctxq.conversion import sensitivity as S
from ctxq.conversion.dryrun import dry_run, written_header_bytes
from ctxq.conversion.imatrix import auto_chunks, make_imatrix
from ctxq.conversion.quantize import quantize_gguf
from ctxq.gguf.writer import sparse_size

from .test_iq_fit import home, wide  # noqa: F401 (the same module-scoped home and wide MoE model)


def _types(path) -> set[str]:
    return {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.slow  # 15-30 s on 2 shared cores: two fits and the matrix
def test_a_mix_with_iq_types_is_the_size_its_dry_run_said(wide, tmp_path, caplog):
    """Near the smallest mix of a prior table that holds the model's matrix, the mix takes IQ2_XS in the layers and
    the matrix with it: the file is the dry run's size exactly (it was 256 bytes over, the matrix's
    keys); the mix of the table without it, all Q8_0, is written without a matrix and is its size too."""
    matrix = make_imatrix(wide, chunks=auto_chunks()).path
    table = S.prior(S.layout(wide, types=("IQ2_XS", "Q8_0")), wide)
    table.details["imatrix"] = str(matrix)  # as `S.measure` leaves it
    smallest = table.fixed_bytes + sum(min(table.bytes[g.name]) for g in table.groups)
    largest = table.fixed_bytes + sum(max(table.bytes[g.name]) for g in table.groups)
    caplog.set_level(logging.WARNING, logger="ctxq.conversion.fit")
    r = F.fit(wide, smallest + (16 << 10), tmp_path / "iq.gguf", table=table, check=False, held_out=False)
    assert "IQ2_XS" in _types(r.path) and F.mix_imatrix(r.mix) == matrix
    fields = gguf.GGUFReader(str(r.path)).fields
    assert fields["quantize.imatrix.file"].contents() == str(matrix)
    assert r.size == r.mix.size == r.path.stat().st_size <= r.target
    bare = S.without(table, ("IQ2_XS",))  # a table made without a matrix: Q8_0 alone here
    plain = F.fit(wide, largest, tmp_path / "q8.gguf", table=bare, check=False, held_out=False)
    assert _types(plain.path) == {"Q8_0", "F32"} and F.mix_imatrix(plain.mix) is None
    assert "quantize.imatrix.file" not in gguf.GGUFReader(str(plain.path)).fields
    assert plain.size == plain.mix.size == plain.path.stat().st_size
    assert "its dry run said" not in caplog.text


def test_a_matrix_path_over_127_bytes_is_cut_in_the_file_and_in_the_prediction(wide, tmp_path):
    """The worker passes the matrix's path in a llama_model_kv_override, whose string holds 127 bytes: a longer path
    is written cut, and the header predicted cuts it too."""
    matrix = make_imatrix(wide, chunks=auto_chunks()).path
    long = tmp_path / ("d" * 120) / "matrix.imatrix.gguf"
    long.parent.mkdir()
    long.write_bytes(matrix.read_bytes())
    mix = {"blk.0.ffn_down_exps.weight": "IQ2_XS"}
    r = quantize_gguf(wide, tmp_path / "long.gguf", "Q8_0", pure=True, tensor_types=mix, imatrix=long, check=False)
    assert len(gguf.GGUFReader(str(r.path)).fields["quantize.imatrix.file"].contents().encode()) == 127
    predicted = sparse_size(written_header_bytes(wide, long), dry_run(wide, "Q8_0", tensor_types=mix, pure=True))
    assert predicted == r.size
    assert written_header_bytes(wide, long) > written_header_bytes(wide, matrix) > written_header_bytes(wide)


def test_the_smallest_mix_with_the_matrix_keys_is_within_the_smallest_size(wide):
    """`smallest_size` counts the matrix's keys: the smallest mix (IQ2_XS in every layer) is chosen at that target
    (the plan's fallback and the bisection's floor ask for it), where the table's bytes alone are short of it."""
    matrix = make_imatrix(wide, chunks=auto_chunks()).path
    table = S.prior(S.layout(wide, types=("IQ2_XS", "Q8_0")), wide)
    table.details["imatrix"] = str(matrix)
    bare = table.fixed_bytes + sum(min(table.bytes[g.name]) for g in table.groups)
    mix = F.choose(table, F.smallest_size(table, wide), wide)
    assert F.mix_imatrix(mix) == matrix and mix.size > bare
    assert all(t == "IQ2_XS" for g, t in mix.group_types().items() if g.startswith("blk."))
