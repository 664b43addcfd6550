"""What llama.cpp's tensor mode loads but aborts on at the first batch, refused by ctxq in one line beforehand.

The meta device (ggml/src/ggml-backend-meta.cpp) works out each graph node's split state from its sources only when
a batch is computed; a load (weights, caches, the reserved compute buffer) never asks, so llama.cpp loads these
setups and then aborts the process at the first batch or the first one-token step. Four rules, each read from the
vendored source and checked against real batches over RPC workers (tests/test_tensor_batch.py, both ways):

- **A layer that reads another layer's KV cache** (Gemma 3n / Gemma 4's KV-shared layers, `memory.split.reused_layer`):
  its queries are cut with its own rotation, the cache it reads with that layer's, and flash attention asserts that
  every source is cut in the same ratio (`split_state.ne[j] * ... == sum * tensor->ne[axis]`, the "ratio is
  consistent" check). Where the rounding remainder lands on a different card for the two layers, it aborts: tiny
  Gemma 4 with shared layers at 2:1 and 1:1:1, not at 1:1 (`shared_kv`). Likewise a recurrent layer's fused input
  whose key and value segments are rounded apart (Qwen3-Next at 2:1 and 5:3:2: `split_segments`).
- **A quantized K cache on layers with one K head** (Gemma 4 E2B, multi-query models): llama.cpp rotates K by a
  Hadamard matrix before quantizing it (llama_kv_cache::build_input_k_rot, `attn_rot_k`: nrot the largest power of
  two from 64 dividing the cache's head size); `llama_mul_mat_hadamard` reshapes K to [nrot, ...], which moves its
  split from the heads (axis 1) to axis 0 where one layer's K is no wider than nrot (handle_reshape), and a matrix
  product of a mirrored matrix with an axis-0 split is not implemented ("unsupported mul_mat split states").
  Likewise V with a quantized V cache (`attn_rot_v`, nrot 64). `rotated_cache`.
- **One K/V head, normalised head by head** (Gemma 4 E2B): at a one-token step the projection keeps its cut on the
  head's rows and a row norm refuses that. `one_kv_head`.
- **The gated delta nets over RPC workers** (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): each worker asserts at the first
  batch that a tensor it is sent lies inside its buffer (ggml-rpc.cpp deserialize_tensor) and aborts; the load
  succeeds. On CUDA cards this is the graph llama.cpp's tensor mode was written for, so ctxq plans it there.
  `over_rpc`.

`loads_only()` switches them off, for scripts that measure what a load allocates without computing a batch
(scripts/tensor_truth.py): there every such setup is planned as it would be where it runs.
"""

from __future__ import annotations

import contextvars
import math
import os
from contextlib import contextmanager

from ...errors import InvalidOption
from ...gguf.info import ModelInfo
from ..memory.split import reused_layer
from .hybrid import QWEN_GATED
from .split import TensorSplit, _Model, _split

UNQUANTIZED = frozenset(("f32", "f16", "bf16"))
_LOADS_ONLY = contextvars.ContextVar("ctxq_tensor_loads_only", default=False)


@contextmanager
def loads_only():
    """Plan tensor mode without the first-batch refusals inside the block (a load measured without a batch)."""
    token = _LOADS_ONLY.set(True)
    try:
        yield
    finally:
        _LOADS_ONLY.reset(token)


def over_rpc(arch: str, devices) -> str | None:
    """Why tensor mode over these devices aborts at the first batch for this architecture, or None."""
    rpc = [d.name for d in devices if getattr(d, "backend", None) == "rpc"]
    if arch in QWEN_GATED and rpc and not _LOADS_ONLY.get():
        return (f"llama.cpp's RPC workers abort at the first batch of a {arch} model in tensor mode (ggml-rpc.cpp "
                f"deserialize_tensor: a tensor outside its buffer; the load itself succeeds): split over "
                f"{', '.join(rpc)} with split_mode=layer")
    return None


def _nrot(head: int) -> int:
    """build_input_k_rot: from 64, doubled while the head size divides by it."""
    n = 64
    while head % (n * 2) == 0:
        n *= 2
    return n


def rotated_cache(info: ModelInfo, head_dims, type_k: str, type_v: str) -> str | None:
    """Why a quantized cache of these types aborts tensor mode at the first batch (the Hadamard rotation of a layer's
    K or V no wider than the rotation), or None. head_dims[il]: layer il's (K, V) head sizes (split._Model)."""
    if _LOADS_ONLY.get() or os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0").strip() not in ("", "0"):
        return None  # llama_kv_cache: LLAMA_ATTN_ROT_DISABLE=1 turns the rotation off
    own = [il for il, la in enumerate(info.layers)
           if la.attention and la.n_head_kv and not la.mtp and reused_layer(info, il) is None]
    for kind, t, idx, fixed_nrot in (("K", type_k, 0, None), ("V", type_v, 1, 64)):
        if t.lower() in UNQUANTIZED or head_dims[0][idx] % 64:
            continue  # attn_rot_* needs a quantized type and hparams.n_embd_head_k() (layer 0's) a multiple of 64
        for sliding in (False, True):  # an iSWA model's two caches, each with its own head size
            layers = [il for il in own if info.layers[il].sliding == sliding]
            heads = {head_dims[il][idx] for il in layers}
            if len(heads) != 1:
                continue  # no layers, or head sizes that differ: no rotation (n_embd_head_*_all = -1)
            nrot = fixed_nrot or _nrot(heads.pop())
            for il in layers:
                n_kv = info.layers[il].n_head_kv
                if head_dims[il][idx] * n_kv <= nrot:
                    return (f"llama.cpp's tensor mode aborts at the first batch with a {t} {kind} cache here: layer "
                            f"{il} has {n_kv} {kind} head(s), no wider than the {nrot}-wide Hadamard rotation "
                            f"llama.cpp applies before quantizing (an unsupported split of the rotated {kind}); use "
                            f"an f16 {kind} cache or split_mode=layer")
    return None


