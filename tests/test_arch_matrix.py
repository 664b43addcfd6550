"""Issue 28 part 5: a representative slice of the matrix no rule wrote (docs/accuracy-table.md, sections arch and
arch-realistic): ctxq's plan per device against llama.cpp's real allocations on checkpoints converted by
llama.cpp's own converter, over the CPU and loopback RPC workers.

A cell fails when a device row is under llama.cpp beyond the rounding of its printed sizes, outside 3 % / 2 MiB
(tiny checkpoints) or 1 % / 32 MiB (real widths), when the layers land elsewhere than planned, or when the plan
itself fails. A cell the planner gets wrong is a strict xfail (pytest.mark.xfail(strict=True, raises=AssertionError))
naming the cause, so that a fix shows as XPASS and its marker must go; none is left.
"""

from __future__ import annotations

import pytest

from ctxq.rpc import start_workers
from ctxq.testing import upstream_models, upstream_widths
from ctxq.testing.accuracy import CellResult, check_cell

pytestmark = pytest.mark.slow

# (checkpoint, devices: None = CPU or RPC split ratios, n_ctx, KV type, flash attention, n_cpu_moe), marks.
# Fixed by h-facts (their xfails removed): deepseek-v3 (MLA's V cache), gemma3n / gemma4 / deepseek-v2-lite
# (plans that failed on ctxq's derived probe), kimi-linear and nemotron-h-moe (recurrent layers at the attention
# peak), the sliding-window and chunked families under llama.cpp on the CPU and 2 devices.
# Fixed by h-compute: devices holding layers but not the head, one residual under with flash attention
# (split.held_input, with memory.py's patch), and DeepSeek-V2-Lite's derived model (derived._LAYER_COUNT_KEYS).
# Fixed by h-host: the host's compute with experts in CPU memory (memory.host_cost, inputs.host_experts), and
# devices whose layers all slide or chunk (compute_peaks' by-kind peaks for iSWA models, memory.Costs.cache_inputs).
# Fixed by h-g3n: Gemma 3n's first layer's device (the per-layer slabs its derived models cut, inputs.per_layer_slabs)
# and the weights outside its blocks (gguf.info.LAYER_TENSORS / OUTPUT_TENSORS).
# Fixed by h-iswa: an iSWA model's device holding only full-attention layers (compute._full_only), the device holding
# the head alone (split.device_compute), EXAONE 4's devices without the head (compute._headless).
TINY = [
    pytest.param("smollm3", [2, 1, 1], 16384, "f16", False, None, id="smollm3-rpc3-16k-fa-off"),
    pytest.param("smollm3", [2, 1, 1], 65536, "f16", True, None, id="smollm3-rpc3-64k"),
    pytest.param("dots1", [2, 1, 1], 16384, "f16", False, None, id="dots1-rpc3-16k-fa-off"),
    pytest.param("olmoe", [1, 1], 65536, "q8_0", True, None, id="olmoe-rpc2-64k-q8"),
    pytest.param("falcon-h1", [2, 1, 1], 16384, "f16", False, None, id="falcon-h1-rpc3-16k-fa-off"),
    pytest.param("seed-oss", None, 16384, "f16", True, None, id="seed-oss-cpu-16k"),
    pytest.param("deepseek-v3", [2, 1, 1], 16384, "f16", False, None, id="deepseek-v3-rpc3-16k-fa-off"),
    pytest.param("gemma3n", None, 16384, "f16", True, None, id="gemma3n-cpu-16k"),
    pytest.param("gemma4", [2, 1, 1], 65536, "f16", True, None, id="gemma4-rpc3-64k"),
    pytest.param("gemma4", [2, 1, 1], 16384, "f16", False, None, id="gemma4-rpc3-16k-fa-off"),  # compute._alternating
    pytest.param("exaone4", None, 16384, "f16", True, None, id="exaone4-cpu-16k"),  # fixed by the real-header compute fallback
    pytest.param("glm4moe", [1, 1], 65536, "q8_0", True, None, id="glm4moe-rpc2-64k-q8"),
    pytest.param("llama4", [1, 1], 65536, "q8_0", True, None, id="llama4-rpc2-64k-q8"),
    pytest.param("deepseek-v2-lite", [1, 1], 65536, "q8_0", True, None, id="deepseek-v2-lite-rpc2-64k-q8"),
    pytest.param("olmo3", [2, 1, 1], 16384, "f16", False, None, id="olmo3-rpc3-16k-fa-off"),  # compute._full_only
    pytest.param("cohere2", [2, 1, 1], 65536, "f16", True, None, id="cohere2-rpc3-64k"),
    pytest.param("gemma3n", [1, 1], 65536, "q8_0", True, None, id="gemma3n-rpc2-64k-q8"),
    pytest.param("kimi-linear", [2, 1, 1], 16384, "f16", False, None, id="kimi-linear-rpc3-16k-fa-off"),
    pytest.param("nemotron-h-moe", [2, 1, 1], 65536, "f16", True, None, id="nemotron-h-moe-rpc3-64k"),
    pytest.param("qwen35moe", [2, 1, 1], 65536, "q8_0", True, 2, id="qwen35moe-rpc3-64k-q8-ncmoe2"),
    pytest.param("deepseek-v3", [2, 1, 1], 65536, "q8_0", True, 2, id="deepseek-v3-rpc3-64k-q8-ncmoe2"),
]
REAL = [
    pytest.param("deepseek-v3-2l", [1, 1], 16384, "f16", True, None, id="deepseek-v3-2l-rpc2-16k"),
    pytest.param("llama4-scout-4l", [2, 1, 1], 65536, "f16", True, None,
                 id="llama4-scout-4l-rpc3-64k"),
    pytest.param("olmo3-7b-4l", [2, 1, 1], 16384, "f16", False, None, id="olmo3-7b-4l-rpc3-16k-fa-off"),
    pytest.param("gemma4-6l", [1, 1], 16384, "f16", True, None, id="gemma4-6l-rpc2-16k"),
]


