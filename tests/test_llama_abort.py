"""A llama.cpp abort on a command's path (a GGML_ASSERT in its loader) is one line, not the end of ctxq: the dry runs
before the real load run in a process of their own (ctxq.llama.dry). The header that trips the assert is a real
Gemma 4 converted by llama.cpp's own converter (upstream_models' gemma4-kvshare) with one key changed:
`gemma4.attention.shared_kv_layers` 7 of 8 layers, so that llama-model.cpp's KV-reuse callback finds
n_layer_kv_from_start = 1 and asserts it is >= 2 (an abort, not an error)."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import pytest

from ctxq.errors import LlamaAborted
from ctxq.llama import dry
from ctxq.testing import upstream_models

from .conftest import run_ctxq

_KEY = b"gemma4.attention.shared_kv_layers"
_ASSERT = "GGML_ASSERT(hparams.n_layer_kv_from_start >= 2) failed"


@pytest.fixture(scope="module")
def kvshare() -> Path:
    return upstream_models.build("gemma4-kvshare")


@pytest.fixture(scope="module")
def bad_header(kvshare, tmp_path_factory) -> Path:
    """The converted file, byte for byte, with shared_kv_layers 4 -> 7 (a GGUF uint32: type 4, then the value)."""
    data = bytearray(kvshare.read_bytes())
    at = data.index(_KEY) + len(_KEY)
    assert struct.unpack_from("<II", data, at) == (4, 4)
    struct.pack_into("<I", data, at + 4, 7)
    out = tmp_path_factory.mktemp("abort") / "bad-gemma4.gguf"
    out.write_bytes(data)
    return out


def _leftovers() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("ctxq-dry-*")}


@pytest.mark.parametrize("args", [("plan", "--ctx", "4096"), ("plan", "--ctx", "4096", "--gpus", "1,1"),
                                  ("run", "--ctx", "4096", "-p", "hi", "-n", "1"),
                                  ("serve", "--ctx", "4096", "--port", "18571")],
                         ids=["plan", "plan-gpus", "run", "serve"])
def test_commands_say_one_line_on_an_abort(bad_header, tmp_path, args):
    """Each command exits 1 with one line naming the architecture and llama.cpp's assert: no traceback, no gdb
    backtrace, and nothing left behind (the child's log is unlinked from the start; no core file)."""
    before = _leftovers()
    r = run_ctxq(args[0], str(bad_header), *args[1:], env={"CTXQ_HOME": str(tmp_path / "home")}, timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("Error: llama.cpp aborted on this gemma4 model (bad-gemma4.gguf): llama-model.cpp:")
    assert _ASSERT in lines[0] and "Traceback" not in r.stderr
    assert _leftovers() <= before
    assert not list(Path.cwd().glob("core*")) and not list((tmp_path / "home").rglob("*.part"))


def test_the_abort_is_cached_and_the_next_question_gets_a_new_child(bad_header, kvshare, tmp_path, monkeypatch):
    """dry_measure raises LlamaAborted with llama.cpp's assert; the accounting keeps that answer on disk, so asking
    again starts no process; a good model is then answered by a new child."""
    from ctxq.llama.accounting import accounting

    monkeypatch.setenv("CTXQ_HOME", str(tmp_path))
    with pytest.raises(LlamaAborted) as e:
        accounting(bad_header, n_ctx=4096)
    assert _ASSERT in e.value.reason and "bad-gemma4.gguf" in str(e.value)
    assert dry._child is None  # the dead child is gone
    with pytest.raises(LlamaAborted):
        accounting(bad_header, n_ctx=4096, n_ubatch=512)  # the same question: from the disk
    assert dry._child is None
    acc = accounting(kvshare, n_ctx=4096)
    assert dry._child is not None and dry._child.proc.poll() is None
    assert acc.n_layer == 8 and acc.reused == {4: 2, 5: 2, 6: 2, 7: 3}


def test_a_derived_model_that_aborts_falls_back_with_a_note(kvshare, tmp_path, monkeypatch):
    """Derived models written as before this fix (the source's shared_kv_layers kept: 4 of 2 kept layers) abort in
    llama.cpp; the plan survives, takes the whole model's dry run for its compute and says so in a note."""
    from ctxq.planning import derived
    from ctxq.planning.devices import Device
    from ctxq.planning.planner import plan
    from ctxq.units import GiB

    monkeypatch.setenv("CTXQ_SPLIT_CHECK", "0")  # the rules' figures, where the derived models' peaks show
    devices = [Device(name=f"RPC{i}", kind="rpc", total=GiB, usable=GiB) for i in range(2)]
    good = plan(str(kvshare), 16384, devices=devices, split="1:1")
    assert not any("aborted" in n for n in good.notes)
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path))  # derived models of their own (their names do not say how)
    monkeypatch.delitem(derived.SHARED_KV_KEY, "gemma4")
    p = plan(str(kvshare), 16384, devices=devices, split="1:1")
    note = next(n for n in p.notes if n.startswith("llama.cpp aborted on a derived model of this gemma4"))
    assert _ASSERT in note and "upper bound" in note
    assert p.gpus[0].compute > good.gpus[0].compute  # the whole model's peak: its head's logits too
    assert not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob("*.tmp"))
