"""ctxq's speed estimate held to published GPU runs (issue 61; docs/speed-truth.md).

Every row of ctxq.testing.speed_truth is a figure someone measured with llama-bench on real cards and posted (its
source in the row); the estimate runs on a header-only GGUF of the same model, whose size is checked against the
size llama-bench printed for the published file. A row is held absolutely (within 40 %), as a ratio to another
setting of the same rig (within 20 %), or says why it cannot be compared. None of these numbers came from ctxq.
"""

from __future__ import annotations

import pytest

from ctxq.gguf.reader import read_gguf
from ctxq.planning.speed import model as speed
from ctxq.testing import speed_truth as st

GiB = 1024**3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("speed_truth")


# llama-bench's size column for the published files (the PRs' tables; gpt-oss: PR 19922 and PR 16991)
PUBLISHED_SIZES = {"llama-7b:Q4_0": 3.56, "llama-7b:F16": 12.55, "codellama-7b:Q8_0": 6.67,
                   "llama3-8b:Q4_0": 4.33, "gpt-oss-120b": 59.02, "gpt-oss-20b": 11.27}


@pytest.mark.parametrize("key,gib", PUBLISHED_SIZES.items())
def test_the_geometries_are_the_published_files(folder, key, gib):
    g = read_gguf(st.model_file(key, folder), skip_arrays=True)
    assert round(sum(t.nbytes for t in g.tensors) / GiB, 2) == gib


def test_every_published_row_is_within_tolerance_or_says_why(folder):
    held = st.hold(folder)
    compared = [h for h in held if not h.row.why_not]
    rigs = {(h.row.card.name, h.row.n_cards) for h in compared}
    assert len(compared) >= 12 and len(rigs) >= 4, (len(compared), rigs)
    outside = [f"{h.row.id}: {h.error:+.0%}" for h in compared if not h.within]
    assert not outside, "\n" + st.table(held)
    for h in held:  # a row kept out says why, and is in the table with its figure
        assert h.row.why_not is None or len(h.row.why_not) > 40


def test_dropping_the_copy_term_breaks_the_table(folder, monkeypatch):
    """Host weights taken as free to copy (the estimate before issue 61): the micro-batch sweep with the experts in
    host memory no longer follows the published one."""
    monkeypatch.setattr(speed._Model, "host_copy_s", lambda self, nbytes, pinned, calls=1: 0.0)
    held = st.hold(folder, tuple(r for r in st.ROWS if r.host_experts))
    outside = [h.row.id for h in held if h.within is False]
    assert len(outside) >= 3, st.table(held)


def test_overlapping_the_copy_with_the_work_is_faster_than_llama_cpp(folder):
    """Mainline llama.cpp copies, then computes (ggml_backend_sched_compute_splits): the estimate adds the two, so at
    -ub 512 it is at least the copies' time slower than the work alone."""
    row = next(r for r in st.ROWS if r.id == "expscpu-gptoss20b-ub512")
    e = st.estimate_row(row, folder)
    free = st.estimate_row(row.__class__(**{**row.__dict__, "host_experts": False}), folder)
    info_bytes = sum(t.nbytes for t in read_gguf(st.model_file(row.model, folder), skip_arrays=True).tensors
                     if "_exps." in t.name)
    copies = 4 * info_bytes / (row.card.link_gbs * 1e9)  # four micro-batches of 512, at the link's full rate
    assert e.prefill_s - free.prefill_s >= copies


def test_the_doc_shows_the_current_table(folder):
    """docs/speed-truth.md's table is what the rows give now (scripts/speed_truth.py --write-doc rewrites it)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "speed-truth.md").read_text()
    assert st.table(st.hold(folder)) in doc
