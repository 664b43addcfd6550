"""Rows of docs/accuracy-table.md's arch section that a split graph's terms (planning/memory/split.py) or the output peak's
derived model got wrong, each a real load of a checkpoint converted by llama.cpp's own converter, over the CPU and
loopback RPC workers. Planned per device against llama.cpp's allocations: never under beyond the rounding of its
printed sizes, and within 3 % / 2 MiB.

Measured on main (84358ef): lfm2moe's reader device 0.75 MiB under at [1,1] 64k q8_0 and [2,1,1] 16k f16 without
flash attention; granite4-moe's middle device +4.50 / +4.75 MiB over (6.04 MiB real); nemotron-h-moe +15.78 MiB on
the CPU alone (and +63.51 on the output device of [1,1] 64k q8_0, now 0.25 under: not yet here). These need, beside split.py, the recurrent rules
of lfm2moe and nemotron_h_moe (gguf/info.py) and the output peak's derived model ending like the model
(compute._ends_like_model): /work/notes/moe-other.patch.
"""

from __future__ import annotations

import pytest

from ctxq.rpc import start_workers
from ctxq.testing import upstream_models
from ctxq.testing.accuracy import check_cell

pytestmark = pytest.mark.slow

# (checkpoint, RPC split ratios or None for the CPU alone, n_ctx, KV type, flash attention)
CELLS = [
    pytest.param("lfm2moe", [1, 1], 65536, "q8_0", True, id="lfm2moe-rpc2-64k-q8"),
    pytest.param("lfm2moe", [2, 1, 1], 16384, "f16", False, id="lfm2moe-rpc3-16k-fa-off"),
    pytest.param("granite4-moe", [2, 1, 1], 16384, "f16", False, id="granite4-moe-rpc3-16k-fa-off"),
    pytest.param("granite4-moe", [2, 1, 1], 65536, "f16", True, id="granite4-moe-rpc3-64k"),
    pytest.param("nemotron-h-moe", None, 16384, "f16", True, id="nemotron-h-moe-cpu-16k"),
]


@pytest.mark.parametrize("name,devices,n_ctx,kv,fa", CELLS)
def test_split_row(name, devices, n_ctx, kv, fa, request):
    model = str(upstream_models.build(name))
    label = request.node.callspec.id
    if devices:
        with start_workers(len(devices)) as w:
            r = check_cell(model, n_ctx, kv, devices, workers=w, label=label, flash_attn=fa)
    else:
        r = check_cell(model, n_ctx, kv, None, label=label, flash_attn=fa)
    assert r.layers_match, r.layer_mismatch
    for dev in r.devices:
        detail = f"{label} {dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
        assert not dev.under, "under llama.cpp: " + detail
        assert dev.ok_tiny, detail
