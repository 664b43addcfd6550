"""Tensor mode (`-sm tensor`): each card's bytes as llama.cpp's meta device really allocates them, and the plan,
run and refusals built on them.

The reference is a real load in tensor mode over two loopback RPC workers started with GGML_RPC_DEBUG=1: each
worker logs every buffer it allocates and frees, so the buffers it holds after a short eval are that card's real
weights, KV cache, compute buffer and all-reduce scratch. The load runs in a child process (llama.cpp aborts
instead of returning errors).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import ctxq
from ctxq.errors import InvalidOption
from ctxq.gguf.info import kv_cells, model_info
from ctxq.gguf.shards import read_model
from ctxq.planning.tensor.split import TensorSplit, not_planned
from ctxq.testing import upstream_models

from .conftest import card_profile, run_ctxq

MiB = 2**20

# Two workers whose Python logging prints ggml's debug lines (ctxq's llama.cpp log callback logs at DEBUG);
# the parent registers them, loads the model in tensor mode, evaluates a few tokens and prints what each holds.
_LOAD = r"""
import json, os, re, socket, subprocess, sys, tempfile, time
from pathlib import Path
model, n_ctx, split, cache = sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3].split(",")], sys.argv[4]
WORKER = ("import logging, sys; logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format='%(message)s');"
          "from ctxq.rpc.server import serve_forever; serve_forever('127.0.0.1', int(sys.argv[1]), ['CPU'], 1)")
logs = Path(tempfile.mkdtemp(prefix="ctxq-test-tensor-"))
ports, procs = [], []
for i in range(len(split)):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
    procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(ports[-1])], stderr=subprocess.STDOUT,
                                  stdout=open(logs / f"w{i}.log", "wb"), env=dict(os.environ, GGML_RPC_DEBUG="1")))

def held_buffers(logs, n):
    # the buffers each of the n workers still holds: every alloc_buffer its debug log shows, less those freed
    held = []
    for i in range(n):
        txt = (logs / f"w{i}.log").read_text(errors="replace")
        bufs = {m[2]: int(m[1]) for m in re.findall(r"\[alloc_buffer\] device: (\S+), size: (\d+) -> remote_ptr: (\w+)", txt)}
        for ptr in re.findall(r"\[free_buffer\] remote_ptr: (\w+)", txt):
            bufs.pop(ptr, None)
        held.append(sorted(bufs.values()))
    return held


try:
    from ctxq.rpc import add_servers
    for _ in range(100):
        try:
            add_servers([f"127.0.0.1:{p}" for p in ports])
            break
        except Exception:
            time.sleep(0.2)
    import llama_cpp
    from gguf.constants import GGMLQuantizationType as T
    t = int(T[cache.upper()])
    llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_gpu_layers=999, split_mode=llama_cpp.LLAMA_SPLIT_MODE_TENSOR,
                          tensor_split=split, type_k=t, type_v=t, flash_attn=True, verbose=False, n_threads=1)
    llm.eval(llm.tokenize(b"Hello world, this is a test"))
    time.sleep(0.3)
    held = held_buffers(logs, len(split))
    print(json.dumps(held), flush=True)
finally:
    for p in procs:
        p.kill()
    os._exit(0)