def _check(model: str, devices, n_ctx: int, kv: str, fa: bool, n_cpu_moe, label: str, tiny: bool) -> None:
    if devices:
        with start_workers(len(devices)) as w:
            r = check_cell(model, n_ctx, kv, devices, workers=w, label=label, flash_attn=fa, n_cpu_moe=n_cpu_moe)
    else:
        r = check_cell(model, n_ctx, kv, None, label=label, flash_attn=fa)
    assert_close(r, tiny)


def assert_close(r: CellResult, tiny: bool) -> None:
    assert r.layers_match, r.layer_mismatch
    for dev in r.devices:
        detail = f"{r.label} {dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
        assert not dev.under, "under llama.cpp: " + detail
        assert dev.ok_tiny if tiny else dev.ok, detail


@pytest.mark.parametrize("name,devices,n_ctx,kv,fa,n_cpu_moe", TINY)
def test_tiny_checkpoint_cell(name, devices, n_ctx, kv, fa, n_cpu_moe, request):
    _check(str(upstream_models.build(name)), devices, n_ctx, kv, fa, n_cpu_moe, request.node.callspec.id, tiny=True)


@pytest.mark.parametrize("name,devices,n_ctx,kv,fa,n_cpu_moe", REAL)
def test_real_width_cell(name, devices, n_ctx, kv, fa, n_cpu_moe, request):
    _check(str(upstream_widths.build_realistic(name)), devices, n_ctx, kv, fa, n_cpu_moe, request.node.callspec.id,
           tiny=False)


def test_host_gathers_gemma3n_per_layer_rows():
    """The host gathers Gemma 3n's per-layer embedding rows for the devices of a split graph (inputs.host_gathers):
    its row is within the tiny target and not under."""
    with start_workers(2) as w:
        r = check_cell(str(upstream_models.build("gemma3n")), 65536, "q8_0", [1, 1], workers=w, label="gemma3n host",
                       flash_attn=True)
    host = next(d for d in r.devices if d.name == "CPU")
    assert not host.under and host.ok_tiny, f"planned {host.planned}, llama.cpp {host.real}"
