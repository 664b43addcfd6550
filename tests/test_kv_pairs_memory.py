"""Memory of K/V cache pairs (issue 37): a plan with K and V in different types against llama.cpp's real load of it,
split over two loopback RPC workers. The matrix over real geometries is section kv-pairs of docs/accuracy-table.md."""

from __future__ import annotations

import pytest

from ctxq.gguf.info import KV_PAD, kv_bytes, model_info
from ctxq.rpc import start_workers
from ctxq.testing.accuracy import PRINTED, check_cell

N_CTX = 8192


@pytest.fixture(scope="module")
def workers():
    with start_workers(2) as w:
        yield w


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["q8_0/q4_0", "q5_1/q4_0", "f16/q8_0"])
def test_pair_planned_as_llama_cpp_allocates(smollm2, workers, kv):
    """Every device within the tiny target and none under; the KV buffers equal llama.cpp's to its printed rounding,
    and together hold K's rows in K's type and V's in V's (not the pair's first type for both)."""
    r = check_cell(str(smollm2), N_CTX, kv, [1, 1], workers=workers, flash_attn=True, label=f"smollm2 {kv}")
    assert r.layers_match, r.layer_mismatch
    for d in r.devices:
        assert not d.under, (d.name, d.planned, d.real)
        assert d.ok_tiny, (d.name, d.error)
        # one printed size (34.125 MiB prints as 34.12), plus a byte: the parsed MiB are truncated to whole bytes
        assert abs(d.planned["kv"] - d.real["kv"]) <= PRINTED + 1, (d.name, d.planned["kv"], d.real["kv"])
    info = model_info(str(smollm2))
    tk, tv = kv.split("/")
    want = sum(kv_bytes(tk, info.n_embd_k_gqa(il)) + kv_bytes(tv, info.n_embd_v_gqa(il))
               for il in range(info.n_layer)) * N_CTX  # 8192 cells: already a multiple of KV_PAD
    assert N_CTX % KV_PAD == 0
    assert abs(sum(d.real["kv"] for d in r.devices) - want) <= len(r.devices) * (PRINTED + 1), (kv, want)
