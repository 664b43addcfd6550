"""The plan chooses its K/V pair by measured loss: a measurement that ranks the pairs differently changes the
choice on the same devices, --max-kl holds or is refused in one line, and the plan says what its pair costs.

The policy tests write measurement records in the format `ctxq quality` keeps (planning.quality_store.Result), with losses
chosen so the ranking differs from ctxq's default table: the planner's side of the contract. tests/test_quality.py
checks the measurements themselves against a full-vocabulary computation."""

from __future__ import annotations

import importlib.metadata as md
import json
from dataclasses import asdict

import pytest

from ctxq.errors import DoesNotFit, InvalidOption
from ctxq.planning import kvpairs
from ctxq.planning.planner import plan
from ctxq.planning import quality_store as store

from .conftest import run_ctxq

N_CTX = 65536
TIGHT = "0.6,0.6"  # two simulated 0.6 GiB devices: SmolLM2's f16 and q8_0 caches need the CPU, 4.5-bit ones do not


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """llama.cpp's answers for SmolLM2 on these devices (dry runs, accounting), the same for every test here."""
    return tmp_path_factory.mktemp("answers")


@pytest.fixture()
def home(tmp_path, monkeypatch, answers):
    """A home of its own per test (its measurement records), sharing the module's cached dry-run answers: each test
    planned them afresh on the same model and devices (issue 64)."""
    h = tmp_path / "home"
    h.mkdir()
    for folder in ("accounting", "compute", "derived", "split"):
        (answers / folder).mkdir(exist_ok=True)
        (h / folder).symlink_to(answers / folder, target_is_directory=True)
    monkeypatch.setenv("CTXQ_HOME", str(h))
    return h


def _record(model, pairs: dict, n_ctx: int = N_CTX, text: str = "contract.txt"):
    """Measurement records of `model` as `ctxq quality` writes them, one per pair: {"q4_0/q4_0": mean KL}."""
    folder = store.cache_dir() / "results"
    folder.mkdir(parents=True, exist_ok=True)
    for name, kl in pairs.items():
        k, v = name.split("/")
        r = store.Result(model=str(model), type_k=k, type_v=v, mean_kl=kl, p99_kl=kl * 8, top1_agreement=1 - kl,
                         ppl=10.0, bytes=0, n_ctx=n_ctx, n_scored=n_ctx // 2, text=text, text_sha256="0" * 64,
                         reference="f16/f16 cache", llama_cpp=md.version("llama_cpp_python"),
                         model_id=store.file_id(str(model)))
        (folder / f"{k}-{v}.json").write_text(json.dumps(asdict(r)))


def _fits(model, kv):
    """Every weight and every layer's cache on the devices: neither whole layers nor FFN weights on the host (a
    pair that fits only by spilling FFN weights never replaces a smaller cache that fits: planning/spill/placement.py)."""
    p = plan(model, N_CTX, simulate=TIGHT, kv=kv)
    return p.cpu_layers == 0 and not p.cpu_ffn_layers


def test_default_order_takes_the_least_lossy_pair_that_fits(smollm2, home):
    """No measurement: prefer=speed takes the first pair of ctxq's default table (kvpairs.DEFAULT_KL) that holds
    every layer and weight on the devices; the default (prefer=quality) holds q8_0/q8_0's floor, the room from
    FFN weights in host memory (issue 61), never whole layers."""
    p = plan(smollm2, N_CTX, simulate=TIGHT, prefer="speed")
    order = kvpairs.ranked(kvpairs.at_speed(False), {})
    expected = next(c for c in order if _fits(smollm2, f"{c.type_k}/{c.type_v}"))
    assert (p.type_k, p.type_v) == expected.pair and p.cpu_layers == 0
    floor = plan(smollm2, N_CTX, simulate=TIGHT)
    assert (floor.type_k, floor.type_v) == ("q8_0", "q8_0") and floor.cpu_layers == 0 and floor.cpu_ffn_layers
    assert floor.host.kv == 0 and expected.pair != ("q8_0", "q8_0")
    assert not _fits(smollm2, "q8_0")  # the old ladder's q8_0 needs the CPU here: the choice is a new pair
    assert p.kv_quality["measured"] is False
    assert f"ctxq quality {smollm2} --ctx {N_CTX}" in kvpairs.describe(p.kv_quality, p.model, p.n_ctx)


