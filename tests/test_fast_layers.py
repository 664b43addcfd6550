"""Layer mode for speed (planning/layers/fast.py): where the context fits with memory left over, whole layers move
from slower cards (by memory bandwidth) to faster ones, the decode estimate rises, and every card still holds its
part by the planner's own memory rows. Described cards (profiles), a header-only Llama-3-8B-shaped model."""

from __future__ import annotations

import re

import pytest

from ctxq.gguf.info import model_info
from ctxq.planning.memory.costs import estimate_tps

import ctxq

_CARDS = """
[[device]]
name = "FAST"
memory_gib = {fast_gib}
bandwidth_gbs = {fast_bw}
tflops_f16 = 165.2
link_gbs = 24

[[device]]
name = "SLOW"
memory_gib = 12
bandwidth_gbs = 360
tflops_f16 = 25.5
link_gbs = 24
"""


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    return write_synthetic_gguf(tmp_path_factory.mktemp("fast") / "llama3-8b-Q4_K_M.gguf", GEOMETRIES["llama3-8b"],
                                mix="Q4_K_M")


def _plan(model, tmp_path, fast_gib: int, fast_bw: int, **kw):
    prof = tmp_path / f"cards-{fast_gib}-{fast_bw}.toml"
    prof.write_text(_CARDS.format(fast_gib=fast_gib, fast_bw=fast_bw))
    return ctxq.plan(model, 32768, profile=str(prof), cpu_memory=64 << 30, reorder=False, **kw)


def _moved(p) -> str | None:
    return next((n for n in p.notes if n.startswith("layers moved where they run fastest")), None)


def test_layers_move_to_the_faster_card_while_every_card_holds_its_part(llama8b, tmp_path):
    """An 8 GiB card at 1008 GB/s and a 12 GiB one at 360: the split balanced by memory gives the slow card most
    layers; the faster card takes as many as it still holds, the decode estimate rises, both cards fit."""
    even = _plan(llama8b, tmp_path, 8, 360)  # the same memory, one bandwidth: nothing moves
    assert _moved(even) is None and "layers_moved" not in even.speed
    fast = _plan(llama8b, tmp_path, 8, 1008)
    note = _moved(fast)
    assert note is not None, fast.notes
    assert fast.tensor_split[0] > even.tensor_split[0] and fast.tensor_split[1] < even.tensor_split[1]
    assert sum(fast.tensor_split) == sum(even.tensor_split) and fast.cpu_layers == even.cpu_layers == 0
    before, after = map(float, re.search(r"memory-bandwidth bound ([\d.]+) -> ([\d.]+) tokens/s", note).groups())
    info = model_info(llama8b)
    assert after > before and estimate_tps(fast.gpus, fast.host, info.token_embd_bytes) == pytest.approx(after, rel=1e-3)
    assert fast.est_decode_tps == fast.speed["read"]["decode_tps"]  # the plan's one decode rate: the reading's
    for g in fast.gpus:  # the planner's own rows: weights, KV, compute, CUDA terms and reserve within the card
        assert g.total <= g.device.usable, (g.device.name, g.total / 2**30, g.device.usable / 2**30)
    assert fast.gpus[0].free < even.gpus[0].free  # the memory left over is what the layers took
    assert "layers moved where they run fastest" in fast.reason
    assert f"-ts {fast.tensor_split[0]},{fast.tensor_split[1]} " in fast.llama_flags()


def test_a_split_you_give_is_kept(llama8b, tmp_path):
    p = _plan(llama8b, tmp_path, 8, 1008, split="10,23")
    assert p.tensor_split == [10, 23] and _moved(p) is None


def test_no_move_where_prefill_would_lose_more_than_decode_gains(tmp_path):
    """Five cards of 288 and 272 GB/s (profiles/3x16-2x8.toml), a Llama-3-70B-shaped model at 32k, q8_0: moving
    the 8 GB cards' layers to the 16 GB ones raises the decode estimate, but the pipeline then overlaps the prefill
    over fewer cards, and a 32k prompt loses more than 128 generated tokens gain: the split stays. A long answer
    after a short prompt takes the move."""
    from pathlib import Path

    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    src = write_synthetic_gguf(tmp_path / "llama3-70b-Q4_K_M.gguf", GEOMETRIES["llama3-70b"], mix="Q4_K_M")
    prof = str(Path(__file__).resolve().parents[1] / "profiles" / "3x16-2x8.toml")
    long_prompt = ctxq.plan(src, 32768, profile=prof, cpu_memory=64 << 30, kv="q8_0")
    assert _moved(long_prompt) is None and long_prompt.cpu_layers == 0
    chat = ctxq.plan(src, 32768, profile=prof, cpu_memory=64 << 30, kv="q8_0", prompt_tokens=64, gen_tokens=4000)
    note = _moved(chat)
    assert note is not None and "prefill included" in note
    assert sum(chat.tensor_split[3:]) < sum(long_prompt.tensor_split[3:])  # off the 272 GB/s cards
    assert all(g.total <= g.device.usable for g in chat.gpus)
