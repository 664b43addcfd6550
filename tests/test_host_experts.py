"""The host's compute with experts in CPU memory once the attention mask is freed (inputs.host_experts' hole,
memory.mask_freed): Qwen3-30B-A3B's real layer widths (header only, 4 layers) on one RPC worker with the experts
of the first layers on the host, planned against llama.cpp's real load. Before, the host's row was 28-40 MiB over
at 32k-64k (the mask's hole, which ggml-alloc fills with the expert matmuls' results, counted as held)."""

from __future__ import annotations

import pytest

from ctxq.rpc import start_workers
from ctxq.testing.accuracy import check_cell
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf
from ctxq.units import MiB

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def a3b_4l(tmp_path_factory):
    g = GEOMETRIES["qwen3-30b-a3b"].scaled(n_layer=4, name="Qwen3-30B-A3B-4l")
    return str(write_synthetic_gguf(tmp_path_factory.mktemp("a3b") / "qwen3-30b-a3b-4l.gguf", g))


@pytest.mark.parametrize("n_ctx,kv,n_cpu_moe", [(65536, "q8_0", 2), (32768, "q8_0", 3)])
def test_host_experts_with_the_mask_freed(a3b_4l, n_ctx, kv, n_cpu_moe):
    with start_workers(1) as w:
        r = check_cell(a3b_4l, n_ctx, kv, [1], workers=w, flash_attn=True, n_cpu_moe=n_cpu_moe)
    host = next(d for d in r.devices if d.name == "CPU")
    detail = f"planned {host.planned}, llama.cpp {host.real}"
    assert r.layers_match, r.layer_mismatch
    assert not host.under and host.ok, detail
    # the compute buffer itself as llama.cpp's, to its printed rounding (40.25 and 28.25 MiB over before)
    assert -0.005 * MiB <= host.planned["compute"] - host.real["compute"] <= 1 * MiB, detail
