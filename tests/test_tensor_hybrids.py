"""Tensor mode for the hybrids llama.cpp runs (issue 54), and agreement with llama.cpp on which architectures it
runs, both checked against real loads over loopback RPC workers (scripts/tensor_truth.py: each worker's
GGML_RPC_DEBUG log of the buffers it holds). Qwen3.5-shaped models are loaded without a batch: this llama.cpp
aborts in its RPC worker at their first batch in tensor mode (ggml-rpc.cpp:1414, a tensor outside its buffer), for
the converter's Qwen3.5-MoE as for ctxq's own (Qwen3-Next at uneven proportions earlier, in the client:
ggml-backend-meta.cpp:1086, `split_state.ne[j] % div == 0`), so their all-reduce scratch cannot be measured here.
Which architectures load is probed for every yardstick in one child over the same two workers (tensor_truth.probe)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ctxq
from ctxq.errors import InvalidOption
from ctxq.gguf.info import model_info
from ctxq.gguf.shards import read_model
from ctxq.llama.archs import refuses_tensor_mode, tensor_mode_support
from ctxq.planning.tensor.batch import loads_only
from ctxq.planning.tensor.mode import allreduce_bytes
from ctxq.testing import upstream_models
from ctxq.testing.hybrid import MAKERS, HybridGeometry, write_qwen35

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import tensor_truth  # noqa: E402

MiB = 2**20
# Delta nets wide enough that every card gets whole heads (4 K heads and 8 V heads of 128: llama.cpp's granule is
# lcm(128, ssm_d_state) wide, and a card given no head aborts the RPC worker at the first batch)
WIDE = HybridGeometry(**tensor_truth.WIDE)


def _model(name: str, folder: Path) -> Path:
    if name in ("qwen35", "qwen3next", "qwen35moe"):
        return write_qwen35(folder / f"{name}.gguf", WIDE, arch=name)
    return MAKERS[name](folder / f"{name}.gguf")


@pytest.mark.parametrize("name,split,kv,batch", [
    ("lfm2", "2:1", "q8_0", True), ("lfm2", "5:3:2", "f16", True),
    ("qwen35", "2:1", "q8_0", False), ("qwen3next", "5:3:2", "f16", False), ("qwen35moe", "2:1", "q4_0", False),
])
def test_each_hybrid_card_is_what_llama_cpp_allocates(name, split, kv, batch, tmp_path):
    """Weights within 3 % / 2 MiB and never under (tensors padded to 128 bytes, the RPC worker aligns to 32), the
    attention KV and the recurrent state to the byte (the LFM2 convolution state whole on every card, the delta
    nets' cut by whole heads), the compute buffer (with the scratch after a batch) never under and within 2 MiB."""
    model = _model(name, tmp_path)
    n = len(split.split(":"))
    p = tensor_truth.planned(model, 4096, kv, split.replace(":", ","), simulate=",".join("1" for _ in range(n)))
    cards = tensor_truth.measure(model, 4096, [float(x) for x in split.split(":")], kv, kv, 512,
                                 n_eval=None if batch else 0)
    # without a batch no scratch is allocated: the planned scratch is then added to what the card holds
    scratch = 0 if batch else allreduce_bytes(model_info(read_model(model)), n, 512)
    for g, c in zip(p.gpus, cards):
        assert not c.warnings, c.warnings
        assert 0 <= g.weights - c.weights <= min(0.03 * c.weights, 2 * MiB), (g.weights, c.weights)
        assert g.kv + g.state == c.kv, (g.kv, g.state, c.kv)
        assert 0 <= g.compute - (c.compute + scratch) <= 2 * MiB, (g.compute / MiB, c.compute / MiB, scratch)
    if name == "lfm2":
        assert p.gpus[0].state == p.gpus[-1].state > 0  # mirrored
    else:
        assert p.gpus[0].state > p.gpus[-1].state > 0  # cut by heads


def test_the_build_says_which_architectures_it_refuses():
    """Asked of the linked libllama (llm_arch_supports_sm_tensor over every llm_arch), not typed by hand."""
    table = tensor_mode_support()
    assert table is not None and len(table) > 100 and "llama" in table
    assert refuses_tensor_mode("deepseek2") and refuses_tensor_mode("nemotron_h")
    assert refuses_tensor_mode("qwen35") is False and refuses_tensor_mode("lfm2moe") is False
    assert refuses_tensor_mode("no-such-arch") is None


# Every architecture ctxq's yardsticks make: the hybrids made in code, and the converter's checkpoints (built here where
# no earlier test has: 15-20 s each, cached in ctxq's home), one model per architecture.
def _one_per_arch() -> list[tuple[str, str]]:
    seen, out = set(), []
    for kind, name in [("made", n) for n in MAKERS] + [("upstream", n) for n in upstream_models.NAMES]:
        arch = name if kind == "made" else upstream_models.SPECS[name].arch
        if arch not in seen:
            seen.add(arch)
            out.append((kind, name))
    return out


_YARDSTICKS = _one_per_arch()


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict[str, tuple[Path | None, str | None]]:
    """name -> (the model or None where it is not at hand, llama.cpp's reason where it does not load it): every
    yardstick probed in one child process over the same two loopback RPC workers (tensor_truth.probe), each load in
    tensor mode without a batch, freed before the next."""
    folder = tmp_path_factory.mktemp("yardsticks")
    models = {}
    for kind, name in _YARDSTICKS:
        if kind == "made":
            models[name] = _model(name, folder)
        elif name not in upstream_models.NOT_BUILDABLE:
            models[name] = _built_upstream(name)
    got = tensor_truth.probe([m for m in models.values() if m is not None], timeout=300)
    return {name: (m, got.get(str(m)) if m is not None else None) for name, m in models.items()}


@pytest.mark.parametrize("kind,name", _YARDSTICKS, ids=[n for _, n in _YARDSTICKS])
def test_ctxq_plans_tensor_mode_exactly_where_llama_cpp_loads_it(kind, name, probed):
    """The probe: a load in tensor mode over two loopback RPC workers (no batch), in a child process. Where it
    loads, ctxq plans; where llama.cpp refuses the architecture, ctxq refuses in one line with its reason. What a
    first batch then does is tests/test_tensor_batch.py's question (the plan here leaves those refusals out)."""
    if kind == "upstream" and name in upstream_models.NOT_BUILDABLE:
        pytest.skip(upstream_models.NOT_BUILDABLE[name])
    model, why = probed[name]
    if model is None:
        pytest.skip(f"{name}: llama.cpp's converter or transformers refused the checkpoint (upstream_models.build)")
    loads = why is None
    try:
        with loads_only():
            ctxq.plan(str(model), 2048, simulate="1,1", split_mode="tensor", kv="f16")
        plans, refusal = True, ""
    except InvalidOption as e:
        plans, refusal = False, str(e)
    arch = model_info(read_model(model)).arch
    assert plans == loads, (arch, why, refusal)
    if not loads:
        assert "LLAMA_SPLIT_MODE_TENSOR not implemented" in why and "\n" not in refusal
        assert "LLAMA_SPLIT_MODE_TENSOR not implemented" in refusal


def _built_upstream(name: str) -> Path | None:
    try:
        return upstream_models.build(name)
    except upstream_models.NotBuildable:
        return None
