"""The planner with CUDA's own memory terms (ctxq.planning.cuda wired into ctxq.planning.memory):
described GPUs are CUDA cards, each keeps a reserve, the first one takes the op-offload copies.
No GPU here: plans for --gpus on real header-only GGUFs (Llama-3-70B / 8B shapes, Q4_K_M recipe)."""

from __future__ import annotations

import json

import pytest

from ctxq.errors import InvalidOption
from ctxq.gguf.info import model_info
from ctxq.planning.memory import cuda
from ctxq.planning.devices import Device, load_profile, parse_gpus
from ctxq.planning.planner import plan
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf
from ctxq.units import GiB, MiB

from .conftest import run_ctxq

BOX = "16,16,16,8,8"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda_plan")
    return {k: write_synthetic_gguf(d / f"{k}.gguf", GEOMETRIES[k]) for k in ("llama3-70b", "llama3-8b", "gemma2-9b")}


def test_q8_0_compute_exceeds_f16_by_the_f16_copies_on_every_gpu(models):
    # the acceptance figure: 70B Q4_K_M, 65,536 tokens, a fixed split, q8_0 against f16 KV:
    # every GPU's compute buffer grows by 2 * 65536 * 1024 * 2 bytes (f16 K and V of one layer), +-15 %
    split = "21,20,20,10,10"
    q8 = plan(models["llama3-70b"], 65536, gpus=BOX, split=split, kv="q8_0")
    f16 = plan(models["llama3-70b"], 65536, gpus=BOX, split=split, kv="f16")
    want = 2 * 65536 * 1024 * 2
    for a, b in zip(q8.gpus, f16.gpus):
        grown = (a.compute + a.cuda_copies) - (b.compute + b.cuda_copies)
        assert abs(grown - want) <= 0.15 * want, (a.device.name, grown / MiB)
        assert a.cuda_copies == want and b.cuda_copies == 0  # exactly the copies, and none with f16


def test_cpu_layers_grow_the_first_gpu_by_the_offload_copies(models):
    # f16 KV at 64k does not fit 70B on 64 GiB: layers go to the CPU, and CUDA0 receives, one at a time,
    # their weights and KV for prompt processing (ggml-backend's op offload)
    p = plan(models["llama3-70b"], 65536, gpus=BOX, kv="f16", offload="layers")  # whole layers (test_spill: weights)
    assert p.cpu_layers > 0
    info = model_info(models["llama3-70b"])
    table = cuda.layer_table(info, n_ctx=65536, n_ubatch=512, type_k="f16", type_v="f16", flash_attn=True)
    expect = table.offload_prefix[p.cpu_layers]
    assert expect >= 256 * MiB  # one CPU layer's f16 K+V: 65536 * 1024 * 2 * 2 bytes
    assert p.gpus[0].cuda_copies == expect
    assert all(g.cuda_copies == 0 for g in p.gpus[1:])
    # the same model with every layer on the GPUs has no offload copies on the first one
    full = plan(models["llama3-70b"], 65536, gpus=BOX, kv="q8_0")
    assert full.cpu_layers == 0 and full.gpus[0].cuda_copies == full.gpus[1].cuda_copies


@pytest.mark.parametrize("model, n_ctx, gpus", [("llama3-70b", 65536, BOX), ("llama3-70b", 32768, "24,24"),
                                                ("llama3-8b", 131072, "8,8"), ("gemma2-9b", 32768, "12,8"),
                                                ("llama3-8b", 65536, "6")])
def test_no_described_card_is_planned_above_capacity_minus_reserve_and_cuda_terms(models, n_ctx, model, gpus):
    for kv in ("auto", "f16"):
        p = plan(models[model], n_ctx, gpus=gpus, kv=kv, flash_attn=True)
        for g in p.gpus:
            assert g.margin == cuda.CUDA_RESERVE
            assert g.weights + g.kv + g.compute + g.cuda_extra <= g.device.usable - g.margin, g.device.name


def test_reserve_is_overridable_and_refused_when_larger_than_the_card(models, tmp_path):
    p = plan(models["llama3-8b"], 8192, gpus="8,8", reserve=GiB)
    assert all(g.margin == GiB for g in p.gpus) and all(g.free == g.device.usable - g.total for g in p.gpus)
    with pytest.raises(InvalidOption) as e:
        plan(models["llama3-8b"], 8192, gpus="8,4", reserve=5 * GiB)
    assert e.value.option == "reserve" and "GPU1" in str(e.value)
    r = run_ctxq("plan", str(models["llama3-8b"]), "-c", "8192", "--gpus", "8,4", "--reserve", "5")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--reserve" in r.stderr and "Traceback" not in r.stderr
    # a profile may set the backend and reserve per card; another backend gets llama.cpp --fit's 1 GiB
    prof = tmp_path / "box.toml"
    prof.write_text('[[device]]\nmemory_gib = 16\nreserve_gib = 0.5\n\n[[device]]\nmemory_gib = 16\nbackend = "vulkan"\n')
    devices, _ = load_profile(str(prof))
    assert [(d.backend, d.reserve) for d in devices] == [("cuda", GiB // 2), ("vulkan", None)]
    p = plan(models["llama3-8b"], 65536, profile=str(prof), kv="q8_0")
    assert [g.margin for g in p.gpus] == [GiB // 2, cuda.OTHER_GPU_RESERVE]
    assert p.gpus[0].cuda_copies > 0 and p.gpus[1].cuda_extra == 0  # only the CUDA card has CUDA's terms


def test_rpc_and_cpu_devices_have_no_cuda_terms(models):
    rpc = [Device(name=f"RPC{i}", kind="rpc", total=16 * GiB, usable=16 * GiB) for i in range(2)]
    p = plan(models["llama3-8b"], 65536, devices=rpc, kv="q8_0")
    assert all(g.cuda_extra == 0 and g.device.backend == "rpc" for g in p.gpus)
    assert p.host.cuda_extra == 0 and [d.backend for d in parse_gpus("8,8")] == ["cuda", "cuda"]


def test_json_and_table_show_the_cuda_terms_apart(models):
    r = run_ctxq("plan", str(models["llama3-70b"]), "-c", "65536", "--gpus", BOX, "--json")
    assert r.returncode == 0, r.stderr
    gpus = json.loads(r.stdout)["gpus"]
    assert all(g["cuda_copies"] == 256 * MiB and g["cuda_extra"] == g["cuda_copies"] + g["cuda_pool"] for g in gpus)
    assert all(g["total"] == g["buffers"] + g["cuda_pool"] + g["margin"] and g["free"] >= 0 for g in gpus)
    r = run_ctxq("plan", str(models["llama3-70b"]), "-c", "65536", "--gpus", BOX)
    head = r.stdout.splitlines()[1].split()
    assert head == ["device", "layers", "weights", "KV", "compute", "CUDA", "reserve", "total", "capacity", "free", "use"]
