"""The speed estimate (planning/speed/model.py) and the device facts it reads (planning/devices.py).

The published rows: llama.cpp PR 19378 (4x RTX 4090, PCIe 4.0 x16, no NVLink), tensor against layer mode on the
same cards, measured with the meta backend's generic all-reduce (the PR: NCCL "not yet implemented").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ctxq.errors import InvalidOption
from ctxq.gguf.info import model_info
from ctxq.llama import doctor
from ctxq.planning.speed import model as speed
from ctxq.planning import devices
from ctxq.planning.devices import KNOWN_CARDS, Device, card_facts, gpu_speed_facts, load_profile, parse_gpus
from ctxq.planning.memory.costs import estimate_tps
from ctxq.planning.planner import plan
from ctxq.planning.speed.model import LayerShape, ModelShape, Placement, Share, Workload, estimate
from ctxq.testing.hybrid import GPT_OSS_120B, write_gpt_oss_released
from ctxq.testing.synthetic import GEOMETRIES, Geometry, write_synthetic_gguf

GiB = 1024**3

# Llama-3.2-1B's config.json: 16 layers, hidden 2048, 32 heads / 8 KV of 64, FFN 8192, tied embeddings.
LLAMA_32_1B = Geometry("Llama-3.2-1B", "llama", 16, 2048, 32, 8, 64, 8192, 128256, 131072, tied=True)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed_models")
    oss = model_info(write_gpt_oss_released(d / "gpt-oss-120b.gguf", GPT_OSS_120B))
    assert round(oss.file_size / GiB, 2) == 59.02  # the published file's size: the shape is that model's
    return {"gpt-oss-120b": speed.model_shape(oss),
            "llama-3.2-1b": speed.model_shape(model_info(write_synthetic_gguf(d / "l1b.gguf", LLAMA_32_1B)))}


def card(name: str, i: int = 0, **kw) -> Device:
    """A present card as detect_gpus makes it: the known-card table, PCIe 4.0 x16 without peer-to-peer."""
    nvml = doctor.NvidiaGpu(i, name, 24 * GiB, 24 * GiB, pcie_gen=4, pcie_width=16, p2p=False)
    return Device(f"{name} #{i}", "gpu", 24 * GiB, 24 * GiB, **{**gpu_speed_facts(name, nvml), **kw})


def layer_mode(cards, n_layer) -> Placement:
    """llama.cpp's even split: whole layers per card in order, the output head on the last."""
    out, start = [], 0
    for i, c in enumerate(cards):
        k = n_layer // len(cards) + (i < n_layer % len(cards))
        out.append(Share(c, tuple(range(start, start + k)), output=i == len(cards) - 1))
        start += k
    return Placement("layer", tuple(out))


def tensor_mode(cards, n_layer, split=None) -> Placement:
    split = split or [1] * len(cards)
    return Placement("tensor", tuple(Share(c, tuple(range(n_layer)), s / sum(split), output=True)
                                     for c, s in zip(cards, split)))


# --- the published rows ---------------------------------------------------------------------------

# (model, test, published tensor/layer ratio): llama.cpp PR 19378's 4x RTX 4090 rows
PR_19378 = [("gpt-oss-120b", "pp512", 1.42), ("gpt-oss-120b", "tg128@d65536", 1.25), ("llama-3.2-1b", "pp512", 0.42)]


@pytest.mark.parametrize("model,test,published", PR_19378)
def test_tensor_against_layer_mode_matches_pr_19378_within_30_percent(shapes, model, test, published):
    shape = shapes[model]
    cards = [card("NVIDIA GeForce RTX 4090", i) for i in range(4)]
    w = Workload(512) if test == "pp512" else Workload(1, 128, depth=65536)
    lay = estimate(shape, layer_mode(cards, len(shape.layers)), w)
    ten = estimate(shape, tensor_mode(cards, len(shape.layers)), w)
    ratio = ten.prefill_tps / lay.prefill_tps if test == "pp512" else ten.decode_tps / lay.decode_tps
    assert abs(ratio / published - 1) <= 0.30, f"{model} {test}: estimated {ratio:.2f}, published {published}"
    assert lay.pipeline and not ten.pipeline and "estimate" in lay.basis and "estimate" in ten.basis


