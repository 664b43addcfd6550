"""Gemma 4 at its real layer widths (upstream_widths' gemma4-6l: s s s s s f, per-layer inputs): the peaks of a
device whose layers all slide come from llama.cpp's dry run of a derived model, not from the whole header's."""

from __future__ import annotations

import pytest

from ctxq.gguf.info import model_info
from ctxq.planning.memory import compute
from ctxq.planning.facts import model_facts
from ctxq.testing import upstream_widths

pytestmark = pytest.mark.slow

MiB = 1 << 20


def test_sliding_only_peaks_from_derived_model():
    """A derived model holding only sliding layers loads (derived._FULL_LAYER_TENSORS, MIN_LAYERS): at 16k without
    flash attention its peak has no full layer's KQ matrix (f32 [16384, 512, 8 heads], 256 MiB). Before, llama.cpp
    refused it and the whole header's peak (334.52 MiB) stood for it: the first of 3 RPC devices, layers 0-3,
    planned 1024.48 MiB where llama.cpp allocates 777.95."""
    src = compute.load_source(str(upstream_widths.build_realistic("gemma4-6l")))
    args = dict(n_ctx=16384, n_ubatch=512, n_batch=2048)
    info = model_facts(src, model_info(src), **args, flash_attn=False)
    assert [la.kind for la in info.layers] == ["sliding"] * 5 + ["attention"]
    peaks = compute.compute_peaks(src, info, **args, type_k="f16", type_v="f16", flash_attn=False)
    sliding = peaks.by_kind["sliding"]
    # the mixed peaks hold the full layer's KQ matrix; the sliding ones only the window's (1024 cells: 16 MiB)
    assert peaks.layer_steady > 256 * MiB
    assert sliding.layer_steady < 128 * MiB and sliding.layer_full < 128 * MiB, sliding


def test_real_width_cell_per_layer_inputs():
    """3 RPC devices [2,1,1] at 16k without flash attention: each device within 1 % / 32 MiB and none under. The
    first device (layers 0-3, all sliding) receives inp_per_layer whole, the second (4-5) its layers' views of it
    (inputs.altup_inputs for Gemma 4). Before: RPC0 planned 1024.48 MiB, 777.95 real (+246.5); RPC1 963.65 / 965.63
    (1.98 under)."""
    from ctxq.rpc import start_workers
    from ctxq.testing.accuracy import check_cell

    with start_workers(3) as w:
        r = check_cell(str(upstream_widths.build_realistic("gemma4-6l")), 16384, "f16", [2, 1, 1], workers=w,
                       label="gemma4-6l rpc3 16k fa-off", flash_attn=False)
    assert r.layers_match, r.layer_mismatch
    for dev in r.devices:
        assert not dev.under and dev.ok, f"{dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
