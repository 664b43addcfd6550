"""The plan against a CUDA card that is present: what llama.cpp really allocates there must not exceed what
was planned for it. Needs a CUDA build and an NVIDIA GPU (`gpu` marker); skipped here with the reason.
scripts/gpu_check.sh runs the full matrix (NVML peaks too) on a GPU machine."""

from __future__ import annotations

import pytest

from ctxq.llama import backend

MiB = 1024**2


def _cuda_devices() -> list[str]:
    try:
        return [d.name for d in backend.ggml_devices() if d.name.startswith("CUDA")]
    except Exception:  # llama-cpp-python without CUDA: no such device
        return []


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda_devices(), reason="needs an NVIDIA GPU and a CUDA build of llama.cpp "
                                                              "(this machine has neither; see docs/gpu.md)")]


@pytest.mark.parametrize("kv, flash_attn", [("f16", True), ("q8_0", True), ("f16", False)])
def test_present_cuda_card_allocates_no_more_than_planned(tmp_path, kv, flash_attn):
    from ctxq.planning.planner import plan
    from ctxq.rpc import run_supervised
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    model = str(write_synthetic_gguf(tmp_path / "l8b.gguf", GEOMETRIES["llama3-8b"].scaled(n_layer=8)))
    p = plan(model, 32768, kv=kv, flash_attn=flash_attn)  # the devices present: the CUDA card(s)
    assert p.gpus and all(g.device.backend == "cuda" for g in p.gpus)

    kw = dict(n_ctx=p.n_ctx, n_gpu_layers=p.n_gpu_layers, type_k=p.type_k, type_v=p.type_v,
              flash_attn=p.flash_attn, n_batch=p.n_batch, n_ubatch=p.n_ubatch,
              tensor_split=[float(c) for c in p.tensor_split] if len(p.gpus) > 1 else None)
    real = run_supervised(_measure_cuda, model, kw, timeout=600)
    for i, g in enumerate(p.gpus):
        assert real[f"CUDA{i}"] <= g.buffers + 0.02 * MiB, (g.device.name, real, g.buffers)


def _measure_cuda(model: str, kw: dict) -> dict[str, int]:
    """In a child process (a fresh CUDA context): load for real, bytes per CUDA device."""
    from ctxq.llama.measure import measure

    m = measure(model, **kw)
    return {name: m.allocations.total(name) for name in _cuda_devices()}
