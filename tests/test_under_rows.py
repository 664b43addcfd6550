"""The last rows of docs/accuracy-table.md's arch sections outside issue 28's target (main db7641c), each a real load
over loopback RPC workers of a checkpoint converted by llama.cpp's own converter, planned per device against
llama.cpp's allocations: never under beyond the rounding of its printed sizes, and within 3 % / 2 MiB (tiny) or
1 % / 32 MiB (real widths).

Each is where ggml-alloc places the device's tensors in its split graph, against the one-device graphs of the
derived models; measured with GGML_SCHED_DEBUG=2 and an eval callback reading every node's offset in its buffer:

- nemotron-h-moe [2,1,1] 64k q8_0, experts of layers 0-1 on the host: RPC0 (layers 0-4) computes 66.2522 MiB,
  planned 66.16 before (the one-layer floor of split.moe_split_peaks), 66.41 now (inputs.moe_split_layer_full:
  its mask arrives after the down projection's copy, above its first split's live tensors).
- deepseek-v3-2l (real widths) [2,1,1] q8_0, experts of layer 1 on the host: RPC0 (both layers) 383.01 / 431.01
  MiB real at 16k / 64k, +41.00 MiB before, +27.00 now (the one-device graph's dead inp_embd leaf, 14 MiB, off).
- deepseek-v2-lite [2,1,1] 64k f16: RPC0 and RPC1 259.5586 MiB real, 259.5452 planned before (13.4 KB under),
  259.5752 now (compute.steady_layers: the third MoE layer's residual lands above its router's small results).
"""

from __future__ import annotations

import pytest

from ctxq.rpc import start_workers
from ctxq.testing import upstream_models, upstream_widths
from ctxq.testing.accuracy import check_cell

pytestmark = pytest.mark.slow

# (checkpoint, real widths, RPC split ratios, n_ctx, KV type, experts of the first n layers on the host)
CELLS = [
    pytest.param("nemotron-h-moe", False, [2, 1, 1], 65536, "q8_0", 2, id="nemotron-h-moe-rpc3-64k-q8-ncmoe2"),
    pytest.param("deepseek-v2-lite", False, [2, 1, 1], 65536, "f16", None, id="deepseek-v2-lite-rpc3-64k"),
    pytest.param("deepseek-v3-2l", True, [2, 1, 1], 65536, "q8_0", 2, id="deepseek-v3-2l-rpc3-64k-q8-ncmoe2"),
]


@pytest.mark.parametrize("name,real_widths,devices,n_ctx,kv,n_cpu_moe", CELLS)
def test_under_row(name, real_widths, devices, n_ctx, kv, n_cpu_moe, request):
    model = str(upstream_widths.build_realistic(name) if real_widths else upstream_models.build(name))
    label = request.node.callspec.id
    with start_workers(len(devices)) as w:
        r = check_cell(model, n_ctx, kv, devices, workers=w, label=label, flash_attn=True, n_cpu_moe=n_cpu_moe)
    assert r.layers_match, r.layer_mismatch
    for dev in r.devices:
        detail = f"{label} {dev.name}: planned {dev.planned}, llama.cpp {dev.real}"
        assert not dev.under, "under llama.cpp: " + detail
        assert dev.ok if real_widths else dev.ok_tiny, detail