"""


def _held(model, n_ctx: int, split: list[float], cache: str) -> list[list[int]]:
    out = subprocess.run([sys.executable, "-c", _LOAD, str(model), str(n_ctx), ",".join(map(str, split)), cache],
                         capture_output=True, text=True, timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.startswith("[")]
    assert lines, f"the tensor-mode load printed nothing (rc {out.returncode}): {out.stderr[-2000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("which,n_ctx,split,cache", [
    pytest.param("smollm2", 2048, [2, 1], "q8_0", id="smollm2-2-1-q8_0"),
    pytest.param("smollm2", 2048, [770, 230], "q4_0", id="smollm2-770-230-q4_0"),
    pytest.param("smollm3", 4096, [3, 1], "f16", id="smollm3-upstream-3-1-f16"),
    pytest.param("glm4", 4096, [5, 3, 2], "q8_0", id="glm4-upstream-5-3-2-q8_0"),
])
def test_each_cards_weights_and_kv_are_what_llama_cpp_allocates(which, n_ctx, split, cache, smollm2):
    """The cut of every tensor (axes, granularity, the per-layer rotation, mirrored tensors) and of the KV heads
    equals, to the byte, a buffer each worker holds; the compute buffer the plan puts on each card is no smaller
    than the one the worker holds. SmolLM2 (9 heads, 3 KV heads of 64: a KV head does not split 2:1) and a
    SmolLM3 and a GLM-4 checkpoint converted by llama.cpp's own converter (untied output, 2 KV heads of 32; GLM-4's
    gate and up in one tensor and q/k/v biases, on three cards)."""
    model = smollm2 if which == "smollm2" else upstream_models.build(which)
    g = read_model(model)
    info = model_info(g)
    cb = TensorSplit(g, info, len(split), cache, cache).at(split)
    layers = range(info.n_layer)
    weights = cb.card_weights(layers, True)
    kv = cb.card_kv(layers, lambda il: kv_cells(info, n_ctx, 512, il))
    held = _held(model, n_ctx, split, cache)
    assert len(held) == len(split)
    plan = ctxq.plan(model, n_ctx, simulate=",".join("4" for _ in split), split_mode="tensor", kv=cache,
                     split=",".join(map(str, split)))
    for j, bufs in enumerate(held):
        assert weights[j] in bufs, (j, weights[j] / MiB, [b / MiB for b in bufs])
        assert kv[j] in bufs, (j, kv[j] / MiB, [b / MiB for b in bufs])
        assert plan.gpus[j].weights == weights[j] and plan.gpus[j].kv == kv[j]
        compute = max(b for b in bufs if b not in (weights[j], kv[j]))
        assert compute <= plan.gpus[j].compute <= compute * 1.05 + 4 * MiB, (compute / MiB, plan.gpus[j].compute / MiB)
    if split[0] != split[1]:  # an uneven split is not proportional arithmetic: KV heads move whole
        assert kv[0] != kv[1]
    if len(split) == 3:  # 5:3:2 over 2 KV heads: the rotation gives the last card more than the middle one
        assert kv[2] > kv[1]


def test_searched_plan_holds_on_every_card_and_loads_as_planned(smollm2):
    """Uneven simulated cards: the proportions are searched, each card's total fits its memory, llama.cpp gets
    them as integers out of 1000 with -sm tensor, and the plan's largest card matches llama.cpp's Meta() figure."""
    p = ctxq.plan(smollm2, 8192, simulate="0.3,0.2", split_mode="tensor", kv="q8_0")
    assert p.split_mode == "tensor" and p.n_gpu_layers == p.n_layer + 1
    assert sum(p.tensor_split) == 1000 and p.tensor_split[0] > p.tensor_split[1] > 0
    for g in p.gpus:
        assert g.total <= g.device.usable, (g.device.name, g.total / MiB, g.device.usable / MiB)
        assert g.layers == p.gpus[0].layers
    assert p.gpus[0].compute == p.gpus[1].compute  # the meta device's compute buffer is whole on each card
    assert "-sm tensor -ts " + ",".join(map(str, p.tensor_split)) in p.llama_flags()
    kw = p.llama_kwargs()
    assert kw["split_mode"] == 3 and kw["tensor_split"] == [float(x) for x in p.tensor_split]
    held = _held(smollm2, 8192, p.tensor_split, "q8_0")
    for g, bufs in zip(p.gpus, held):
        assert g.weights in bufs and g.kv in bufs


def test_cards_too_small_for_every_layer_leave_the_first_layers_on_the_cpu(smollm2):
    p = ctxq.plan(smollm2, 8192, simulate="0.22,0.2", split_mode="tensor", kv="q8_0")
    assert 0 < p.n_gpu_layers < p.n_layer + 1
    assert p.host.layers == list(range(p.n_layer + 1 - p.n_gpu_layers))
    assert all(g.total <= g.device.usable for g in p.gpus)


def test_run_in_tensor_mode_gives_layer_modes_greedy_answer(smollm2):
    def answer(*extra):
        out = run_ctxq("run", str(smollm2), "-p", "The capital of France is", "-n", "12", "--temp", "0", "--ctx",
                       "2048", "--simulate", "0.3,0.2", *extra)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout, out.stderr

    tensor, log = answer("-sm", "tensor")
    layer, _ = answer()
    assert "-sm tensor -ts " in log
    assert tensor.strip() and tensor == layer


@pytest.mark.parametrize("args,expect", [
    (["-sm", "tensor", "-fa", "off", "--simulate", "0.3,0.2"], "tensor mode needs flash attention"),
    (["-sm", "tensor", "--cpu-memory", "8"], "tensor mode splits layers across GPUs or RPC workers"),
    (["-sm", "tensor", "--simulate", "0.3,0.2", "-ts", "1,0,3"], "give 2 proportions"),
    (["-sm", "sideways", "--simulate", "0.3,0.2"], "'sideways' is not one of 'layer', 'tensor', 'auto'"),
])
def test_what_tensor_mode_cannot_do_is_one_line(args, expect, smollm2):
    out = run_ctxq("plan", str(smollm2), "--ctx", "4096", *args)
    assert out.returncode != 0
    assert expect in out.stderr and "Traceback" not in out.stderr


def test_architectures_llama_cpp_refuses_are_refused_with_its_reason(smollm2):
    info = model_info(read_model(smollm2))
    assert "LLAMA_SPLIT_MODE_TENSOR not implemented" in not_planned("deepseek2", info)
    assert "split_mode=layer" in not_planned("deepseek4", info)  # runs in llama.cpp by rules ctxq does not copy
    assert not_planned("qwen35", info) is None  # the hybrids: tests/test_tensor_hybrids.py
    assert not_planned("llama", info) is None
    with pytest.raises(InvalidOption, match="choose layer, tensor or auto"):
        ctxq.plan(smollm2, 4096, simulate="1,1", split_mode="diagonal")


def test_auto_plans_both_modes_and_keeps_layer_mode_until_measured(smollm2):
    p = ctxq.plan(smollm2, 8192, simulate="0.3,0.2", split_mode="auto", kv="q8_0")
    assert p.split_mode == "layer"
    assert p.speed["layer"]["estimate"] is True and p.speed["tensor"] is not None
    assert sum(p.speed["tensor_split"]) == 1000
    assert any(n.startswith("split mode:") and "-sm tensor -ts" in n for n in p.notes)


# --- tensor mode over some of the cards (planning/tensor/subset.py) -------------------------------------------

_WEAK = (("RTX 4090", 2), ("RTX 3060", 1))  # two fast cards and a slow one (conftest.card_profile)


def test_a_weak_card_is_left_out_where_the_estimate_says_so(smollm2, tmp_path):
    """Two fast cards and a slow one: tensor mode over the two fast ones is estimated faster (the slow card's
    share holds back every layer), so the plan gives llama.cpp only those (-dev), says which card is left out
    and why, and --json carries it; the left-out card holds nothing."""
    prof = card_profile(tmp_path / "weak.toml", *_WEAK)
    p = ctxq.plan(smollm2, 8192, profile=str(prof), split_mode="tensor", kv="q8_0")
    assert [g.device.name for g in p.gpus] == ["RTX 4090 #1", "RTX 4090 #2"] and len(p.tensor_split) == 2
    assert p.left_out == [{"device": "RTX 3060", "why": "the slowest by memory bandwidth: 360 against 1008 GB/s"}]
    assert p.device_order == [0, 1] and p.llama_devices == ["CUDA0", "CUDA1"]
    assert "-sm tensor -ts 500,500 -dev CUDA0,CUDA1" in p.llama_flags()
    assert "left out" in p.reason and "estimate" in p.reason
    out = run_ctxq("plan", str(smollm2), "--ctx", "8192", "--profile", str(prof), "-sm", "tensor", "--kv", "q8_0",
                   "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    assert d["left_out"][0]["device"] == "RTX 3060" and "-dev CUDA0,CUDA1" in d["llama_flags"]
    a = ctxq.plan(smollm2, 8192, profile=str(prof), split_mode="auto", kv="q8_0")
    assert a.speed["tensor_left_out"] == p.left_out and any("-dev CUDA0,CUDA1" in n for n in a.notes)


def test_every_card_stays_where_none_is_weaker_or_speed_is_unknown(smollm2, tmp_path):
    prof = card_profile(tmp_path / "even.toml", ("RTX 4090", 3))
    p = ctxq.plan(smollm2, 8192, profile=str(prof), split_mode="tensor", kv="q8_0")
    assert len(p.gpus) == 3 and p.left_out is None and " -dev " not in p.llama_flags()
    p = ctxq.plan(smollm2, 8192, simulate="0.3,0.3,0.2", split_mode="tensor", kv="q8_0")  # no speed facts
    assert len(p.gpus) == 3 and p.left_out is None



def test_the_runner_shows_llama_cpp_only_the_gpus_kept(smollm2, tmp_path, monkeypatch):
    """Three present GPUs, the plan keeping the first two: the runner asks for CUDA_VISIBLE_DEVICES=0,1 (a restart,
    as for a reordering); once applied it goes on."""
    from ctxq.errors import ReorderNeeded
    from ctxq.llama import backend
    from ctxq.runtime import runner

    prof = card_profile(tmp_path / "weak.toml", *_WEAK)
    p = ctxq.plan(smollm2, 8192, profile=str(prof), split_mode="tensor", kv="q8_0")
    gpus = [backend.GgmlDevice(f"CUDA{i}", "", "gpu", 2**34, 2**34) for i in range(3)]
    monkeypatch.setattr(backend, "ggml_devices", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(runner.ORDER_APPLIED, raising=False)
    with pytest.raises(ReorderNeeded) as e:
        runner.prepare_devices(p)
    assert e.value.value == "0,1"
    monkeypatch.setenv(runner.ORDER_APPLIED, "0,1")
    runner.prepare_devices(p)

# Three debug workers (as _LOAD); the plan is made for them with speed facts that make the third one weak, and
# loaded by ctxq's runner, which registers only the cards the plan keeps.
_SUBSET = _LOAD.split("try:\n", 1)[0].replace(
    "model, n_ctx, split, cache = sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3].split(\",\")], "
    "sys.argv[4]", "model, n_ctx, split, cache = sys.argv[1], int(sys.argv[2]), [1, 1, 1], sys.argv[4]") + r"""
