"""Gemma 4 with KV-shared layers (the E2B/E4B layout: per-layer inputs, the last layers reuse the caches of earlier
ones, MLPs twice as wide there), converted by llama.cpp's own converter (upstream_models' gemma4-kvshare: 8 layers,
4 shared). llama.cpp sets n_layer_kv_from_start = n_layer - attention.shared_kv_layers and asserts it is >= 2 when it
makes the cache: ctxq's derived models (fewer layers) kept the source's count and `ctxq plan` died with that assert.
Now they write the shared layers they keep, and the plan is checked against llama.cpp's real allocations."""

from __future__ import annotations

import pytest

from ctxq.gguf.info import model_info
from ctxq.llama.accounting import accounting
from ctxq.planning.memory import compute
from ctxq.planning.derived import LayerFlags, kv_reuse_ok, with_reuse_targets, write_derived
from ctxq.planning.facts import model_facts
from ctxq.rpc import start_workers
from ctxq.testing import upstream_models
from ctxq.testing.accuracy import check_cell

from .conftest import run_ctxq

SLIDING = [True, True, True, False] * 2  # s s s f, then the shared s s s f reading layers 2 and 3


@pytest.fixture(scope="module")
def kvshare():
    return upstream_models.build("gemma4-kvshare")


def test_which_derived_models_llama_cpp_takes():
    """Shared layers come last, after at least two with a cache, and find a cache of their kind where llama.cpp's
    KV-reuse callback looks (the second to last kept cache for a sliding one, the last for a full one)."""
    assert kv_reuse_ok((0, 3, 4, 7), [SLIDING[i] for i in (0, 3, 4, 7)], 4)
    assert not kv_reuse_ok((0, 4), [True, True], 4)  # one cache: n_layer_kv_from_start = 1
    assert not kv_reuse_ok((3, 7, 0), [False, False, True], 4)  # a shared layer before a cached one
    assert not kv_reuse_ok((3, 0, 7), [False, True, False], 4)  # the full shared layer would read a sliding cache
    assert with_reuse_targets((0, 4), SLIDING, 4) == (0, 1, 4)  # sliding stays sliding
    assert with_reuse_targets((0, 7), SLIDING, 4) == (0, 2, 3, 7)  # the source's own targets
    assert with_reuse_targets((0, 3, 4, 7), SLIDING, 4) == (0, 3, 4, 7)


def test_derived_models_keep_the_sharing(kvshare):
    """A derived model of layers 0 3 4 7 loads in llama.cpp with its two shared layers reading layers 0 and 1; one of
    layers 0 and 4 alone is refused before llama.cpp sees it (it would abort)."""
    src = compute.load_source(str(kvshare))
    path = write_derived(src, (0, 3, 4, 7), True, LayerFlags(swa=(True, False, True, False)))
    acc = accounting(path, n_ctx=4096)
    assert acc.n_layer == 4 and acc.reused == {2: 0, 3: 1}
    with pytest.raises(Exception, match="cannot keep its KV sharing"):
        write_derived(src, (0, 4), True, LayerFlags(swa=(True, True)))


def test_compute_peaks_hold_the_shared_layers(kvshare):
    """The mixed peaks' derived models hold a shared layer of each kind (their MLPs are twice as wide), and the
    sliding-only peaks a shared sliding one: above the peaks of the layers with a cache alone (16k, flash attention:
    19.77 and 3.70 MiB, where layers 0 3 and 0 1 peak at 18.65 and 3.64)."""
    src = compute.load_source(str(kvshare))
    args = dict(n_ctx=16384, n_ubatch=512, n_batch=2048)
    info = model_facts(src, model_info(src), **args, flash_attn=True)
    assert [la.k_width == 0 for la in info.layers] == [False] * 4 + [True] * 4
    assert sorted(ils[0] for ils in compute.layer_groups(info).values()) == [0, 3, 4, 7]
    peaks = compute.compute_peaks(src, info, **args, type_k="f16", type_v="f16", flash_attn=True)
    dry = (16384, 512, 2048, "f16", "f16", True)
    cached = compute._dry_run(str(write_derived(src, (0, 3), True, LayerFlags(swa=(True, False)))), *dry)
    sliding = compute._dry_run(str(write_derived(src, (0, 1), True, LayerFlags(swa=(True, True)))), *dry)
    assert peaks.layer_full > cached and peaks.by_kind["sliding"].layer_full > sliding