def _cutter(ts: TensorSplit, prop: list[float]):
    """cut(segments, rotation): each card's elements of a tensor so cut, as llama_meta_device_get_split_state gives
    them (split._split per segment, times its repeats)."""
    scans = [ts.model.scan(prop, r) for r in range(ts.n)]

    def cut(segs, rot) -> list[int]:
        per = [0] * ts.n
        for ne_s, nr_s, g_s in segs:
            for j, c in enumerate(_split(ne_s, scans[rot], g_s, ts.n, rot)):
                per[j] += c * nr_s
        return per

    return cut


def _apart(a: list[int], b: list[int]) -> bool:
    """Two cuts in different ratios (the meta device's "ratio is consistent" test)."""
    return any(x * sum(b) != y * sum(a) for x, y in zip(a, b))


def _line(prop, what: str) -> str:
    return (f"llama.cpp's tensor mode aborts at the first batch with proportions {':'.join(f'{x:g}' for x in prop)}: "
            f"{what} (the meta device needs one ratio); use other proportions or split_mode=layer")


def shared_kv(ts: TensorSplit, info: ModelInfo, g, proportions, layers=None) -> str | None:
    """Why these proportions abort tensor mode at the first batch (a KV-shared layer's queries cut in another ratio
    than the cache it reads), or None. `layers`: the offloaded ones (default all); a pair with either on the CPU is
    not cut."""
    if _LOADS_ONLY.get():
        return None
    prop = [float(p) for p in proportions]
    cut = _cutter(ts, prop)
    held = set(range(info.n_layer) if layers is None else layers)
    for il in sorted(held):
        src = reused_layer(info, il)
        if src is None or src not in held or ts.cache[src][0] is None:
            continue
        q = g.tensor(f"blk.{il}.attn_q.weight")
        spec = ts.model.spec(q.name, q.shape, q.type, il) if q is not None else None
        if spec is None:
            continue
        qc = cut(spec[2], spec[3])
        for kind, (_, segs, rot) in zip("KV", ts.cache[src]):
            kc = cut(segs, rot)
            if _apart(qc, kc):
                return _line(prop, f"layer {il} reads layer {src}'s KV cache, and its queries are cut "
                                   f"{':'.join(map(str, qc))} while that {kind} cache is cut {':'.join(map(str, kc))}")
    return None


def split_segments(ts: TensorSplit, info: ModelInfo, proportions, layers=None) -> str | None:
    """Why these proportions abort tensor mode at the first batch (a recurrent layer's fused tensor whose segments are
    cut in different ratios), or None. Qwen3-Next's delta-net input (attn_qkv, ssm_conv1d, the conv state) holds its
    key heads (q and k) and value heads as two segments, each rounded to whole heads on its own
    (get_split_segments); the graph then takes q, k and v apart and pairs each card's key heads with its value heads,
    so the two cuts must keep one ratio (ggml-backend-meta.cpp:1086, `split_state.ne[j] % div == 0`). They do at 1:1
    with whole heads on every card; Qwen3.5 cuts one segment (its V heads interleaved with K's) and never parts."""
    if _LOADS_ONLY.get():
        return None
    prop = [float(p) for p in proportions]
    cut = _cutter(ts, prop)
    held = set(range(info.n_layer) if layers is None else layers)
    for il, _, _, _, segs, rot in ts.specs:
        if il in held and info.layers[il].recurrent and len(segs) > 1:
            cuts = [cut((s,), rot) for s in segs]
            if any(_apart(cuts[0], c) for c in cuts[1:]):
                return _line(prop, f"layer {il}'s recurrent input is cut "
                                   + " and ".join(":".join(map(str, c)) for c in cuts) + " in its segments")
    return None


def at_proportions(ts: TensorSplit, info: ModelInfo, g, proportions, layers=None) -> str | None:
    """`shared_kv`, then `split_segments`."""
    return shared_kv(ts, info, g, proportions, layers) or split_segments(ts, info, proportions, layers)


# Architectures that normalise each V head without a weight tensor (gemma4.cpp: ggml_rms_norm on Vcur)
V_NORMED = frozenset(("gemma4",))


