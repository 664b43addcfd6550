"""llama.cpp's split accounting in a dry run over loopback RPC workers (ctxq.planning.split_dry), against real loads
of the same split on the same workers."""

from __future__ import annotations

import pytest

from ctxq.gguf.info import model_info
from ctxq.planning.split_dry import split_dry_run
from ctxq.planning.memory.compute import load_source
from ctxq.rpc import run_supervised, start_workers
from ctxq.testing.accuracy import _measure_child
from ctxq.units import MiB

ROUNDING = 0.005 * MiB  # llama.cpp prints sizes in MiB with 2 decimals


@pytest.mark.parametrize("split,n_ctx,kv,fa", [([1.0, 1.0], 16384, "f16", True), ([2.0, 1.0, 1.0], 4096, "q8_0", True),
                                               ([1.0, 1.0], 8192, "f16", False)])
def test_dry_run_less_lost_pins_is_the_real_split(smollm2, split, n_ctx, kv, fa):
    """The dry run's compute buffers, less the pinned norms it loses (split inputs in the scheduler's copies), are
    what a real load of the split allocates on each device and on the host; without the correction every device
    after the first is over by one residual per copy (if llama.cpp fixes the lost pins, the first assertion fails
    and split_dry's correction goes)."""
    info = model_info(load_source(smollm2))
    resid = info.n_embd * 512 * 4
    kw = dict(n_ctx=n_ctx, n_gpu_layers=99, tensor_split=split, type_k=kv, type_v=kv, flash_attn=fa)
    with start_workers(len(split)) as w:
        dry = split_dry_run(str(smollm2), w, resid=resid, **kw)
        real = run_supervised(_measure_child, str(smollm2), kw, (), rpc=w.endpoints, workers=w, timeout=600)["compute"]
    lost = [d.lost_pins for d in dry]
    assert lost[0] == [] and all(len(names) == 1 and names[0].startswith("norm-") for names in lost[1:-1]), lost
    assert all(d.lost_bytes == 4 * resid for d in dry[1:-1])  # pipeline parallelism: 4 copies
    for d in dry:
        got = sum(v for k, v in real.items() if k.startswith("CPU")) if d.name == "CPU" else real[d.name]
        assert abs(d.corrected - got) <= ROUNDING, (d.name, d.compute / MiB, d.corrected / MiB, got / MiB)
    assert any(d.compute - real[d.name] > ROUNDING for d in dry[1:-1])  # the uncorrected dry run is over
