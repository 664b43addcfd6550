"""Issue 28 part 2: the planner's shortcuts (scripts/bench_plan.py) change no plan."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ctxq.planning.layers import search as layer_search
from ctxq.planning import planner
from ctxq.planning.devices import resolve_devices
from ctxq.planning.memory import costs as memory
from ctxq.planning.memory.costs import costs, device_cost
from ctxq.planning.options import PlanOptions
from ctxq.gguf.info import model_info
from ctxq.gguf.shards import read_model
from ctxq.testing.hybrid import write_gpt_oss, write_qwen35
from ctxq.testing.moe import tiny_moe_gguf
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

GiB = 1024**3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed")
    return {"llama3-70b": write_synthetic_gguf(d / "l70.gguf", GEOMETRIES["llama3-70b"]),
            "gemma2-9b": write_synthetic_gguf(d / "g9.gguf", GEOMETRIES["gemma2-9b"]),
            "qwen3-30b-a3b": write_synthetic_gguf(d / "q30.gguf", GEOMETRIES["qwen3-30b-a3b"]),
            "qwen35": write_qwen35(d / "qwen35.gguf"), "gpt-oss": write_gpt_oss(d / "gptoss.gguf"),
            "moe": tiny_moe_gguf(d / "moe.gguf")}


def _summary(p) -> tuple:
    return (p.n_gpu_layers, p.tensor_split, p.device_order, p.type_k, p.type_v, p.cpu_expert_layers, p.reason,
            [(g.device.name, g.layers, g.weights, g.kv, g.state, g.compute, g.total) for g in p.gpus],
            (p.host.layers, p.host.weights, p.host.kv, p.host.compute, p.host.total))


@pytest.mark.parametrize("name,gpus", [("llama3-70b", "16,16,16,8,8"), ("llama3-70b", "12,8,8"),
                                       ("gemma2-9b", "6,4"), ("qwen35", "0.5,0.5,0.25"), ("gpt-oss", "0.1,0.05")])
def test_device_cost_is_the_same_for_every_cpu_slot_count_of_one_memo_key(models, name, gpus):
    # the search memoises a device's total by memory.slots_key(n_cpu_slots): every count sharing a key must
    # cost the same, on the first CUDA device (op-offload copies) and the others (pipeline parallelism only)
    path = models[name]
    src = read_model(path)
    info = model_info(src)
    opts = PlanOptions(n_ctx=16384, gpus=gpus).resolved()
    devices, _ = resolve_devices(opts)
    n = info.n_layer
    for tk, tv in (("f16", "f16"), ("q8_0", "q8_0")):
        for c in (costs(info, src, opts, tk, tv, cuda=True),
                  costs(info, src, opts, tk, tv, cuda=True).with_cpu_experts(info.expert_layers)):
            seen: dict[tuple, int] = {}
            for d, dev in enumerate(devices):
                for start, hi in ((n - 1, n + 1), (n // 2, n), (n // 2, n + 1), (1, n - 1), (0, 2)):
                    for lo in range(0, start + 1):
                        first = d == 0
                        total = device_cost(c, range(start, min(hi, n)), hi == n + 1, 2, dev, first_cuda=first,
                                            n_cpu_slots=lo).total
                        key = (start, hi, d, first, memory.slots_key(lo, first))
                        assert seen.setdefault(key, total) == total, (name, key, lo)
            assert len(seen) > len(devices)  # the keys told some counts apart


@pytest.mark.parametrize("name,ctx,kw", [
    ("llama3-70b", 65536, dict(gpus="16,16,16,8,8")), ("llama3-70b", 131072, dict(gpus="24,24")),
    ("llama3-70b", 32768, dict(gpus="12,8,8", kv="f16")), ("llama3-70b", 32768, dict(simulate="16,8,8")),
    ("gemma2-9b", 65536, dict(gpus="6,4")), ("qwen3-30b-a3b", 65536, dict(gpus="12,4")),
    ("qwen35", 65536, dict(gpus="0.5,0.5,0.25")), ("gpt-oss", 4096, dict(gpus="0.1,0.05")),
    ("moe", 65536, dict(simulate="0.02,0.02"))])
def test_memoised_search_plans_as_the_full_search(models, monkeypatch, name, ctx, kw):
    fast = planner.plan(models[name], ctx, cpu_memory=256 * GiB, **kw)
    monkeypatch.setattr(layer_search, "slots_key", lambda n_cpu_slots, first_cuda: n_cpu_slots)  # every count apart
    full = planner.plan(models[name], ctx, cpu_memory=256 * GiB, **kw)
    assert _summary(fast) == _summary(full)


def test_the_cli_imports_neither_numpy_nor_gguf():
    # gguf's __init__ imports numpy and all of gguf (0.16 CPU s); the header reader loads only its constants
    code = "import sys, ctxq.cli; print(sorted(m for m in ('numpy', 'gguf', 'llama_cpp') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def test_a_second_plan_in_a_new_process_needs_neither_llama_cpp_nor_numpy(models, tmp_path):
    # a user's second `ctxq plan`: derived models, dry runs and the referee's accounting all read from CTXQ_HOME
    code = ("import sys; from ctxq.planning.planner import plan; "
            f"p = plan({str(models['llama3-70b'])!r}, 65536, gpus='16,16,16,8,8'); "
            "print(p.llama_flags()); print(sorted(m for m in ('numpy', 'gguf', 'llama_cpp') if m in sys.modules))")
    env = {**os.environ, "CTXQ_HOME": str(tmp_path / "home")}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "llama_cpp" in first.stdout.splitlines()[-1]  # the first plan asked llama.cpp
    assert again.stdout.splitlines() == [first.stdout.splitlines()[0], "[]"]
