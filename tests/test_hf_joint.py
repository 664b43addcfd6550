"""Issue 45: `ctxq plan` of a checkpoint composes the two stages: the mix and the K/V pair `ctxq convert MODEL fit
--ctx N` would choose together on the devices, with their predicted loss, from the header alone."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="random checkpoints need transformers (pip install ctxq[test])")

from ctxq.conversion import hf_joint  # noqa: E402
from ctxq.conversion.hfplan import plan_hf  # noqa: E402
from ctxq.planning import kvpairs  # noqa: E402
from ctxq.planning.options import PlanOptions  # noqa: E402
from ctxq.testing.models import rebuild_smollm2_hf  # noqa: E402
from ctxq.testing.synthetic import GEOMETRIES, write_sparse_hf_checkpoint  # noqa: E402

from .conftest import run_ctxq  # noqa: E402


@pytest.fixture(scope="module")
def hf8b(tmp_path_factory):
    return write_sparse_hf_checkpoint(tmp_path_factory.mktemp("hfjoint") / "hf8b", GEOMETRIES["llama3-8b"],
                                      rebuild_smollm2_hf())


@pytest.mark.slow  # about 25 s alone, 70 s beside other work on 2 cores: the fixed types' plans, then bisections
def test_the_checkpoint_plan_states_the_fitted_mix_pair_and_loss(hf8b):
    out = run_ctxq("plan", str(hf8b), "--ctx", "32768", "--gpus", "6,4", "--json")
    assert out.returncode == 0, out.stderr
    f = json.loads(out.stdout)["fitted"]
    pair = (f["type_k"], f["type_v"])
    assert pair in kvpairs.at_speed(True)  # described cards: CUDA's default build runs f16, q8_0, q4_0 pairs
    assert all(tuple(p.split()[0].rstrip(":").split("/")) in kvpairs.at_speed(True) for p in f["pairs"])
    assert f["total"] == pytest.approx(f["weights_loss"] + f["kv_loss"])
    assert f"{f['type_k']}/{f['type_v']} {f['total']:.4f}" in f["pairs"]  # the least total of those searched
    assert f["kv_loss"] == kvpairs.DEFAULT_KL[pair] and "SmolLM2" in f["basis"]["kv"]
    assert "not measured" in f["basis"]["weights"] and 0 < f["weights_loss"] < 1
    assert 4.0e9 < f["mix_bytes"] < 10 * 2**30  # more than Q4_K_M's 4.9 GB less its cache; less than the cards
    assert f["command"] == f"ctxq convert {hf8b} fit --ctx 32768 --gpus 6,4"


def test_a_context_no_mix_holds_on_the_gpus_is_one_line(hf8b):
    """1 GiB cannot hold the smallest 8B mix: said in one line, with no plan searched; the plan itself is kept."""
    out = run_ctxq("plan", str(hf8b), "--ctx", "65536", "--gpus", "1")
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("fitted")]
    assert len(lines) == 1 and "no mix holds 65,536 tokens with every layer on these GPUs" in lines[0], out.stdout


def test_iq_types_are_recommended_and_marked_as_ctxq_making_the_matrix(hf8b):
    from ctxq.cli.plan import render_hf

    r = plan_hf(hf8b, 4096, gpus="6", types=("IQ2_XS",))
    c = r.candidates[0]
    assert c.needs_imatrix and c.fits and c.recommended  # `ctxq convert … IQ2_XS` makes ctxq's own matrix
    assert "yes (ctxq makes an imatrix)" in render_hf(r) and "needs --imatrix" not in render_hf(r)


def test_the_prior_is_put_in_kl_per_weight_and_the_mix_is_the_same(hf8b):
    from ctxq.conversion.fit import choose, table_for
    from ctxq.conversion.hfplan import header_gguf

    src = header_gguf(hf8b)
    prior = table_for(src, measure=False)
    cal = hf_joint.calibrated(prior, src)
    ratios = {cal.loss[g.name][i] / prior.loss[g.name][i] for g in prior.groups for i in range(len(prior.types))
              if 0 < prior.loss[g.name][i] < float("inf")}
    assert max(ratios) == pytest.approx(min(ratios))  # one factor: PRIOR_TO_KL per weight of the model
    assert hf_joint.PRIOR_TO_KL / min(ratios) == pytest.approx(8.03e9, rel=0.001)  # Llama-3-8B's weights
    size = 5 * 10**9
    a, b = choose(cal, size, src), choose(prior, size, src)
    # a scale: the same least loss (the knapsack may break a tie of equal losses the other way)
    assert a.predicted_loss == pytest.approx(b.predicted_loss * min(ratios), rel=1e-6) and a.size <= size


def test_devices_that_run_every_pair_search_cuda_s_three():
    opts = PlanOptions(simulate="6,4", kv="q8_0", type_v="q4_0")
    assert hf_joint.given_pair(opts) == "q8_0/q4_0"
    assert hf_joint.command("me/model", 8192, opts) == "ctxq convert me/model fit --ctx 8192 --simulate 6,4 --kv q8_0/q4_0"
    assert hf_joint.given_pair(PlanOptions(type_k="q8_0")) == "q8_0/f16"
    assert set(hf_joint.PLAN_PAIRS) == set(kvpairs.at_speed(True))  # CUDA's default build: what a plan searches


@pytest.mark.slow
def test_simulated_cards_search_the_plan_pairs_and_agree_with_the_command_s_search(hf8b):
    """On RPC devices (every pair at speed) the plan searches PLAN_PAIRS; its answer is joint_fit's on them (the
    bound rules change no answer), its mix within the plan's coarser bisection."""
    from ctxq.conversion.fit import table_for
    from ctxq.conversion.hfplan import header_gguf
    from ctxq.conversion.joint import joint_fit

    src = header_gguf(hf8b)
    f = hf_joint.fitted(str(hf8b), src, 16384, PlanOptions(simulate="7,4"))
    assert {tuple(p.split()[0].rstrip(":").split("/")) for p in f.searched} == set(hf_joint.PLAN_PAIRS)
    table = hf_joint.calibrated(table_for(src, measure=False), src)
    rows = [r for p in hf_joint.PLAN_PAIRS
            for r in joint_fit(src, table, 16384, kv="/".join(p), simulate="7,4").rows if r.total is not None]
    best = min(rows, key=lambda r: r.total)
    assert f.pair == best.pair
    assert f.mix_bytes == pytest.approx(best.mix.size, rel=0.012)


@pytest.mark.slow
def test_70b_checkpoint_plan_prints_the_fitted_line_and_its_command(smollm2, hf70b):
    hf = hf70b
    out = run_ctxq("plan", str(hf), "--ctx", "65536", "--gpus", "16,16,16,8,8")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "fitted: a " in text and " holds 65,536 tokens with every layer on the GPUs; predicted mean KL " in text
    assert "(a prior from the header, scaled to KL on SmolLM2's measured fits)" in text
    assert f"make and measure it: ctxq convert {hf} fit --ctx 65536 --gpus 16,16,16,8,8" in text
