"""The split referee (ctxq.planning.split_referee): a plan's compute buffers are llama.cpp's dry run of its split,
checked here against real loads of that split on loopback RPC workers."""

from __future__ import annotations

import pytest

from ctxq.planning.devices import Device
from ctxq.planning.planner import plan
from ctxq.rpc import start_workers
from ctxq.testing.accuracy import PRINTED, check_cell
from ctxq.units import GiB, MiB


def _rpc(n: int) -> list[Device]:
    return [Device(name=f"RPC{i}", kind="rpc", total=2 * GiB, usable=2 * GiB) for i in range(n)]


@pytest.mark.parametrize("split,n_ctx,kv,fa,rules_over", [([1, 1], 16384, "f16", True, True),
                                                          ([2, 1, 1], 65536, "q8_0", True, True),
                                                          ([1, 1], 8192, "f16", False, False)])
def test_plan_compute_is_the_real_split(smollm2, monkeypatch, split, n_ctx, kv, fa, rules_over):
    """Every device's and the host's compute in the plan equal llama.cpp's real load of the split (each a printed
    size: within its rounding); with flash attention the rules alone are above it on the output device, without
    they are exact there."""
    with start_workers(len(split)) as w:
        r = check_cell(str(smollm2), n_ctx, kv, split, workers=w, flash_attn=fa, label="smollm2 split referee")
    assert r.layers_match, r.layer_mismatch
    for d in r.devices:
        assert abs(d.planned["compute"] - d.real["compute"]) <= 2 * PRINTED, (d.name, d.planned, d.real)
    monkeypatch.setenv("CTXQ_SPLIT_CHECK", "0")
    rules = plan(str(smollm2), n_ctx, devices=_rpc(len(split)), kv=kv, flash_attn=fa, split=":".join(map(str, split)))
    out = next(d for d in r.devices if d.name == f"RPC{len(split) - 1}")
    over = rules.gpus[-1].compute - out.real["compute"]
    assert over > 1 * MiB if rules_over else abs(over) <= 2 * PRINTED, over / MiB  # what the referee took off


def test_without_gpus_or_when_turned_off_the_rules_stand(smollm2, monkeypatch):
    cpu = plan(str(smollm2), 16384, devices=[])
    monkeypatch.setenv("CTXQ_SPLIT_CHECK", "0")
    assert plan(str(smollm2), 16384, devices=[]).host.compute == cpu.host.compute
    rules = plan(str(smollm2), 16384, devices=_rpc(2), split="1:1")
    monkeypatch.delenv("CTXQ_SPLIT_CHECK")
    checked = plan(str(smollm2), 16384, devices=_rpc(2), split="1:1")
    assert [g.layers for g in checked.gpus] == [g.layers for g in rules.gpus]
    assert checked.gpus[1].compute < rules.gpus[1].compute