@pytest.mark.parametrize("gpus", [None, "1,1"])
def test_ctxq_plan_succeeds(kvshare, gpus):
    """The issue's command: it died with GGML_ASSERT(hparams.n_layer_kv_from_start >= 2) and a gdb backtrace."""
    r = run_ctxq("plan", str(kvshare), "--ctx", "32768", *(("--gpus", gpus) if gpus else ()), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "GGML_ASSERT" not in r.stderr + r.stdout and "aborted" not in r.stdout
    assert ("GPU1" in r.stdout) == bool(gpus)


@pytest.mark.slow
@pytest.mark.parametrize("devices,n_ctx,kv,fa", [(None, 32768, "f16", True), ([1, 1], 32768, "f16", True),
                                                 ([2, 1, 1], 16384, "f16", False), ([1, 1], 65536, "q8_0", True)],
                         ids=["cpu-32k", "rpc2-32k", "rpc3-16k-fa-off", "rpc2-64k-q8"])
def test_plan_against_real_loads(kvshare, devices, n_ctx, kv, fa):
    """Each device within the tiny target (3 % / 2 MiB) and none under llama.cpp's real allocations, on the CPU and
    on loopback RPC workers (the split's compute from llama.cpp's dry run of it, the split referee)."""
    if devices:
        with start_workers(len(devices)) as w:
            r = check_cell(str(kvshare), n_ctx, kv, devices, workers=w, flash_attn=fa, label="gemma4-kvshare")
    else:
        r = check_cell(str(kvshare), n_ctx, kv, None, flash_attn=fa, label="gemma4-kvshare")
    assert r.layers_match, r.layer_mismatch
    for d in r.devices:
        assert not d.under and d.ok_tiny, f"{d.name}: planned {d.planned}, llama.cpp {d.real}"


@pytest.mark.slow
def test_rules_count_the_caches_shared_layers_read_across_devices(kvshare, monkeypatch):
    """Without the split referee, the device holding shared layers 5-7 receives the caches of layers 2 and 3 from the
    other device (4 copies of K and V, one per reading layer): the rules were 66.78 MiB under llama.cpp at 32k, now
    0.78 (split.shared_kv_reads)."""
    monkeypatch.setenv("CTXQ_SPLIT_CHECK", "0")
    with start_workers(2) as w:
        r = check_cell(str(kvshare), 32768, "f16", [1, 1], workers=w, flash_attn=True, label="gemma4-kvshare rules")
    out = next(d for d in r.devices if d.name == "RPC1")
    assert abs(out.error) <= 2 * 2**20, (out.planned, out.real)


@pytest.mark.slow
def test_e2b_widths_against_a_real_load():
    """Gemma 4 E2B's widths cut to 8 layers, 4 of them shared (upstream_widths' gemma4-e2b-8l, header only), 32k f16
    on 2 RPC devices: every device equal to llama.cpp's real load to its printed rounding (730.73, 877.67 and
    153.54 MiB), within the real-width target (1 % / 32 MiB) in any case."""
    from ctxq.testing import upstream_widths

    with start_workers(2) as w:
        r = check_cell(str(upstream_widths.build_realistic("gemma4-e2b-8l")), 32768, "f16", [1, 1], workers=w,
                       flash_attn=True, label="gemma4-e2b-8l")
    assert r.layers_match, r.layer_mismatch
    for d in r.devices:
        assert not d.under and d.ok, f"{d.name}: planned {d.planned}, llama.cpp {d.real}"
