"""Issue 2: install, doctor, inspect, errors, and a real generation with a quantized model."""

from __future__ import annotations

import json
import os
import random
import struct

import pytest

from ctxq.llama import backend
from ctxq.errors import GGUFError
from ctxq.gguf.reader import read_gguf
from ctxq.gguf.info import model_info

from .conftest import run_ctxq


def test_build_has_rpc_and_no_amx_kernels():
    f = backend.build_features()
    assert f["rpc"], "setup builds llama-cpp-python with -DGGML_RPC=ON"
    # The AMX kernels crash quantized models on AMX_INT8 CPUs; setup compiles them out.
    assert not f["amx_int8"], backend.system_info()


def test_quantized_model_generates_paris(smollm2):
    """A quantized model (Q4_1, extra buffer types on, as by default) evaluates without crashing."""
    from llama_cpp import Llama

    with backend.capture_log() as lines:
        llm = Llama(str(smollm2), n_ctx=512, n_threads=2, seed=0, verbose=False)
    out = llm("The capital of France is", max_tokens=8, temperature=0.0)
    assert "Paris" in out["choices"][0]["text"]
    alloc = backend.parse_allocations(lines)
    assert alloc.kv["CPU"] > 0 and alloc.compute["CPU"] > 0
    assert set(alloc.layers) == set(range(31))  # 30 layers + the output layer
    # each size is printed once per buffer (to 0.01 MiB): the accuracy tables' resolution counts them
    assert alloc.printed["CPU"] == sum(1 for l in lines if " CPU " in l and "buffer size" in l) >= 3


def test_inspect_smollm2(smollm2):
    info = model_info(smollm2)
    assert (info.arch, info.n_layer, info.n_embd, info.n_vocab) == ("llama", 30, 576, 49152)
    assert set(info.n_head) == {9} and set(info.n_head_kv) == {3}
    assert info.head_dim_k == info.head_dim_v == 64
    assert info.output_tied and info.n_swa == 0
    # f16 K+V: 30 layers x 2 x (64 x 3) x 2 bytes
    assert info.kv_bytes_per_token["f16"] == 30 * 2 * 192 * 2
    assert info.kv_bytes_per_token["q8_0"] == 30 * 2 * 192 // 32 * 34
    assert info.kv_bytes_per_token["q4_0"] == 30 * 2 * 192 // 32 * 18
    g = read_gguf(smollm2)
    assert sum(info.layer_bytes) + info.token_embd_bytes + info.output_bytes + info.other_bytes \
        == sum(t.nbytes for t in g.tensors)
    assert info.n_params == pytest.approx(134.5e6, rel=0.01)


def test_inspect_json_cli(smollm2):
    r = run_ctxq("inspect", str(smollm2), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("arch", "n_params", "file_type", "tensor_types", "n_layer", "n_ctx_train", "n_head",
                "n_head_kv", "head_dim_k", "head_dim_v", "n_swa", "n_vocab", "layer_bytes",
                "token_embd_bytes", "output_bytes", "kv_bytes_per_token"):
        assert key in d
    assert d["file_type"] == "Q4_1" and d["n_ctx_train"] == 8192
    r = run_ctxq("inspect", str(smollm2))
    assert r.returncode == 0 and "KV cache" in r.stdout


def test_doctor_json_cli():
    r = run_ctxq("doctor", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["features"]["rpc"] is True
    assert any(dev["type"] == "cpu" for dev in d["ggml_devices"])
    assert d["ram_total"] > 0 and d["cpu"]["usable_cores"] >= 1
    assert isinstance(d["nvidia_gpus"], list)
    assert "llama_cpp_python_version" in d and "system_info" in d


def _bad(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("cut", [0, 3, 7, 16, 24, 100, 5000, 2_000_000, -1])
def test_truncated_gguf_is_one_line(smollm2, tmp_path, cut):
    data = smollm2.read_bytes()[: cut if cut >= 0 else -1]
    p = _bad(tmp_path / "cut.gguf", data)
    with pytest.raises(GGUFError):
        read_gguf(p)
    r = run_ctxq("inspect", str(p))
    assert r.returncode == 1
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_skipping_the_vocabulary_reads_the_same_header(smollm2, tmp_path):
    """`skip_arrays` steps over the tokenizer's strings unread: same tensors and keys, lengths for
    the arrays, and a cut anywhere inside the vocabulary is still a GGUFError."""
    full, skip = read_gguf(smollm2), read_gguf(smollm2, skip_arrays=True)
    assert skip.tensors == full.tensors and skip.data_offset == full.data_offset
    assert skip.value_types == full.value_types
    for key, value in full.metadata.items():
        if isinstance(value, list) and key.startswith("tokenizer."):
            assert skip.metadata[key] == len(value) > 0, key
        else:
            assert skip.metadata[key] == value, key
    assert skip.metadata["tokenizer.ggml.tokens"] == 49152
    data = smollm2.read_bytes()[: full.data_offset]
    rng = random.Random(7)
    for cut in sorted(rng.sample(range(1000, full.data_offset - 1), 60)):
        p = _bad(tmp_path / "cut.gguf", data[:cut])
        with pytest.raises(GGUFError):
            read_gguf(p, skip_arrays=True)


def test_wrong_magic_random_bytes_and_debug(tmp_path):
    p = _bad(tmp_path / "magic.gguf", b"GGML" + bytes(100))
    r = run_ctxq("inspect", str(p))
    assert r.returncode == 1 and "wrong magic" in r.stderr
    rnd = random.Random(1).randbytes(4096)
    p2 = _bad(tmp_path / "random.gguf", rnd)
    r = run_ctxq("inspect", str(p2))
    assert r.returncode == 1 and r.stderr.startswith("Error: ")
    # GGUF magic then garbage counts: refused before any big allocation
    p3 = _bad(tmp_path / "counts.gguf", b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62) + bytes(64))
    r = run_ctxq("inspect", str(p3))
    assert r.returncode == 1 and "corrupted" in r.stderr
    r = run_ctxq("inspect", str(p), env={"CTXQ_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr
    r = run_ctxq("inspect", str(tmp_path / "missing.gguf"))
    assert r.returncode != 0 and r.stderr.count("\n") == 1


def test_nested_log_captures_each_keep_their_lines(smollm2):
    # tokenize() captures llama.cpp's log itself; an outer capture (a caller's) must keep collecting after
    # the inner block ends, although both lists hold the same lines then (removal is by identity)
    from ctxq.runtime.generate import tokenize

    tokenize(smollm2, "hi")  # the first load may print more than the later ones
    with backend.capture_log() as outer:
        tokenize(smollm2, "hi")
        once = len(outer)
        tokenize(smollm2, "hi")
    assert once > 0 and len(outer) == 2 * once
    assert backend._sinks == []
