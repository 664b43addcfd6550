"""Gemma 3n (issue 28): where llama.cpp puts its tensors outside the blocks, and its 3-device cells against
llama.cpp's real allocations (the 2-device cell is in tests/test_arch_matrix.py)."""

from __future__ import annotations

import pytest

from ctxq.gguf.info import model_info
from ctxq.gguf.reader import read_gguf
from ctxq.rpc import start_workers
from ctxq.testing import upstream_models
from ctxq.testing.accuracy import PRINTED, check_cell

pytestmark = pytest.mark.slow


def test_weights_outside_blocks_go_where_llama_cpp_loads_them():
    """per_layer_model_proj / per_layer_proj_norm in layer 0's buffer, altup_proj / altup_unembd_proj in the
    output's (llama_model_gemma3n::load_arch_tensors, llama-arch.cpp): none of them on the host."""
    g = read_gguf(str(upstream_models.build("gemma3n")), skip_arrays=True)
    info = model_info(g)
    size = {t.name: t.nbytes for t in g.tensors}
    blk0 = sum(n for name, n in size.items() if name.startswith("blk.0."))
    assert info.layers[0].dense_bytes == blk0 + size["per_layer_model_proj.weight"] + size["per_layer_proj_norm.weight"]
    assert info.output_bytes == sum(size[n] for n in ("output_norm.weight", "altup_proj.weight",
                                                      "altup_unembd_proj.weight"))
    assert info.other_bytes == size["per_layer_token_embd.weight"]  # the host's input table


@pytest.mark.parametrize("n_ctx,fa", [(16384, False), (65536, True)], ids=["16k-f16-fa-off", "64k-f16"])
def test_three_devices(n_ctx, fa):
    """First, middle and output devices: before h-g3n 11.9-12.4, 0.5-1.0 and 3.7 MiB under llama.cpp."""
    with start_workers(3) as w:
        r = check_cell(str(upstream_models.build("gemma3n")), n_ctx, "f16", [2, 1, 1], workers=w, flash_attn=fa,
                       label=f"gemma3n-rpc3-{n_ctx}")
    assert r.layers_match, r.layer_mismatch
    for dev in r.devices:
        detail = f"{dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
        assert not dev.under and dev.ok_tiny, detail


@pytest.mark.parametrize("split,n_ctx", [([1, 3], 16384), ([1, 1], 65536)], ids=["1-3-16k", "1-1-64k"])
def test_output_device_with_many_layers_without_flash_attention(split, n_ctx):
    """The output device holding several layers, without flash attention (its steady peak, not the head, decides):
    before h-g3n 8.7 and 7.2 MiB under llama.cpp. A first device holding only sliding layers (split 1:3) is planned
    up to 7.7 MiB over (inputs.first_layer_peaks is a bound there), never under."""
    with start_workers(len(split)) as w:
        r = check_cell(str(upstream_models.build("gemma3n")), n_ctx, "f16", split, workers=w, flash_attn=False,
                       label=f"gemma3n-{split}-{n_ctx}")
    assert r.layers_match, r.layer_mismatch
    for dev in r.devices:
        assert not dev.under, f"{dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
    out = next(d for d in r.devices if d.name == f"RPC{len(split) - 1}")
    assert out.ok_tiny, f"{out.name}: planned {out.planned}, llama.cpp {out.real}"


def test_host_running_the_first_layers():
    """Layers 0-3 on the CPU, the rest on one RPC device, 16k f16 without flash attention: the host runs layer 0 and
    the graph start (inputs.host_first_layer). Its compute was 4.0 MiB under llama.cpp before h-g3n. The total is
    held to the tiny target only: with mmap, CPU_Mapped reports the file's span from layer 0 to per_layer_model_proj
    at its end (257.06 MiB, blocks 1-9 included), where a load without mmap gives the host's tensors, 253.07 MiB,
    the plan's figure."""
    with start_workers(1) as w:
        r = check_cell(str(upstream_models.build("gemma3n")), 16384, "f16", [0.35], workers=w, search=True,
                       flash_attn=False, label="gemma3n-host-layers")
    assert r.layers_match, r.layer_mismatch
    dev = next(d for d in r.devices if d.name == "RPC0")  # layers 1-9 and the head: 1.7 MiB under before h-g3n
    assert not dev.under and dev.ok_tiny, f"planned {dev.planned}, llama.cpp {dev.real}"
    host = next(d for d in r.devices if d.name == "CPU")
    detail = f"planned {host.planned}, llama.cpp {host.real}"
    # its compute and output buffers are two printed sizes, each rounded to 0.01 MiB (the plan takes the compute from
    # llama.cpp's dry run of the split, printed the same way)
    assert host.planned["compute"] >= host.real["compute"] - 2 * PRINTED and host.ok_tiny, detail