try:
    from dataclasses import replace
    import ctxq
    from ctxq.planning.devices import rpc_devices
    from ctxq.runtime.runner import load_plan
    eps = ",".join(f"127.0.0.1:{p}" for p in ports)
    for _ in range(100):
        try:
            devs = rpc_devices(eps)
            break
        except Exception:
            time.sleep(0.2)
    fast = dict(bandwidth=1008e9, flops=165.2e12, link_bandwidth=24e9, link_latency=2e-5)
    devs = [replace(d, **fast) for d in devs[:2]] + [replace(devs[2], **dict(fast, bandwidth=360e9, flops=25.5e12))]
    p = ctxq.plan(model, n_ctx, devices=devs, split_mode="tensor", kv=cache)
    llm, _, _ = load_plan(p, rpc=eps, n_threads=1)
    llm.eval(llm.tokenize(b"Hello world, this is a test"))
    time.sleep(0.3)
    held = held_buffers(logs, len(split))
    cards = [[g.device.endpoint, g.weights, g.kv, g.compute] for g in p.gpus]
    print(json.dumps({"held": held, "ports": ports, "cards": cards, "left_out": p.left_out,
                      "flags": p.llama_flags()}), flush=True)
finally:
    for p in procs:
        p.kill()
    os._exit(0)
"""


def test_a_subset_loads_over_rpc_workers_as_planned(smollm2):
    """A real load: three RPC workers, the third described as slow; the runner registers only the two kept,
    each of which holds exactly the weights and KV the plan gives it (and a compute buffer no larger than
    planned), and the left-out worker holds nothing."""
    out = subprocess.run([sys.executable, "-c", _SUBSET, str(smollm2), "4096", "1,1,1", "q8_0"],
                         capture_output=True, text=True, timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    assert lines, f"the subset load printed nothing (rc {out.returncode}): {out.stderr[-2000:]}"
    r = json.loads(lines[-1])
    assert len(r["cards"]) == 2 and r["left_out"][0]["device"].startswith("RPC2[")
    assert " -dev RPC0,RPC1 " in r["flags"]  # with --rpc naming the three workers in order
    assert r["held"][2] == []  # never registered: llama.cpp allocates nothing there
    for (ep, weights, kv, compute), bufs in zip(r["cards"], r["held"]):
        assert weights in bufs and kv in bufs, (ep, weights / MiB, kv / MiB, [b / MiB for b in bufs])
        assert max(b for b in bufs if b not in (weights, kv)) <= compute
