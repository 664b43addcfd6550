"""The split referee: each device's compute buffer checked by llama.cpp's own dry run of the plan's split.

The search costs thousands of splits with ctxq's rules (`compute.py`, `split.py`, `inputs.py`: measured, within 1 %
or 32 MiB, mostly above). The split it chooses is then sized by llama.cpp itself: a metadata-only load of the real
file with the plan's layer counts, cache types and expert overrides over loopback RPC workers
(`ctxq.planning.split_dry`, cached per model file and settings), whose compute buffers, less the norm pins a dry run
loses, are what a real load allocates (docs/planner.md). The plan takes llama.cpp's figures for every device and the
host; where one is above the rules' (a rule under llama.cpp) it says so in one line, and a device they no longer fit
is searched again with that much less room. Unlike the split-independent referee's, a rule under here is not an
error in strict mode: the rules only steer the search, and llama.cpp's figure is the plan's either way (Qwen3-30B-A3B's
widths, 48 layers at 64k on 8 + 8 GiB with the experts of some layers in CPU memory: the first card 4.01 MiB above the
rules, with the dry run equal to real loads on the 4-layer cut of that model in four placements).

A Hub model (`USER/REPO:QUANT`) is refereed as the same file on disk: the dry run loads the file its header was read
from, the download in the Hugging Face cache or else ctxq's header-only copy of each shard (`hub.cache`: the header
bytes, the weights a sparse hole of the file's size, the shards under their own names side by side, as llama.cpp looks
for them). A dry run never reads tensor data (`llama_model::load_tensors` returns before `load_all_data` with
`no_alloc`; `gguf_init_from_file` with no_alloc reads the header only): traced, only glibc's seek to the end reads
the last partial 4 KiB block, zeros from the hole.

Plans with no GPU (the CPU's own dry run is the rules' source already) or on a llama.cpp built without RPC keep the
rules' figures; `CTXQ_SPLIT_CHECK=0` keeps them too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from ..errors import CtxqError
from ..gguf.info import ModelInfo
from ..llama.accounting import PRINT_ROUNDING
from ..units import MiB

log = logging.getLogger(__name__)

_ROUNDING = 2 * PRINT_ROUNDING  # the compute and output buffers are printed apart
_REPLANS = 4  # searches again with less room until no device is over (each pass cuts what the last left over)


def model_file(p, info: ModelInfo) -> Path | None:
    """The file the dry run loads: the plan's model, or for a Hub model the file its header was read from
    (`info.path`: a download in the Hugging Face cache, or the first shard's header-only copy in ctxq's cache)."""
    return next((Path(f) for f in (p.model, info.path) if f and Path(f).is_file()), None)


def applies(p, info: ModelInfo) -> bool:
    return (os.environ.get("CTXQ_SPLIT_CHECK", "1") != "0" and any(g.layers for g in p.gpus)
            and model_file(p, info) is not None)


def measured(p, info: ModelInfo) -> tuple[list[int], int, list[int]] | None:
    """llama.cpp's compute buffers for the plan's split: per GPU in the plan's order, and the host's (with the
    output buffer, as the plan counts it), and what a real load may add to each GPU beyond its dry run: two layer inputs
    where the dry run lost a pin in a plan with weights in host memory (experts or FFN: tensor overrides;
    `_PINNED_EXTRA`). None where it cannot be asked here."""
    from .split_dry import split_compute

    if getattr(p, "split_mode", "layer") == "tensor":
        return _tensor_measured(p, info)
    kw = dict(n_ctx=p.n_ctx, n_gpu_layers=p.n_gpu_layers, tensor_split=[float(c) for c in p.tensor_split],
              type_k=p.type_k, type_v=p.type_v, flash_attn=p.flash_attn, n_ubatch=p.n_ubatch, n_batch=p.n_batch,
              swa_full=p.swa_full, cpu_patterns=tuple(p.tensor_overrides()), **p.context_settings())
    resid = info.n_embd * p.n_ubatch * 4
    try:
        devices, host, lost = split_compute(str(model_file(p, info)), len(p.gpus), resid=resid, **kw)
    except (CtxqError, OSError) as e:  # no RPC in this build, a worker that would not start: the rules' figures stand
        log.info("the split referee could not ask llama.cpp (%s); the rules' figures stand", e)
        return None
    extra = [_PINNED_EXTRA * resid if pin and kw["cpu_patterns"] else 0 for pin in lost]
    return devices, host + p.n_seq_max * info.n_vocab * 4, extra  # memory.host_cost: the host's logits


def _tensor_measured(p, info: ModelInfo) -> tuple[list[int], int] | None:
    """Tensor mode: a metadata-only load prints one Meta() figure and weights and KV as 0 (NOTES-llama-cpp.md), so
    each card's weights and KV come from planning/tensor/split.py (checked against real loads in
    scripts/accuracy.py --tensor). Its compute buffer is sized on the whole tensors and allocated at that size on
    every card: llama.cpp's dry run of one device holding every offloaded layer, plus the all-reduce scratch."""
    from .tensor.mode import allreduce_bytes

    one = replace(p, split_mode="layer", gpus=p.gpus[:1], tensor_split=[p.n_gpu_layers])
    got = measured(one, info)
    if got is None:
        return None
    (card,), host, _ = got
    # + the printed size's rounding: the real buffer is up to 0.005 MiB above it (97.12 printed, 97.125 held)
    n = len(p.gpus)
    return [card + PRINT_ROUNDING + allreduce_bytes(info, n, p.n_ubatch)] * n, host, [0] * n


