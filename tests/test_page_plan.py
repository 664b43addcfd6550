"""The plan as `ctxq serve`'s page draws it (`ctxq.serve.page_plan`, issue 62), without a browser: every device's
segments add up to its total, a spilled plan's host weights are marked as such, labels are `ctxq plan`'s two
decimals, and `ctxq plan --html`'s file lets only its own two inline blocks run and holds the plan as inert data."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest

from ctxq.planning.planner import plan
from ctxq.serve.page_plan import _json_data, standalone_html, view
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf
from ctxq.units import GiB


@pytest.fixture(scope="module")
def spilled(tmp_path_factory):
    """Llama-3-70B Q4_K_M at 64k on 3x12 + 2x6 GB: FFN weights of some layers in host memory (tests/test_spill.py)."""
    model = write_synthetic_gguf(tmp_path_factory.mktemp("l70") / "llama3-70b-Q4_K_M.gguf", GEOMETRIES["llama3-70b"])
    p = plan(model, 65536, gpus="3x12=RTX 4060 Ti,2x6=RTX 4060", cpu_memory=64 * GiB)
    assert p.cpu_ffn_layers and p.cpu_layers == 0  # the plan these tests are about
    return p


def test_segments_add_up_and_the_spilled_weights_are_marked(spilled):
    v = view(spilled)
    assert [d["name"] for d in v["devices"]] == [d.device.name for d in spilled.devices]
    for d, drawn in zip(spilled.devices, v["devices"]):
        parts = {s["name"]: s["bytes"] for s in drawn["segments"]}
        assert sum(b for k, b in parts.items() if k != "free") == d.total == drawn["total"]
        assert parts.get("free", 0) == max(0, d.free)
        assert drawn["total_gib"] == f"{d.total / GiB:.2f}" and drawn["capacity_gib"] == f"{d.device.usable / GiB:.2f}"
    host = {s["name"]: s["bytes"] for s in v["devices"][-1]["segments"]}
    assert host["spilled weights"] == spilled.host.cpu_ffn_bytes > 0
    assert host["weights"] == spilled.host.weights - spilled.host.cpu_ffn_bytes
    assert not any("spilled weights" in {s["name"] for s in d["segments"]} for d in v["devices"][:-1])
    assert any(n.startswith("weights in host memory") for n in v["notes"])  # the plan's own line for it
    assert v["flags"] == spilled.llama_flags()


def test_the_html_file_runs_only_its_own_blocks(spilled):
    html = standalone_html(spilled)
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert csp.startswith("default-src 'none'")
    for tag, directive in (("style", "style-src"), ("script", "script-src")):
        blocks = re.findall(rf"<{tag}(?: type=\"module\")?>(.*?)</{tag}>", html, re.S)
        assert len(blocks) == 1, tag
        digest = base64.b64encode(hashlib.sha256(blocks[0].encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in csp
    data = re.search(r'<script type="application/json" id="plan-data">(.*?)</script>', html, re.S).group(1)
    assert json.loads(data) == json.loads(json.dumps(view(spilled)))
    hostile = {"name": "</script><script>alert(1)</script>"}
    assert "<" not in _json_data(hostile) and json.loads(_json_data(hostile)) == hostile