def test_the_all_reduce_follows_the_meta_backends_steps():
    # ggml-backend-meta.cpp's allreduce_fallback: log2 of the largest power of two <= n exchange steps, plus a
    # fold-in and a copy-back step for the rest; each step moves the whole f32 tensor, its copies issued card by card
    for n, steps in ((1, 0), (2, 1), (3, 3), (4, 2), (5, 4), (8, 3)):
        step = 1e-5 + n * speed.CUDA_CALL_S + 1000 * 4 / 24e9
        assert speed.allreduce_s(1000, n, 24e9, 1e-5) == pytest.approx(steps * step)
    # NCCL reduces bf16 above 262,144 elements on 4 cards: half the bytes of f32 just below that
    big = speed.allreduce_s(262144, 4, 24e9, 0, "nccl")
    assert big == pytest.approx(speed.allreduce_s(262143, 4, 24e9, 0, "nccl") / 2, rel=1e-4)


# --- properties -----------------------------------------------------------------------------------

def test_layer_mode_decode_is_never_faster_than_the_fastest_card_alone(shapes):
    shape = shapes["gpt-oss-120b"]
    cards = [card("NVIDIA GeForce RTX 4090"), card("NVIDIA GeForce RTX 4060 Ti", 1), card("NVIDIA GeForce RTX 3060", 2)]
    w = Workload(4096, 128)
    alone = estimate(shape, layer_mode(cards[:1], len(shape.layers)), w)
    for order in (cards, cards[::-1]):
        split = estimate(shape, layer_mode(order, len(shape.layers)), w)
        assert split.decode_tps < alone.decode_tps
    # and an even split over equal cards decodes no faster than one of them (the cards wait for each other)
    four = estimate(shape, layer_mode([card("NVIDIA GeForce RTX 4090", i) for i in range(4)], 36), w)
    assert four.decode_tps <= alone.decode_tps


def test_a_much_weaker_card_slows_tensor_mode(shapes):
    # ik_llama.cpp issue 1069: 2x RTX 3090 + an RTX A4000, split by memory (24:24:16), slower than the two 3090s
    shape = shapes["gpt-oss-120b"]
    two = [card("NVIDIA GeForce RTX 3090", i) for i in range(2)]
    three = [*two, card("NVIDIA RTX A4000", 2, link_latency=devices.LINK_LATENCY_NO_P2P)]
    w = Workload(8192, 128)
    a = estimate(shape, tensor_mode(two, 36), w)
    b = estimate(shape, tensor_mode(three, 36, [24, 24, 16]), w)
    assert b.decode_tps < a.decode_tps and b.prefill_s > a.prefill_s


def test_pipeline_parallelism_overlaps_the_micro_batches_of_one_batch():
    # 8 equal layers on 4 equal cards: one n_batch of 4 micro-batches takes 4 + 3 stage times, not 16
    shape = ModelShape(4096, tuple(LayerShape(mixer_params=10**9, mixer_bytes=10**8) for _ in range(8)))
    cards = [card("NVIDIA GeForce RTX 4090", i) for i in range(4)]
    pipelined = estimate(shape, layer_mode(cards, 8), Workload(2048, n_batch=2048, n_ubatch=512))
    one_by_one = estimate(shape, layer_mode(cards, 8), Workload(2048, n_batch=512, n_ubatch=512))
    assert pipelined.pipeline and one_by_one.pipeline
    assert one_by_one.prefill_s / pipelined.prefill_s == pytest.approx(16 / 7, rel=0.05)
    # the output head in CPU memory (-ngl n_layer) turns it off: llama_context needs every layer offloaded
    host = Share(Device("CPU", "cpu", 64 * GiB, 64 * GiB, 30e9, flops=1e12), output=True)
    off = estimate(shape, Placement("layer", layer_mode(cards, 8).cards, host), Workload(2048))
    assert not off.pipeline and off.prefill_s > 2 * pipelined.prefill_s


