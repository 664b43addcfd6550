"""Issue 28 part 5: small random checkpoints of architectures outside ctxq's tables, built with transformers,
converted by llama.cpp's own converter (from the llama-cpp-python sdist) and loaded by the real llama.cpp."""

from __future__ import annotations

import pytest

from ctxq.gguf.reader import read_gguf
from ctxq.rpc import run_supervised
from ctxq.testing import upstream_models as um
from ctxq.testing.accuracy import _measure_child
from ctxq.units import MiB

# Issue 28's list: each must be among the checkpoints
REQUIRED = {"deepseek-v3", "gemma3n", "gemma4", "gemma4-moe", "llama4", "olmo3", "cohere2", "glm4moe",
            "nemotron-h-moe", "granite4-moe", "kimi-linear", "smollm3", "exaone4", "minimax-m2", "qwen35moe"}


def test_names_cover_the_issue_and_twenty_architectures():
    assert REQUIRED <= set(um.NAMES)
    assert len(um.NAMES) >= 20
    assert all(s.arch for s in um.SPECS.values())  # every entry says which GGUF arch it must come out as


def test_cache_key_follows_the_config_and_output_type():
    assert um.cache_key("smollm3") == um.cache_key("smollm3")
    assert um.cache_key("smollm3") != um.cache_key("smollm3", "bf16")
    assert um.cache_key("smollm3") != um.cache_key("seed-oss")


@pytest.mark.slow
@pytest.mark.parametrize("name", um.NAMES)
def test_builds_converts_and_loads_in_llama_cpp(name):
    if name in um.NOT_BUILDABLE:
        pytest.skip(um.NOT_BUILDABLE[name])
    path = um.build(name)
    g = read_gguf(path, skip_arrays=True)
    assert g.metadata["general.architecture"] == um.SPECS[name].arch
    # a real load on the CPU: llama.cpp's model buffers hold every tensor of the file (a few alignment pads more);
    # a tied output may be loaded as a second copy of token_embd (a TENSOR_DUPLICATED output, as Gemma 3n's)
    real = run_supervised(_measure_child, str(path), dict(n_ctx=4096, use_mmap=False), (), timeout=300)
    sizes = {t.name: t.nbytes for t in g.tensors}
    in_file = sum(sizes.values())
    tied_copy = 0 if "output.weight" in sizes else sizes["token_embd.weight"]
    loaded = sum(real["model"].values())
    assert in_file - MiB <= loaded <= in_file + tied_copy + MiB, (loaded, in_file, tied_copy)
    assert real["compute"], "llama.cpp reserved no compute buffer"
    assert sum(real["kv"].values()) + sum(real["state"].values()) > 0  # every one has attention or recurrent layers
