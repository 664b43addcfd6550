"""llama.cpp's -ot / --override-tensor (issue 64 item 3): the user's REGEX=BUFFER entries planned per device, handed to
llama.cpp ahead of ctxq's own patterns, and refused in one line when they cannot be.

Real parts: SmolLM2 loaded by the real llama.cpp over two local RPC workers with the user's overrides, each device's
allocations against the plan (`check_cell`); `ctxq run -ot` against plain llama.cpp (its C API through llama-cpp-python,
the override array built here) over the same workers: the same greedy tokens.
"""

from __future__ import annotations

import ctypes
import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctxq import rpc
from ctxq.cli import main
from ctxq.planning.planner import plan
from ctxq.testing.accuracy import check_cell

from .conftest import run_ctxq

PROMPT = "The river city library stood by the quiet green market in the morning"
FFN_1 = r"blk\.1\.ffn_.*"


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXQ_HOME", str(tmp_path / "home"))


def _tensor_bytes(model, pattern: str) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(model)).tensors if re.search(pattern, t.name))


def test_user_overrides_are_planned_as_llama_cpp_allocates(smollm2):
    """Attention of layers 2-3 (on the first worker) sent to the second, the up projections of layers 20-29 (on the
    second) to the host: each device's weights, KV and compute as llama.cpp allocates them. About 7 s."""
    ot = [r"blk\.(2|3)\.attn_.*=RPC1", r"blk\.2[0-9]\.ffn_up.*=CPU"]
    with rpc.start_workers(2) as w:
        r = check_cell(str(smollm2), 4096, "f16", [0.3, 0.3], workers=w, label="ot", override_tensor=ot)
    assert r.layers_match, r.layer_mismatch
    for d in r.devices:
        assert d.ok_tiny, (d.name, d.planned, d.real)
        assert d.error >= -16 * 1024, (d.name, d.error)  # never under beyond the printed sizes' rounding
    p = plan(smollm2, 4096, kv="f16", simulate="0.3,0.3", split="1:1", override_tensor=ot)
    assert p.gpus[1].override_bytes == _tensor_bytes(smollm2, r"blk\.(2|3)\.attn_") > 0
    assert p.host.override_bytes == _tensor_bytes(smollm2, r"blk\.2[0-9]\.ffn_up") > 0
    assert p.tensor_overrides()[:2] == ot  # the user's first: llama.cpp takes a tensor's first match


def test_the_plan_shows_the_overrides(smollm2):
    """--json carries them in tensor_overrides; the llama.cpp command line as -ot with llama.cpp's buffer names (a
    described GPU1 is CUDA1 there)."""
    r = run_ctxq("plan", str(smollm2), "-c", "2048", "--gpus", "2,2", "-ot", f"{FFN_1}=CPU",
                 "-ot", r"blk\.2\.attn_q.*=GPU1", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["tensor_overrides"] == [f"{FFN_1}=CPU", r"blk\.2\.attn_q.*=GPU1"]  # ctxq moves nothing of its own here
    words = shlex.split(j["llama_flags"])
    ot = [words[i + 1] for i, w in enumerate(words) if w == "-ot"]
    assert ot == [f"{FFN_1}=CPU", r"blk\.2\.attn_q.*=CUDA1"], words
    assert j["gpus"][1]["override_bytes"] == _tensor_bytes(smollm2, r"blk\.2\.attn_q") > 0
    assert j["host"]["override_bytes"] == _tensor_bytes(smollm2, FFN_1)


def _plain_greedy(model: str, prompt: str, n: int, pattern: str, n_gpu_layers: int, tensor_split: list[float]):
    """Plain llama.cpp through llama-cpp-python's C API: the override array built here, the CPU's buffer type from
    ggml's device API, greedy tokens by argmax of the last logits."""
    import llama_cpp as lc
    import numpy as np

    class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override (include/llama.h)
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    ggml = ctypes.CDLL(str(Path(lc.__file__).parent / "lib" / "libggml.so.0"))
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    arr = (Override * 2)()
    arr[0].pattern = pattern.encode()
    arr[0].buft = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_by_type(0))  # GGML_BACKEND_DEVICE_TYPE_CPU
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = n_gpu_layers
    split = (ctypes.c_float * len(tensor_split))(*tensor_split)
    mp.tensor_split = split
    mp.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
    model_p = lc.llama_model_load_from_file(model.encode(), mp)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 4096, 1, 1
    ctx = lc.llama_init_from_model(model_p, cp)
    vocab = lc.llama_model_get_vocab(model_p)
    buf = (lc.llama_token * 256)()
    k = lc.llama_tokenize(vocab, prompt.encode(), len(prompt.encode()), buf, 256, True, False)
    toks, out = list(buf[:k]), []
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    for i in range(n):
        feed = toks if not i else [out[-1]]
        arr_t = (lc.llama_token * len(feed))(*feed)
        assert lc.llama_decode(ctx, lc.llama_batch_get_one(arr_t, len(feed))) == 0
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        out.append(int(np.argmax(logits)))
    lc.llama_free(ctx)
    lc.llama_model_free(model_p)
    return out


def test_run_with_an_override_gives_plain_llama_cpps_tokens(smollm2):
    """`ctxq run -ot` over two workers and plain llama.cpp with the same override and split: the same greedy tokens,
    and the plan kept the user's entry. About 10 s."""
    with rpc.start_workers("0.4,0.3", threads=1) as w:
        run = run_ctxq("run", str(smollm2), "-c", "4096", "-ctk", "f16", "-ctv", "f16", "--rpc", w.rpc_spec,
                       "-ot", f"{FFN_1}=CPU", "-p", PROMPT, "-n", "12", "--temp", "0", "-t", "1", "--json")
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        p = out["plan"]
        plain = rpc.run_supervised(_plain_greedy, str(smollm2), PROMPT, 12, FFN_1, p["n_gpu_layers"],
                                   [float(c) for c in p["tensor_split"]], rpc=w.endpoints, workers=w)
    assert p["tensor_overrides"][0] == f"{FFN_1}=CPU" and p["host"]["override_bytes"] > 0
    assert out["tokens"] == plain and len(plain) == 12


@pytest.mark.parametrize("value, says", [
    (r"blk\.1\.ffn_(=CPU", "is not a regex"),
    (r"blk\.1\.ffn_.*", "write PATTERN=BUFFER"),
    (r"blk\.1\.ffn_.*=CUDA7", "no buffer 'CUDA7' among this plan's devices; use one of CPU, "),
    (r"blk\.1\.ffn_.*=GPU1", "the plan puts no layers on GPU1"),  # cards too small for the reserve: all on the CPU
])
def test_bad_overrides_are_one_line(smollm2, value, says):
    devices = ["--gpus", "0.3,0.3"] if "GPU1" in value else ["--simulate", "0.3,0.3"]
    with CliRunner().isolation() as streams:  # through main(): the one-line error and the exit code are its
        with pytest.raises(SystemExit) as exit_:
            main(["plan", str(smollm2), "-c", "2048", *devices, "-ot", value])
        out = streams[0].getvalue().decode() + streams[1].getvalue().decode()
    assert exit_.value.code not in (0, None)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and says in lines[0], out


def test_entries_split_as_llama_cpp_splits_them():
    """common/arg.cpp: commas separate entries, the first '=' separates pattern and buffer; several -ot add up."""
    from ctxq.planning.user_tensors import parse_overrides

    assert parse_overrides([r"blk\.1\.ffn_.*=CPU,output=CUDA0", "a=b=c"]) == (r"blk\.1\.ffn_.*=CPU", "output=CUDA0",
                                                                             "a=b=c")