def test_a_measurement_changes_the_choice(smollm2, home):
    assert _fits(smollm2, "q4_0") and _fits(smollm2, "iq4_nl")
    _record(smollm2, {"q8_0/q8_0": 0.004, "q4_0/q4_0": 0.010, "iq4_nl/iq4_nl": 0.050})
    a = plan(smollm2, N_CTX, simulate=TIGHT, max_kl=0.02)  # the floor where the user puts it
    assert (a.type_k, a.type_v) == ("q4_0", "q4_0")
    assert kvpairs.describe(a.kv_quality, a.model, a.n_ctx) == (
        "KV q4_0/q4_0: mean KL 0.0100, top-1 99.0 % vs f16, measured on contract.txt at 65,536 tokens")
    _record(smollm2, {"q4_0/q4_0": 0.050, "iq4_nl/iq4_nl": 0.010})  # a model whose keys suffer at q4_0
    b = plan(smollm2, N_CTX, simulate=TIGHT, max_kl=0.02)
    assert (b.type_k, b.type_v) == ("iq4_nl", "iq4_nl") and b.kv_quality["mean_kl"] == 0.010
    # the same measurement of another file (or the file changed since) is not this model's
    smollm2_copy = home / "copy.gguf"
    smollm2_copy.write_bytes(smollm2.read_bytes())
    assert plan(smollm2_copy, N_CTX, simulate=TIGHT).kv_quality["measured"] is False


def test_max_kl_holds_moves_layers_or_refuses(smollm2, home):
    with pytest.raises(InvalidOption, match="run `ctxq quality"):
        plan(smollm2, N_CTX, simulate=TIGHT, max_kl=0.02)  # nothing measured to hold it to
    _record(smollm2, {"q8_0/q8_0": 0.004, "iq4_nl/iq4_nl": 0.010, "q4_0/q4_0": 0.050})
    p = plan(smollm2, N_CTX, simulate=TIGHT, max_kl=0.02)
    assert (p.type_k, p.type_v) == ("iq4_nl", "iq4_nl") and p.cpu_layers == 0
    held = plan(smollm2, N_CTX, simulate=TIGHT, max_kl=0.005)  # only q8_0 or better: FFN weights go to the host,
    # every layer's cache stays on the devices (planning/spill/placement.py); offload=layers moves whole layers instead
    assert (held.type_k, held.type_v) == ("q8_0", "q8_0") and held.cpu_layers == 0 and held.cpu_ffn_layers
    assert held.host.kv == 0
    layers = plan(smollm2, N_CTX, simulate=TIGHT, max_kl=0.005, offload="layers")
    assert (layers.type_k, layers.type_v) == ("q8_0", "q8_0") and layers.cpu_layers > 0 and layers.host.kv > 0
    with pytest.raises(DoesNotFit, match=r"the least measured loss that fits is q8_0/q8_0, mean KL 0\.004") as e:
        plan(smollm2, N_CTX, simulate=TIGHT, max_kl=0.0, cpu_memory=int(1.5 * 2**30))  # f16 needs 1.74 GiB of host
    assert e.value.option == "max_kl"
    with pytest.raises(InvalidOption, match=r"KV q4_0/q4_0 loses mean KL 0\.05 \(measured\), more than max_kl=0\.02"):
        plan(smollm2, N_CTX, simulate=TIGHT, kv="q4_0", max_kl=0.02)  # the pair given loses more than allowed


def test_cli_prints_the_cost_and_refuses_in_one_line(smollm2, home):
    _record(smollm2, {"q8_0/q8_0": 0.004, "iq4_nl/iq4_nl": 0.010})
    env = {"CTXQ_HOME": str(home)}
    r = run_ctxq("plan", str(smollm2), "--ctx", str(N_CTX), "--simulate", TIGHT, "--max-kl", "0.02", env=env)
    assert r.returncode == 0, r.stderr
    assert "quality: KV iq4_nl/iq4_nl: mean KL 0.0100" in r.stdout and "-ctk iq4_nl -ctv iq4_nl" in r.stdout
    j = json.loads(run_ctxq("plan", str(smollm2), "--ctx", str(N_CTX), "--simulate", TIGHT, "--max-kl", "0.02",
                            "--json", env=env).stdout)
    assert j["kv_quality"]["mean_kl"] == 0.010 and j["type_k"] == "iq4_nl"
    bad = run_ctxq("plan", str(smollm2), "--ctx", str(N_CTX), "--kv", "q8_0/q3_K", env=env)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "--kv" in bad.stderr
    no = run_ctxq("plan", str(smollm2), "--ctx", str(N_CTX), "--simulate", TIGHT, "--max-kl", "0",
                  "--cpu-memory", "1.5", env=env)
    assert no.returncode == 1 and no.stderr.startswith("Error: ") and "--max-kl 0.004" in no.stderr, no.stderr