def _take(p, got: tuple[list[int], int, list[int]]) -> tuple[list[str], dict[str, int]]:
    """Set the plan's compute figures to llama.cpp's (and what a real load adds); the devices where the rules were under
    the dry run, as note parts, and by how many bytes each GPU's total now exceeds the rules' (what a search with the
    rules must leave free on it for this split to fit)."""
    devices, host, extra = got
    under, excess = [], {}
    for dp, c, more in zip([*p.gpus, p.host], [*devices, host], [*extra, 0]):
        if c - dp.compute > _ROUNDING:
            under.append(f"{dp.device.name} +{(c - dp.compute) / MiB:.2f} MiB")
        excess[dp.device.name] = c + more - dp.compute
        dp.compute = c + more
    return under, excess


# In a plan with weights in host memory, a real load's compute buffer on a GPU where the dry run lost a pin
# (split_dry.lost_pins: a layer's first norm, which a real load computes on the layer's GPU and the dry run on the GPU
# before, sending it over as one more split input) differs from the dry run's by where ggml-alloc then places the
# split's tensors, and equals it on every GPU without a lost pin. Measured (scripts/accuracy.py --spill, 16k, RPC
# workers; one layer input n_embd x n_ubatch x 4 = r): SmolLM2 +1.125 MiB = r (layers 16-30, 16's FFN on the host),
# +0 (15-29, 15-24's); Llama-3-8B's widths +8.00 = r (17-32, 17's); Phi-3-mini's -4.61; Llama-4-Scout's, every routed
# expert on the host, +6.01 of r = 10 (layer 3, its shared expert on the card) and +16.00 (layers 2-3, 2's shared
# expert on the host). The referee adds two layer inputs to each such GPU: never under in the cells measured.
_PINNED_EXTRA = 2


def _over(p) -> dict[str, int]:
    return {dp.device.name: dp.total - dp.device.usable for dp in p.gpus if dp.total > dp.device.usable}


def _replanned(replan, devices: list, cut: dict[str, int], info: ModelInfo):
    """(the plan searched again on `devices` less `cut` (bytes by name), with llama.cpp's compute figures, on the
    user's devices; its excess over the rules by device, `_take`), or None where the dry run cannot be asked."""
    q = replan([replace(d, usable=d.usable - cut[d.name]) if d.name in cut else d for d in devices])
    if not applies(q, info) or (got := measured(q, info)) is None:
        return None
    excess = _take(q, got)[1]
    names = {d.name: d for d in devices}
    for dp in q.gpus:  # the user's devices, not the shrunk stand-ins
        dp.device = names.get(dp.device.name, dp.device)
    return q, excess


def _held(p) -> tuple[int, int]:
    """How much a plan keeps off the cards, least first: whole layers on the CPU, then layers' weights in host memory."""
    return p.cpu_layers, len(p.cpu_ffn_layers) + len(p.cpu_expert_layers)


_GIVE_BACK = 3  # halvings of the cut tried after the replans


def _given_back(p, replan, devices: list, cut: dict[str, int], info: ModelInfo):
    """The plan after giving back what the replans cut beyond need. llama.cpp's excess over the rules depends on the
    split (17.5 MiB with every layer of an 8-layer GLM-4 on one card, 1 MiB with one of them on the CPU), so the cut that
    made one split fit can push the next far below its card's room. The cut is halved towards none, a split searched
    at each size and kept where llama.cpp's dry run fits it and it holds more on the cards (`_held`)."""
    lo, hi = 0.0, 1.0
    for _ in range(_GIVE_BACK):
        mid = (lo + hi) / 2
        got = _replanned(replan, devices, {k: int(v * mid) for k, v in cut.items()}, info)
        if got is None:
            break
        q = got[0]
        if _over(q):
            lo = mid
            continue
        hi = mid
        if _held(q) < _held(p):
            q.notes = [*q.notes, *(n for n in p.notes if n not in q.notes)]
            p = q
    return p


def split_refereed(p, info: ModelInfo, devices: list, replan):
    """`p` with llama.cpp's compute figures for its split; `replan(devices)` searches again on devices with less
    room where a device no longer holds its part (a split the user gave is only marked, as before)."""
    if not applies(p, info) or (got := measured(p, info)) is None:
        return p
    under, excess = _take(p, got)
    if under:
        p.notes.append("llama.cpp's dry run of this split needs more compute than ctxq's rules (" + ", ".join(under)
                       + "); the plan takes its figures")
    given = p.reason == "the split you gave"
    cut: dict[str, int] = {}  # what each device has given up so far: a second pass shrinks from the first's room
    for _ in range(_REPLANS):
        over = _over(p)
        if not over or given:
            break
        for name, n in over.items():  # at least what the rules miss on this split, or the search finds it again
            cut[name] = max(cut.get(name, 0) + n, excess.get(name, 0))
        got = _replanned(replan, devices, cut, info)
        if got is None:
            break
        q, excess = got
        q.notes = [*q.notes, *(n for n in p.notes if n not in q.notes)]
        p = q
    if cut and not given and not _over(p):
        p = _given_back(p, replan, devices, cut, info)
    if not given and (over := _over(p)):  # never a plan past its card (issue 56)
        from ..errors import DoesNotFit

        name, n = max(over.items(), key=lambda kv: kv[1])
        raise DoesNotFit(f"after llama.cpp's dry run of the split, {name} would need {n / MiB:.2f} MiB more than it "
                         f"has at {p.n_ctx:,} tokens", "try a smaller KV type (--kv q4_0) or a shorter context",
                         option="n_ctx", value=p.n_ctx)
    if given:
        p.notes = [n for n in p.notes if not n.startswith("does not fit: ")]
        if over := [g for g in p.gpus if g.total > g.device.usable]:
            p.notes.append("does not fit: " + ", ".join(
                f"{g.device.name} needs {g.total / 2**30:.2f} GiB of {g.device.usable / 2**30:.2f}" for g in over))
    return p
