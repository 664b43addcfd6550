"""Choices made by the corrected speed model (issue 61): the micro-batch with weights in host memory, the K/V pair
within the quality floor, one decode rate and the workload a user states.

The 70B case of the issue: Llama-3-70B's geometry at Q4_K_M (scripts/accuracy.py's synthetic GGUF) at 65,536 tokens on
three 12 GB and two 6 GB cards (RTX 3060-class: 360 / 272 GB/s, PCIe 4.0 x16), 64 GiB of host memory.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ctxq.cli.group import cli
from ctxq.planning.planner import plan
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

from .conftest import run_ctxq

GiB = 1024**3
PROFILE = """name = "3x12-2x6"
[[device]]
name = "A 12GB"
memory_gib = 12
bandwidth_gbs = 360
tflops_f16 = 25.5
link_gbs = 24
count = 3
[[device]]
name = "B 6GB"
memory_gib = 6
bandwidth_gbs = 272
tflops_f16 = 22
link_gbs = 24
count = 2
"""
CTX = 65536


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    d = tmp_path_factory.mktemp("speed_choices")
    (d / "3x12-2x6.toml").write_text(PROFILE)
    return str(write_synthetic_gguf(d / "llama3-70b.gguf", GEOMETRIES["llama3-70b"])), str(d / "3x12-2x6.toml")


def _plan(rig, **kw):
    model, profile = rig
    return plan(model, CTX, profile=profile, cpu_memory=64 * GiB, **kw)


def test_a_small_micro_batch_pays_the_copies_it_makes(rig):
    """-ub 512 copies the host FFN 128 times, -ub 4096 16 times: the prefill estimates differ by at least those
    copies' difference at the link's full rate (a copy taken as overlapped or free could not show it)."""
    small, big = _plan(rig, n_ubatch=512, kv="q8_0"), _plan(rig, n_ubatch=4096, n_batch=4096, kv="q8_0")
    assert small.cpu_ffn_layers and big.cpu_ffn_layers
    link = 24e9
    copies = (CTX // 512) * small.host.cpu_ffn_bytes / link - (CTX // 4096) * big.host.cpu_ffn_bytes / link
    assert copies > 30  # seconds: the issue's ~96 s against ~12 s at 24 GB/s, with these plans' own host bytes
    assert small.speed["read"]["prefill_s"] - big.speed["read"]["prefill_s"] >= copies


def test_the_default_plan_is_no_slower_than_the_options_it_names(rig):
    p = _plan(rig)
    read = p.speed["read"]
    total = read["prefill_s"] + read["gen_tokens"] / read["decode_tps"]
    assert p.n_ubatch > 512 and p.speed["ubatch"]["basis"] == "estimated"  # the copies favour a bigger one
    assert all(total <= t + 1e-6 for t in p.speed["ubatch"]["estimated"].values())
    assert read["other"]["placement"] == "layers" and total <= read["other"]["total_s"]
    kv = p.speed["kv"]  # the pairs within the quality floor, timed at the first micro-batch
    assert set(kv) == {"f16/f16", "q8_0/q8_0"} and (p.type_k, p.type_v) == ("q8_0", "q8_0")
    assert kv["q8_0/q8_0"] < kv["f16/f16"] and total <= min(kv.values())
    assert "estimated fastest for the workload" in p.reason and "-ub" in p.reason


def test_one_decode_rate_and_the_stated_workload(rig):
    model, profile = rig
    r = CliRunner().invoke(cli, ["plan", model, "--ctx", str(CTX), "--profile", profile, "--cpu-memory", "64",
                                 "-ub", "2048", "--prompt-tokens", "20000", "--gen-tokens", "64"])
    assert r.exit_code == 0, r.output
    assert r.output.count("tokens/s") == 1 and "reading 20,000 tokens" in r.output and "for 64 tokens" in r.output
    j = json.loads(CliRunner().invoke(cli, ["plan", model, "--ctx", str(CTX), "--profile", profile, "--cpu-memory",
                                            "64", "-ub", "2048", "--prompt-tokens", "20000", "--json"]).output)
    read = j["speed"]["read"]
    assert read["prompt_tokens"] == 20000 and j["est_decode_tps"] == read["decode_tps"]
    full = _plan(rig, n_ubatch=2048).speed["read"]
    assert full["prompt_tokens"] == CTX and full["prefill_s"] > 3 * read["prefill_s"]


def test_a_prompt_longer_than_the_context_is_one_line(rig):
    model, profile = rig
    r = run_ctxq("plan", model, "--ctx", "4096", "--profile", profile, "--prompt-tokens", "5000")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0] == ("Error: --prompt-tokens 5,000 is beyond the context (4,096 tokens): the prompt has to fit "
                        "in it")


def test_no_mmap_pins_whole_host_layers_but_not_overridden_weights(rig):
    """--no-mmap: llama_model_loader keeps the GPU's pinned host buffer type for whole host layers (with mmap it
    swaps in the CPU's), so their copies run at the link; `-ot ...=CPU` names the CPU's own buffer type, pageable
    either way."""
    pinned, mapped = (_plan(rig, offload="layers", n_ubatch=1024, no_mmap=flag) for flag in (True, None))
    assert pinned.cpu_layers > 0 and pinned.llama_kwargs()["use_mmap"] is False and "--no-mmap" in pinned.llama_flags()
    assert mapped.llama_kwargs()["use_mmap"] is True and "--no-mmap" not in mapped.llama_flags()
    assert pinned.speed["read"]["prefill_s"] < 0.98 * mapped.speed["read"]["prefill_s"]
    spilled = [_plan(rig, offload="weights", n_ubatch=1024, no_mmap=flag) for flag in (True, None)]
    assert spilled[0].cpu_ffn_layers and spilled[0].cpu_layers == 0
    assert spilled[0].speed["read"]["prefill_s"] == pytest.approx(spilled[1].speed["read"]["prefill_s"])


def test_a_drafts_cost_curve_follows_the_plans_devices(rig, tmp_path):
    """c(n), what verifying n drafted tokens costs in decode steps (speed.verify_cost), in the plan's JSON: flat on a
    card that holds the whole model (decoding reads the weights once whatever n), so drafts up to 64 tokens pay;
    on the spilled plan a batch of 32+ copies the host FFN to the first card, which its cost carries."""
    small = write_synthetic_gguf(tmp_path / "8b.gguf", GEOMETRIES["llama3-8b"])
    flat = plan(str(small), 32768, gpus="1x24=RTX 4090").speed["read"]["draft_cost"]
    assert flat[1] == 1.0 and flat[16] < 1.05 and flat[64] < 1.5
    p = _plan(rig, n_ubatch=2048)
    cost, read = p.speed["read"]["draft_cost"], p.speed["read"]
    one = 1 / read["decode_tps"]  # a decode step at the prompt's end, as c(1)
    assert p.cpu_ffn_layers and cost[32] * one >= p.host.cpu_ffn_bytes / 24e9  # at least the copies at the link
    assert cost[64] > 1.5


def test_drafts_follow_the_plans_cost_curve(rig, tmp_path):
    """Issue 63 item 4: without a `ctxq bench --spec` measurement, drafts on a plan for GPUs take the plan's own
    c(n): up to 64 tokens where it is flat (one RTX 4090 holding an 8B), the curve dearer from 32 tokens where the
    host weights cross (the spilled 70B); a plan without GPUs keeps the measured CPU default."""
    from ctxq.runtime.drafts import DEFAULT_COST, LONGEST_DRAFT, draft_cap, plan_cost

    small = write_synthetic_gguf(tmp_path / "8b.gguf", GEOMETRIES["llama3-8b"])
    flat, source = plan_cost(plan(str(small), 32768, gpus="1x24=RTX 4090"))
    assert source == "estimated for the plan's GPUs" and draft_cap(flat) == LONGEST_DRAFT
    spilled, _ = plan_cost(_plan(rig, n_ubatch=2048))
    assert spilled[64] > 1.5 > flat[64] - 0.3  # a batch of 64 copies the host FFN in: dearer than a decode step
    cpu = plan(str(small), 4096, devices=[])
    assert plan_cost(cpu) == (None, "default") and draft_cap(DEFAULT_COST) < LONGEST_DRAFT


def test_a_host_the_profile_does_not_describe_is_said_to_be_this_machines(rig, tmp_path):
    """Whole CPU layers and host weights are timed on the host's CPU: without a profile's `[cpu] tflops` that is this
    machine's, and the plan says so; with it, the note goes and the estimate follows the described host."""
    model, profile = rig
    assumed = _plan(rig, n_ubatch=512, kv="q8_0", offload="layers")
    assert assumed.cpu_layers and "this machine's CPU" in assumed.speed["read"]["host_assumed"]
    described = tmp_path / "with-cpu.toml"
    described.write_text(PROFILE + "[cpu]\ntflops = 40\n")
    own = plan(model, CTX, profile=str(described), cpu_memory=64 * GiB, n_ubatch=512, kv="q8_0", offload="layers")
    assert own.cpu_layers == assumed.cpu_layers and "host_assumed" not in own.speed["read"]
    assert own.speed["read"]["decode_tps"] != assumed.speed["read"]["decode_tps"]  # the host's rate is used
