"""A model is opened once per command (issue 46): inside a command (or a call of the Python API) a GGUF's header
is parsed once and every later reading of the same, unchanged file gets a copy of that parse
(`ctxq.gguf.once`). Counted here by the parses themselves (`parse_gguf`), in this process."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil

import pytest

import ctxq.gguf.once as once
import ctxq.gguf.reader as reader
from ctxq.cli import main


@pytest.fixture
def parses(monkeypatch):
    """Every header parse of a local file in this process: (path, skip_arrays) -> count."""
    counts: collections.Counter = collections.Counter()
    real = reader.parse_gguf

    def counting(f, size, path, **kw):
        counts[(os.path.realpath(path), kw.get("skip_arrays", False))] += 1
        return real(f, size, path, **kw)

    monkeypatch.setattr(reader, "parse_gguf", counting)
    # what earlier tests left in this process's per-file caches would read nothing: start without them
    from ctxq.planning.memory import cuda
    from ctxq.planning.memory import split

    cuda._matmul_weights.cache_clear()
    split.shared_expert_layers.cache_clear()
    return counts


def _once(parses, model) -> None:
    assert parses, "nothing was parsed: the count does not see the reader"
    assert any(path == os.path.realpath(model) for path, _ in parses)
    twice = {k: n for k, n in parses.items() if n > 1}
    assert twice == {}, f"parsed more than once: {twice}"


@pytest.mark.parametrize("argv", [
    ["plan", "{model}", "--ctx", "4096", "--gpus", "8"],
    ["plan", "{model}", "--ctx", "4096", "--simulate", "0.2,0.2", "-sm", "tensor"],
    ["run", "{model}", "--ctx", "512", "-n", "2", "-p", "Hi"],
    ["quality", "{model}", "--ctx", "128", "--kv", "q8_0", "--no-cache"],  # measured: a cached result reads nothing
], ids=["plan", "plan-tensor", "run", "quality"])
def test_a_command_parses_the_model_header_once(parses, smollm2, argv, capsys):
    main([a.format(model=smollm2) for a in argv])
    assert capsys.readouterr().out  # the command ran and printed its answer
    _once(parses, smollm2)


@pytest.mark.slow
def test_convert_fit_parses_each_header_once(parses, tmp_path, capsys):
    """The fit reads the source's full header (its header-only plan copies carry the vocabulary) and serves the
    quantizer's dry runs and the planner from it; each mix it plans is read once too."""
    from ctxq.testing import upstream_models

    src = upstream_models.build("smollm3")
    main(["convert", str(src), "fit", "--ctx", "4096", "--gpus", "1", "-o", str(tmp_path / "fit.gguf")])
    assert (tmp_path / "fit.gguf").is_file() and "fit" in capsys.readouterr().out
    # the joint search writes each candidate mix's header to one probe file in turn, and the weights' scale each of
    # its anchor mixes to one anchor file (both when not cached, so the count depends on what earlier tests left):
    # a new file each time, read once
    probes = {k for k in parses if os.path.basename(k[0]) in ("probe.gguf", "anchor.gguf")}
    _once({k: n for k, n in parses.items() if k not in probes}, src)
    assert parses[(os.path.realpath(src), False)] == 1  # the full parse, the only one of the source


def test_without_the_scope_the_same_plan_parses_twice(parses, smollm2, monkeypatch, capsys):
    """What the scope saves, seen by the same count: `ctxq plan` with the scope made a no-op reads the header more
    than once."""
    monkeypatch.setattr(once, "opened", contextlib.nullcontext)
    main(["plan", str(smollm2), "--ctx", "4096", "--gpus", "8"])
    assert capsys.readouterr().out
    assert parses[(os.path.realpath(smollm2), True)] >= 2


def test_the_scope_hands_out_copies_and_sees_a_changed_file(parses, smollm2, tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copyfile(smollm2, model)
    with once.opened():
        a = reader.read_gguf(model, skip_arrays=True)
        a.tensors.clear()
        a.metadata.clear()
        b = reader.read_gguf(model, skip_arrays=True)  # a copy of the first parse, not the caller's emptied one
        assert len(b.tensors) == 272 and b.arch == "llama"
        assert parses[(str(model), True)] == 1
        # the full parse serves a later header-only reading: the tokenizer's arrays as their lengths
        full = reader.read_gguf(model)
        assert isinstance(full.get("tokenizer.ggml.tokens"), list)
        os.replace(shutil.copyfile(smollm2, tmp_path / "new.gguf"), model)  # replaced: another inode
        c = reader.read_gguf(model, skip_arrays=True)
        assert parses[(str(model), True)] == 2 and parses[(str(model), False)] == 1
        assert c.metadata == b.metadata
    d = reader.read_gguf(model, skip_arrays=True)  # the scope is over: read again
    assert parses[(str(model), True)] == 3 and d.metadata == b.metadata
    with once.opened():
        full = reader.read_gguf(model)
        derived = reader.read_gguf(model, skip_arrays=True)
        assert parses[(str(model), True)] == 3  # derived from the full parse, not read
        assert derived.metadata == d.metadata and derived.tensors == d.tensors
        assert derived.get("tokenizer.ggml.tokens") == len(full.get("tokenizer.ggml.tokens"))