def test_experts_in_cpu_memory_cross_the_link_in_prefill(shapes):
    # with 32+ tokens llama.cpp copies expert weights kept in CPU memory to the card (op offload): every expert
    shape = shapes["gpt-oss-120b"]
    gpu = card("NVIDIA GeForce RTX 4090")
    cpu = Device("CPU", "cpu", 128 * GiB, 128 * GiB, 60e9, flops=1e12)
    gpus_only = Placement("layer", (Share(gpu, tuple(range(36)), output=True),))
    cpu_moe = Placement("layer", (Share(gpu, tuple(range(36)), expert_layers=(), output=True),),
                        Share(cpu, expert_layers=tuple(range(36))))
    w = Workload(2048)
    a, b = estimate(shape, gpus_only, w), estimate(shape, cpu_moe, w)
    experts = sum(la.expert_bytes for la in shape.layers)
    assert b.prefill_s >= 4 * experts / gpu.link_bandwidth > 10 * a.prefill_s  # 4 micro-batches of 512
    assert b.decode_tps < a.decode_tps


def test_a_described_card_cannot_be_estimated_but_says_why(shapes):
    shape = shapes["llama-3.2-1b"]
    cards = parse_gpus("16,16")
    lay = estimate(shape, layer_mode(cards, 16), Workload(8192))
    ten = estimate(shape, tensor_mode(cards, 16), Workload(8192))
    assert lay.prefill_s is None and lay.total_s is None and lay.decode_tps > 0  # decode: bandwidth alone
    assert "unknown compute throughput" in lay.missing[0] and "--profile" in lay.missing[0]
    assert "memory-bound" in lay.basis
    assert ten.prefill_s is ten.decode_tps is None and any("unknown link" in m for m in ten.missing)
    choice = speed.choose([lay, ten])
    assert choice.best is None and choice.reason.startswith("cannot compare") and "tflops_f16" in choice.reason


def test_choose_takes_the_least_total_and_says_so(shapes):
    shape = shapes["gpt-oss-120b"]
    cards = [card("NVIDIA GeForce RTX 4090", i) for i in range(4)]
    w = Workload(65536, 512)
    lay, ten = estimate(shape, layer_mode(cards, 36), w), estimate(shape, tensor_mode(cards, 36), w)
    for est in (lay, ten):
        assert est.total_s == pytest.approx(est.prefill_s + 512 / est.decode_tps)
    choice = speed.choose([lay, ten])
    best = min((lay, ten), key=lambda e: e.total_s)
    assert choice.best is best and choice.reason.startswith(f"{best.mode} mode") and "estimates" in choice.reason
    with pytest.raises(InvalidOption) as e:  # llama.cpp's -sm row is not a mode ctxq plans
        estimate(shape, Placement("row", layer_mode(cards, 36).cards), w)
    assert e.value.option == "split_mode"


# --- from a plan ----------------------------------------------------------------------------------

def test_a_plans_placement_agrees_with_its_decode_estimate(tmp_path):
    path = write_synthetic_gguf(tmp_path / "l8b.gguf", GEOMETRIES["llama3-8b"])
    p = plan(str(path), 32768, profile="2x24")
    shape = speed.model_shape(model_info(str(path)), p.type_k, p.type_v)
    lay = estimate(shape, speed.placement_from_plan(p), Workload(32768))
    assert lay.pipeline and lay.prefill_s > 0 and not lay.missing
    # the plan's own bandwidth estimate reads the whole cache at n_ctx: the same bytes at depth 32768
    info = model_info(str(path))
    assert lay.decode_tps == pytest.approx(estimate_tps(p.gpus, p.host, info.token_embd_bytes), rel=0.03)
    p.split_mode, p.tensor_split = "tensor", [3, 1]
    pl = speed.placement_from_plan(p)
    assert [c.fraction for c in pl.cards] == [0.75, 0.25] and all(len(c.layers) == 32 for c in pl.cards)
    assert estimate(shape, pl, Workload(32768)).decode_tps > 0


