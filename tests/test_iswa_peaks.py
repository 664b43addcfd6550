"""An iSWA model's device holding only full-attention layers (compute._full_only): planned from derived models
with the full layers first and one sliding layer last, less the sliding cache's inputs, and checked against
llama.cpp's real allocations over loopback RPC workers. The output device of a 3-way 2:1:1 split of these tiny
8-layer checkpoints (pattern s s s f) holds layer 7, a full one, and the head."""

from __future__ import annotations

import pytest

from ctxq.planning.memory import compute
from ctxq.planning.facts import model_facts
from ctxq.gguf.info import model_info
from ctxq.rpc import start_workers
from ctxq.testing import upstream_models
from ctxq.testing.accuracy import check_cell
from ctxq.units import MiB

pytestmark = pytest.mark.slow


def test_full_only_peaks_leave_out_the_sliding_inputs():
    """The full-only peaks lie below the mixed ones by about the sliding cache's mask (f32 [4608, 512]: 9 MiB)."""
    src = compute.load_source(str(upstream_models.build("cohere2")))
    info = model_facts(src, model_info(src), n_ctx=16384, n_ubatch=512, n_batch=2048, flash_attn=False)
    p = compute.compute_peaks(src, info, n_ctx=16384, n_ubatch=512, n_batch=2048, type_k="f16", type_v="f16",
                              flash_attn=False)
    full = p.of({"attention"})
    assert full.layer_steady == p.by_kind["attention"].layer_steady and not full.input_freed
    assert 8.5 * MiB < p.layer_steady - full.layer_steady < 10 * MiB
    assert p.of({"attention", "sliding"}) is p  # a device holding both kinds keeps the mixed peaks


@pytest.mark.parametrize("name", ["cohere2", "llama4"])
def test_full_only_output_device_within_target(name):
    """Before: planned 285.07 (cohere2) / 293.23 (llama4) MiB, llama.cpp 274.80 / 275.30; after 275.56 / 275.73."""
    with start_workers(3) as w:
        r = check_cell(str(upstream_models.build(name)), 16384, "f16", [2, 1, 1], workers=w, label=name,
                       flash_attn=False)
    assert r.layers_match, r.layer_mismatch
    out = r.devices[2]
    assert not out.under and 0 <= out.error <= 2 * MiB, f"{out.name}: planned {out.planned}, llama.cpp {out.real}"


def test_refused_derived_model_devices_without_head():
    """EXAONE 4 (its window only at 64 layers, so no derived model keeps it): the devices without the head are
    planned from a small-vocabulary copy of the whole model (compute._headless), not from the real header's peak
    at result_output. Before: 468.76 / 385.33 MiB planned, 442.51 / 359.09 real; after 442.53 / 359.10."""
    with start_workers(3) as w:
        r = check_cell(str(upstream_models.build("exaone4")), 65536, "f16", [2, 1, 1], workers=w, label="exaone4",
                       flash_attn=True)
    assert r.layers_match, r.layer_mismatch
    for dev in r.devices:
        assert not dev.under and dev.error <= 1 * MiB, f"{dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
