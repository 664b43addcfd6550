"""Bad values of run's and plan's flags get one line that names the flag (issue 23, part 4)."""

from __future__ import annotations

import json

import pytest

from ctxq.runtime.runner import run
from ctxq.errors import InvalidOption

from .conftest import run_ctxq


def one_line_error(r) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


def test_n_predict_below_minus_one_is_refused_before_anything_loads(smollm2):
    line = one_line_error(run_ctxq("run", str(smollm2), "-n", "-5", "-p", "hi"))
    assert line == "Error: -n must be 0 or more tokens, or -1 to generate until the context is full; got -5"
    with pytest.raises(InvalidOption) as e:
        run(smollm2, "hi", n_predict=-2, n_ctx=256)
    assert (e.value.option, e.value.value) == ("n_predict", -2)


@pytest.mark.slow  # 248 tokens on the CPU
def test_n_predict_minus_one_generates_until_the_context_is_full(smollm2):
    r = run_ctxq("run", str(smollm2), "-n", "-1", "--ctx", "256", "--temp", "0", "-p", "Count: 1 2 3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # llama.cpp's -n -1: until an end-of-generation token or the last cell of the context
    assert out["stop"] == "eos" or out["n_prompt"] + out["n_generated"] == out["plan"]["n_ctx"]
    assert out["n_generated"] > 200


def test_negative_reserve_is_refused_in_the_flags_unit(smollm2):
    line = one_line_error(run_ctxq("plan", str(smollm2), "--ctx", "4096", "--gpus", "8", "--reserve", "-1"))
    assert line == "Error: --reserve must be 0 GiB or more, got -1 GiB"
    r = run_ctxq("plan", str(smollm2), "--ctx", "4096", "--gpus", "8", "--reserve", "0.5", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["gpus"][0]["margin"] == 512 << 20


def test_a_context_beyond_llama_cpp_s_32_bit_count_is_one_line(smollm2):
    """`ctxq plan --ctx 99999999999` printed llama.cpp's std::bad_alloc (issue 23, part 4)."""
    line = one_line_error(run_ctxq("plan", str(smollm2), "--ctx", "99999999999"))
    assert line == "Error: --ctx 99999999999 is beyond llama.cpp's largest context, 4294967295 tokens (a 32-bit count)"


def test_a_context_whose_kv_cache_exceeds_every_device_and_the_host_is_one_line(smollm2):
    line = one_line_error(run_ctxq("plan", str(smollm2), "--ctx", "4000000000", "--gpus", "8", "--cpu-memory", "16"))
    assert line.startswith("Error: 4000000000 tokens do not fit: their KV cache alone needs ")
    assert line.endswith("the devices and the host have 24.0 GiB: give a smaller --ctx")