# --- device facts ---------------------------------------------------------------------------------

def test_known_cards_match_whole_names_only():
    assert card_facts("NVIDIA GeForce RTX 4060 Ti") is KNOWN_CARDS["RTX 4060 TI"]
    assert card_facts("NVIDIA GeForce RTX 4060") is KNOWN_CARDS["RTX 4060"]
    assert card_facts("NVIDIA A100-PCIE-40GB") is KNOWN_CARDS["A100"]
    assert card_facts("NVIDIA A100-SXM4-80GB") is KNOWN_CARDS["A100-SXM4-80GB"]
    assert card_facts("NVIDIA H100 NVL") is KNOWN_CARDS["H100 NVL"]
    assert card_facts("NVIDIA GeForce RTX 4090 D") is None and card_facts("NVIDIA GeForce RTX 3060 Ti") is None


def test_nvml_gives_the_link_and_an_unknown_cards_throughput():
    fake = doctor.NvidiaGpu(0, "NVIDIA Some Future Card", GiB, GiB, pcie_gen=5, pcie_width=8, p2p=True,
                            sm_count=128, sm_clock_hz=2.52e9, compute_capability=(8, 9))
    facts = gpu_speed_facts(fake.name, fake)
    assert facts["link_bandwidth"] == 24e9 and facts["link_latency"] == devices.LINK_LATENCY_P2P
    assert facts["flops"] == pytest.approx(KNOWN_CARDS["RTX 4090"].flops, rel=1e-3)  # 128 SMs at 2.52 GHz
    assert "bandwidth" not in facts  # NVML's memory clocks are not trusted: the default stays
    # NVML's answers as doctor reads them; a query the card does not support leaves its fact None
    handles = {"a": "a", "b": "b"}

    def unsupported(*_):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nvml = SimpleNamespace(
        NVML_NVLINK_MAX_LINKS=4, NVML_FEATURE_ENABLED=1, NVML_P2P_CAPS_INDEX_READ=0, NVML_P2P_STATUS_OK=0,
        NVML_CLOCK_SM=1, nvmlDeviceGetNvLinkState=unsupported, nvmlDeviceGetP2PStatus=lambda a, b, cap: 2,
        nvmlDeviceGetAttributes=lambda h: SimpleNamespace(multiprocessorCount=34),
        nvmlDeviceGetMaxClockInfo=lambda h, clock: 2535, nvmlDeviceGetCudaComputeCapability=lambda h: (8, 9),
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 4, nvmlDeviceGetMaxPcieLinkWidth=unsupported)
    got = doctor.link_facts(nvml, handles["a"], [handles["b"]])
    assert got == dict(pcie_gen=4, pcie_width=None, nvlinks=0, p2p=False, sm_count=34, sm_clock_hz=2535e6,
                       compute_capability=(8, 9))


def test_profiles_describe_speed(tmp_path):
    for name in devices.list_profiles():
        devs, _ = load_profile(name)
        assert all(d.flops and d.link_bandwidth and d.link_latency for d in devs), name
    prof = tmp_path / "box.toml"
    prof.write_text('[[device]]\nmemory_gib = 24\ntflops_f16 = 165.2\nlink_gbs = 24\n\n'
                    '[[device]]\nmemory_gib = 24\nlink_gbs = 50\nlink_latency_us = 12\n')
    a, b = load_profile(str(prof))[0]
    assert (a.flops, a.link_bandwidth, a.link_latency) == (165.2e12, 24e9, devices.LINK_LATENCY_NO_P2P)
    assert (b.flops, b.link_bandwidth, b.link_latency) == (None, 50e9, pytest.approx(12e-6))
    assert parse_gpus("8")[0].flops is None and devices.cpu_device().flops > 0