def one_kv_head(info: ModelInfo, g, heads) -> str | None:
    """Why this model's first one-token batch aborts tensor mode, or None: a layer with one K/V head whose heads are
    normalised one by one (a per-head attn_k_norm, or Gemma 4's V norm). With one token and one head, the projection
    [head_dim x 1] reshaped to [head_dim, 1, 1] keeps its cut on axis 0 (handle_reshape: the source's last axis of
    one dimension), and a norm over rows refuses a tensor cut along its rows (handle_per_row:
    `GGML_ASSERT(src_ss[0].axis != GGML_BACKEND_SPLIT_AXIS_0)`). A longer batch takes the other branch and computes;
    so does a model without such a norm (SmolLM3's layout with one KV head, tried)."""
    if _LOADS_ONLY.get():
        return None
    for il, la in enumerate(info.layers):
        if not (la.attention and la.n_head_kv == 1 and not la.mtp and reused_layer(info, il) is None):
            continue
        norm = g.tensor(f"blk.{il}.attn_k_norm.weight")
        if (norm is not None and norm.shape[0] == heads[il][0]) or info.arch in V_NORMED:
            return (f"llama.cpp's tensor mode aborts at the first one-token batch of this model: layer {il} has one "
                    f"K/V head, normalised head by head, which a one-token step cuts along its rows "
                    f"(ggml-backend-meta.cpp handle_per_row); use split_mode=layer")
    return None


def usable_pairs(pairs, info: ModelInfo, g, fixed) -> list:
    """The K/V type pairs tensor mode can run (`rotated_cache`); InvalidOption (one line) for a pair the user fixed,
    or for any (`one_kv_head`)."""
    heads = _Model(g, info, 1).head_dims  # each layer's (K, V) head sizes, read once
    why = one_kv_head(info, g, heads)
    if why:
        raise InvalidOption(why, option="split_mode", value="tensor")
    if fixed:
        why = rotated_cache(info, heads, *fixed)
        if why:
            raise InvalidOption(why, option="type_k", value=fixed[0])
    return [p for p in pairs if rotated_cache(info, heads, *p) is None]


def pair_refused(info: ModelInfo, g, type_k: str, type_v: str) -> str | None:
    """`one_kv_head`, then `rotated_cache` for one pair, from the model's header."""
    heads = _Model(g, info, 1).head_dims
    return one_kv_head(info, g, heads) or rotated_cache(info, heads, type_k, type_v)


def granules(ts: TensorSplit, info: ModelInfo, g, layers) -> int | None:
    """The greatest common number of granules (whole heads) of the cuts `at_proportions` holds together in these
    layers: proportions in whole multiples of 1/that cut every one of them exactly, whatever the rotation."""
    counts = []
    held = set(layers)
    for il in held:
        src = reused_layer(info, il)
        if src is not None and src in held and ts.cache[src][0] is not None:
            q = g.tensor(f"blk.{il}.attn_q.weight")
            spec = ts.model.spec(q.name, q.shape, q.type, il) if q is not None else None
            segs = (spec[2] if spec else ()) + tuple(x for k in ts.cache[src] for x in k[1])
            counts += [ne // gr for ne, _, gr in segs]
    counts += [ne // gr for il, _, _, _, segs, _ in ts.specs
               if il in held and info.layers[il].recurrent and len(segs) > 1 for ne, _, gr in segs]
    return math.gcd(*counts) if counts else None


def _snapped(props, n: int) -> list[int]:
    """`props` as whole numbers summing to n, by largest remainder."""
    total = sum(props)
    raw = [p * n / total for p in props]
    out = [int(x) for x in raw]
    for j in sorted(range(len(raw)), key=lambda j: raw[j] - out[j], reverse=True)[:n - sum(out)]:
        out[j] += 1
    return out


def settled(cards, slots: int, props, plans, even):
    """(slots, proportions, the cards' plans, a note or None) for what the search found: those, where llama.cpp runs
    them; else the nearest proportions in whole heads (`granules`), then `even`, at the most slots (at most `slots`)
    where they run and the cards hold them, with a note; else InvalidOption naming why (`at_proportions`)."""
    why = at_proportions(cards.ts, cards.info, cards.g, props, list(cards.slots_layers(slots)[0]))
    if why is None:
        return slots, props, plans, None
    n = granules(cards.ts, cards.info, cards.g, list(cards.slots_layers(slots)[0]))
    tried = [list(props)]
    for cand, what in ((_snapped(props, n) if n else None, "in whole heads"), (list(even), "equal")):
        if cand is None or cand in tried or not any(cand):
            continue
        tried.append(cand)
        for s in range(slots, 0, -1):  # fewer layers on the cards where these proportions do not hold them all
            if at_proportions(cards.ts, cards.info, cards.g, cand, list(cards.slots_layers(s)[0])) is None:
                got = cards.cards(s, cand)
                if all(dp.total <= dp.device.usable for dp in got):
                    fewer = f", {slots - s} layer slot(s) fewer on the cards" if s < slots else ""
                    return s, cand, got, (f"proportions {':'.join(map(str, cand))} ({what}{fewer}), not "
                                          f"{':'.join(map(str, props))} by speed: "
                                          + why.split(": ", 1)[1].split("; use")[0])
    raise InvalidOption(why, option="split_mode", value="tensor")
