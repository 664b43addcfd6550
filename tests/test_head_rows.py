"""Rows of docs/accuracy-table.md over the 1 % / 32 MiB target on Llama-4-Scout's real widths (4 layers, chunked
attention on 0-2, layer 3 the model's only full-attention layer), checked against llama.cpp's real allocations on
loopback RPC workers."""

from __future__ import annotations

import pytest

from ctxq.rpc import start_workers
from ctxq.testing import upstream_widths
from ctxq.testing.accuracy import check_cell
from ctxq.units import MiB

pytestmark = pytest.mark.slow


def test_only_full_layer_alone_without_pipeline():
    """Experts of layers 0-1 in CPU memory (no pipeline parallelism), split 2:1:1 at 64k q8_0: RPC1 holds layer 3
    alone and runs one split, no host expert split among it. Before: planned 190.68 MiB of compute from the mixed
    peaks (+86.59 MiB on the device), llama.cpp 104.09; now its one-layer peak (compute._full_only), 114.17, and the
    split referee's dry run, 104.09, with two layer inputs (20 MiB) for the pin the dry run loses on that device in a
    plan with host weights (split_referee._PINNED_EXTRA): 124.09."""
    with start_workers(3) as w:
        r = check_cell(str(upstream_widths.build_realistic("llama4-scout-4l")), 65536, "q8_0", [2, 1, 1], workers=w,
                       label="llama4-scout-4l ncmoe2", flash_attn=True, n_cpu_moe=2)
    assert r.layers_match, r.layer_mismatch
    dev = r.devices[1]
    detail = f"{dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
    assert not dev.under, detail
    assert dev.error <= 2 * 5120 * 512 * 4 + 0.02 * MiB, detail
    for d in r.devices:
        assert not d.under and d.ok, f"{d.name}: planned {d.planned}, llama.cpp {d.real}"
