"""How fast a placement runs: prefill seconds of the input and decode tokens/s, estimated from each card's
compute throughput, memory bandwidth and link (docs/planner.md, "Speed: how ctxq estimates it").

Pure arithmetic, no llama.cpp: FLOPs, bytes and seconds inside, figures that are estimates and say so. Per card
and micro-batch each part of a layer takes max(FLOPs / throughput, bytes / bandwidth) (a roofline):
- layer mode (`-sm layer`): the cards hold whole layers and work one after another, an activation copy between
  them; llama.cpp's pipeline parallelism overlaps the micro-batches of one n_batch across the cards where it turns
  it on (every layer offloaded, no tensor overrides; src/llama-context.cpp);
- tensor mode (`-sm tensor`): every card holds its fraction of every layer and works on all of them at once; each
  layer waits for its slowest card, then all-reduces twice (after attention, after the FFN; the meta backend's
  sync points, ggml/src/ggml-backend-meta.cpp).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from ...errors import InvalidOption
from ..devices import Device
from .shape import LayerShape, ModelShape, model_shape  # noqa: F401 (speed.model_shape is the entry point)
from ..options import DEFAULT_N_BATCH, DEFAULT_N_UBATCH

GGML_SCHED_MAX_COPIES = 4  # micro-batches in flight with pipeline parallelism (ggml/src/ggml-backend.cpp)
OP_OFFLOAD_MIN_BATCH = 32  # weights in CPU memory go to the GPU for batches of 32+ tokens (ggml-cuda.cu)
ACT_BYTES = 4  # activations between layers and in the generic all-reduce are f32 (ggml's residual stream)
DEFAULT_GEN_TOKENS = 128  # llama-bench's tg128: the generation figure the published rows use
# NCCL's path reduces f32 below these element counts and bf16 above them, by the number of cards
# (ggml_backend_cuda_comm_allreduce_nccl, ggml-cuda.cu; tuned there on RTX 4090s over PCIe 4.0 x16).
NCCL_F32_BELOW = {2: 32768, 3: 131072, 4: 262144}
ALLREDUCES = ("butterfly", "nccl")


@dataclass(frozen=True)
class Share:
    """What one device computes: `fraction` of each of `layers` (layer mode: 1; tensor mode: its proportion),
    the routed experts of `expert_layers` and the dense FFN of `ffn_layers` (None: those of `layers`) and the
    output head if `output`."""

    device: Device
    layers: tuple[int, ...] = ()
    fraction: float = 1.0
    expert_layers: tuple[int, ...] | None = None
    output: bool = False
    ffn_layers: tuple[int, ...] | None = None

    experts = property(lambda self: self.layers if self.expert_layers is None else self.expert_layers)
    ffns = property(lambda self: self.layers if self.ffn_layers is None else self.ffn_layers)

    @property
    def busy(self) -> bool:
        return bool(self.layers or self.experts or self.ffns or self.output)


@dataclass(frozen=True)
class Placement:
    mode: str  # "layer" or "tensor"
    cards: tuple[Share, ...]  # GPUs and RPC workers in llama.cpp's order (layer mode: the order a token passes)
    host: Share | None = None  # layers, experts or the head left in CPU memory


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    gen_tokens: int = DEFAULT_GEN_TOKENS
    depth: int | None = None  # tokens in the cache while decoding; None: prompt_depth + prompt_tokens
    prompt_depth: int = 0  # tokens already cached before the prompt (llama-bench -d for a pp test)
    n_ubatch: int = DEFAULT_N_UBATCH
    n_batch: int = DEFAULT_N_BATCH

    @property
    def decode_depth(self) -> int:
        return self.prompt_depth + self.prompt_tokens if self.depth is None else self.depth


@dataclass
class SpeedEstimate:
    """An estimate, not a measurement. A figure is None where a device fact is missing (`missing` says which)."""

    mode: str
    prefill_s: float | None
    decode_tps: float | None
    total_s: float | None  # prefill_s + gen_tokens / decode_tps
    basis: str
    workload: Workload
    prefill_links_s: float | None = None  # of prefill_s: copies and all-reduces between the cards
    decode_links_s: float | None = None  # of one decoded token's time: the same
    pipeline: bool = False  # layer mode with llama.cpp's pipeline parallelism
    missing: list[str] = field(default_factory=list)

    @property
    def prefill_tps(self) -> float | None:
        return self.workload.prompt_tokens / self.prefill_s if self.prefill_s else None

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tps": self.prefill_tps, "estimate": True}


class _Unknown(Exception):
    """A fact this figure needs is missing; the message says which and how to give it."""


def allreduce_s(elements: int, n_cards: int, link_bandwidth: float, link_latency: float,
                algorithm: str = "butterfly") -> float:
    """Seconds to all-reduce `elements` f32 values over n_cards. "butterfly": the meta backend's generic
    all-reduce (allreduce_fallback): log2(p) exchange steps of the whole tensor among the largest power of two
    p <= n, plus a fold-in and a copy-back step for the rest. "nccl": a ring (2 (n-1)/n of the bytes per card, bf16
    above NCCL_F32_BELOW) with ceil(log2 n) latencies."""
    if n_cards < 2:
        return 0.0
    if algorithm == "nccl":
        nbytes = elements * (4 if elements < NCCL_F32_BELOW[min(n_cards, 4)] else 2)
        return math.ceil(math.log2(n_cards)) * link_latency + 2 * (n_cards - 1) / n_cards * nbytes / link_bandwidth
    p = 1 << (n_cards.bit_length() - 1)
    steps = p.bit_length() - 1 + (2 if n_cards > p else 0)
    return steps * (link_latency + elements * ACT_BYTES / link_bandwidth)


class _Model:
    """The arithmetic of one placement; `strict` False lets a missing throughput count as memory-bound."""

    def __init__(self, shape: ModelShape, placement: Placement, allreduce: str):
        self.s, self.p, self.allreduce = shape, placement, allreduce
        self.cards = [c for c in placement.cards if c.busy]
        self.host = placement.host if placement.host and placement.host.busy else None
        self.strict = True
        self.assumed: set[str] = set()

    # one part on one device: the roofline
    def roof(self, dev: Device, flops: float, nbytes: float) -> float:
        if not dev.bandwidth:
            raise _Unknown(f"unknown memory bandwidth of {dev.name}: give bandwidth_gbs in a --profile")
        if dev.flops is None:
            if self.strict and flops:
                raise _Unknown(f"unknown compute throughput of {dev.name}: give --profile with tflops_f16 "
                               "(a card described by --gpus or an RPC worker has none)")
            self.assumed.add(dev.name)
            return nbytes / dev.bandwidth
        return max(flops / dev.flops, nbytes / dev.bandwidth)

    def link(self, devs: Sequence[Device], need: bool) -> tuple[float, float] | None:
        """(bandwidth, latency) of the slowest link among devs; None when unknown and not needed."""
        if any(d.link_bandwidth is None or d.link_latency is None for d in devs):
            if need:
                bad = next(d for d in devs if d.link_bandwidth is None or d.link_latency is None)
                raise _Unknown(f"unknown link between the cards ({bad.name}): give link_gbs in a --profile")
            self.assumed.add("links")
            return None
        return min(d.link_bandwidth for d in devs), max(d.link_latency for d in devs)

    def copy_s(self, a: Device, b: Device, nbytes: float) -> float:
        lk = self.link([a, b], need=False)
        return lk[1] + nbytes / lk[0] if lk else 0.0

    # the parts of layer il for T tokens after d0 cached ones, on dev, fraction f of it
    def weights(self, dev: Device, il: int, T: int, f: float, part: str) -> float:
        """The matmuls of the layer's "mixer" (attention or recurrent projections) or "ffn" (dense FFN, router)."""
        la = self.s.layers[il]
        if part == "mixer":
            return self.roof(dev, 2 * la.mixer_params * T * f, (la.mixer_bytes + 2 * la.state_bytes) * f)
        return self.roof(dev, 2 * la.ffn_params * T * f, la.ffn_bytes * f)

    def attention(self, dev: Device, il: int, T: int, d0: int, f: float) -> float:
        la = self.s.layers[il]
        if not la.attn_flops_per_key:
            return 0.0
        keys, cached = d0 + (T + 1) / 2, d0 + T  # a query sees the keys before it; flash attention reads the cache
        if la.window:
            keys, cached = min(keys, la.window), min(cached, la.window + T)
        return self.roof(dev, la.attn_flops_per_key * keys * T * f, la.kv_bytes_per_key * cached * f)

    def experts(self, dev: Device, il: int, T: int, f: float) -> float:
        la = self.s.layers[il]
        if not la.expert_params:
            return 0.0
        touched = 1 - (1 - self.s.used_fraction) ** T  # the experts some token of T routes to (uniform routing)
        return self.roof(dev, 2 * la.expert_params * self.s.used_fraction * T * f, la.expert_bytes * touched * f)

    def streamed(self, il: int, T: int, experts_only: bool, ffn_only: bool = False) -> float:
        """Weights in CPU memory for a batch of 32+ tokens: copied to the first card over its link and
        multiplied there (op offload copies whole tensors, every expert). `ffn_only`: the layer's dense FFN alone."""
        la, gpu = self.s.layers[il], self.cards[0].device
        nbytes = la.ffn_bytes if ffn_only else la.expert_bytes + (0 if experts_only else la.mixer_bytes + la.ffn_bytes)
        flops = 2 * T * (la.ffn_params if ffn_only else la.expert_params * self.s.used_fraction
                         + (0 if experts_only else la.mixer_params + la.ffn_params))
        lk = self.link([gpu], need=True)
        return max(nbytes / lk[0], self.roof(gpu, flops, 0.0))

    def card_s(self, c: Share, il: int, T: int, d0: int) -> tuple[float, float]:
        """(mixer, ffn) seconds of card c's share of layer il: the two stretches between tensor mode's syncs."""
        d, f = c.device, c.fraction
        ffn = (self.weights(d, il, T, f, "ffn") if il in c.ffns else 0.0) \
            + (self.experts(d, il, T, f) if il in c.experts else 0.0)
        return self.weights(d, il, T, f, "mixer") + self.attention(d, il, T, d0, f), ffn

    def host_s(self, T: int, d0: int) -> float:
        """The host's share of one micro-batch: its layers and the experts it keeps for the cards' layers."""
        if not self.host:
            return 0.0
        h, t = self.host.device, 0.0
        offload = bool(self.cards) and T >= OP_OFFLOAD_MIN_BATCH
        for il in self.host.layers:  # attention runs where the KV cache is: CPU memory
            t += self.attention(h, il, T, d0, 1.0)
            t += self.streamed(il, T, False) if offload else \
                self.weights(h, il, T, 1.0, "mixer") + self.weights(h, il, T, 1.0, "ffn") + self.experts(h, il, T, 1.0)
        for il in self.host.experts:
            if il not in self.host.layers:
                t += self.streamed(il, T, True) if offload else self.experts(h, il, T, 1.0)
        for il in (i for i in self.host.ffns if i not in self.host.layers):  # a card layer's FFN in host memory:
            t += self.streamed(il, T, False, ffn_only=True) if offload else self.weights(h, il, T, 1.0, "ffn") \
                + 2 * self.copy_s(h, self.cards[0].device, T * self.s.n_embd * ACT_BYTES)  # streamed, or run here
        if self.host.layers and self.cards:  # the activations cross to the first card
            t += self.copy_s(h, self.cards[0].device, T * self.s.n_embd * ACT_BYTES)
        return t

    def output_s(self, tokens: int) -> float:
        """The output head for `tokens` rows of logits, on whichever devices hold it."""
        owners = [c for c in [*self.cards, *([self.host] if self.host else [])] if c.output]
        t = max((self.roof(c.device, 2 * self.s.output_params * tokens * c.fraction, self.s.output_bytes * c.fraction)
                 for c in owners), default=0.0)
        if self.p.mode == "tensor" and len(owners) > 1:  # the logits' slices gathered: as one all-reduce
            t += self.reduce_s(tokens * self.s.output_params // max(self.s.n_embd, 1))
        return t

    def reduce_s(self, elements: int) -> float:
        lk = self.link([c.device for c in self.cards], need=True)
        return allreduce_s(elements, len(self.cards), lk[0], lk[1], self.allreduce)

    # one micro-batch of T tokens after d0 cached ones
    def stages(self, T: int, d0: int) -> tuple[list[float], float]:
        """Layer mode: each card's seconds in order (the copy of its input included), and of those the links'."""
        out, links, prev = [], 0.0, None
        for c in self.cards:
            t = sum(sum(self.card_s(c, il, T, d0)) for il in c.layers)
            t += sum(self.experts(c.device, il, T, 1.0) for il in c.experts if il not in c.layers)
            if prev is not None:
                hop = self.copy_s(prev, c.device, T * self.s.n_embd * ACT_BYTES)
                t, links = t + hop, links + hop
            out.append(t)
            prev = c.device
        return out, links

    def tensor_s(self, T: int, d0: int) -> tuple[float, float]:
        """Tensor mode: (seconds, of which all-reduces) for the layers on the cards."""
        t = links = 0.0
        layers = sorted({il for c in self.cards for il in c.layers})
        for il in layers:
            parts = [self.card_s(c, il, T, d0) for c in self.cards]
            ar = self.reduce_s(T * self.s.n_embd)
            t += max(p[0] for p in parts) + max(p[1] for p in parts) + 2 * ar
            links += 2 * ar
        return t, links

    @property
    def pipeline(self) -> bool:
        """llama.cpp's pipeline parallelism: layer mode, several devices, everything offloaded, no tensor
        overrides (llama_context's constructor)."""
        return self.p.mode == "layer" and len(self.cards) > 1 and self.host is None

    def batch_s(self, tokens: int, d0: int, n_ubatch: int) -> tuple[float, float]:
        """(seconds, of which links) for one llama_decode of `tokens` in micro-batches of n_ubatch; the caller
        reads the logits after it, so a pipeline fills and drains within it."""
        sizes = [min(n_ubatch, tokens - i) for i in range(0, tokens, n_ubatch)]
        starts = [d0 + i * n_ubatch for i in range(len(sizes))]
        out = self.output_s(1)
        if self.p.mode == "tensor":
            runs = [self.tensor_s(T, s) for T, s in zip(sizes, starts)]
            host = sum(self.host_s(T, s) for T, s in zip(sizes, starts))
            return sum(r[0] for r in runs) + host + out, sum(r[1] for r in runs)
        rows = [self.stages(T, s) for T, s in zip(sizes, starts)]
        links = sum(r[1] for r in rows)
        if not self.pipeline:
            host = sum(self.host_s(T, s) for T, s in zip(sizes, starts))
            return sum(sum(r[0]) for r in rows) + host + out, links
        # micro-batch u enters stage k when u has left stage k-1 and u-1 has left stage k; at most
        # GGML_SCHED_MAX_COPIES micro-batches in flight (u waits for u - copies to leave the last stage)
        done: list[list[float]] = []
        for u, (times, _) in enumerate(rows):
            row: list[float] = []
            for k, t in enumerate(times):
                free = done[u - GGML_SCHED_MAX_COPIES][-1] if u >= GGML_SCHED_MAX_COPIES else 0.0
                ready = row[k - 1] if k else free
                row.append(max(ready, done[u - 1][k] if u else 0.0) + t)
            done.append(row)
        return done[-1][-1] + out, links

    def prefill(self, w: Workload) -> tuple[float, float]:
        t = links = 0.0
        for i in range(0, w.prompt_tokens, w.n_batch):
            dt, dl = self.batch_s(min(w.n_batch, w.prompt_tokens - i), w.prompt_depth + i, w.n_ubatch)
            t, links = t + dt, links + dl
        return t, links

    def token(self, depth: int) -> tuple[float, float]:
        """(seconds, of which links) for one decoded token at `depth` cached tokens."""
        if self.p.mode == "tensor":
            t, links = self.tensor_s(1, depth)
        else:
            times, links = self.stages(1, depth)
            t = sum(times)
        return t + self.host_s(1, depth) + self.output_s(1), links


def estimate(shape: ModelShape, placement: Placement, workload: Workload,
             allreduce: str = "butterfly") -> SpeedEstimate:
    """Prefill seconds, decode tokens/s and the total for `workload` on `placement`: an estimate. `allreduce`:
    "butterfly" (llama.cpp's generic all-reduce, what a build without NCCL runs) or "nccl"."""
    if placement.mode not in ("layer", "tensor"):
        raise InvalidOption(f"`split_mode` {placement.mode!r}: choose layer or tensor", option="split_mode",
                            value=placement.mode)
    if allreduce not in ALLREDUCES:
        raise InvalidOption(f"all-reduce {allreduce!r}: choose {' or '.join(ALLREDUCES)}")
    m = _Model(shape, placement, allreduce)
    missing: list[str] = []
    prefill = plinks = decode = dlinks = None
    try:
        prefill, plinks = m.prefill(workload)
    except _Unknown as e:
        missing.append(f"prefill: {e}")
    m.strict = False  # one token reads far more bytes than it does FLOPs: bandwidth alone will do
    try:
        t, dlinks = m.token(workload.decode_depth)
        decode = 1.0 / t if t > 0 else None
    except _Unknown as e:
        missing.append(f"decode: {e}")
    total = prefill + workload.gen_tokens / decode if prefill is not None and decode else None
    how = {"layer": "the cards one after another" + (", micro-batches overlapped (pipeline parallelism)"
                                                      if m.pipeline else ""),
           "tensor": f"every card on every layer, 2 all-reduces per layer ({allreduce})"}[placement.mode]
    notes = [f"{n}: decode taken as memory-bound (compute throughput unknown)" for n in sorted(m.assumed - {"links"})]
    if "links" in m.assumed:
        notes.append("copies between cards not counted (link unknown)")
    basis = (f"estimate, not a measurement ({placement.mode} mode: {how}; each part of a layer takes the longer of "
             f"its FLOPs at the card's FP16 tensor rate and its bytes at its memory bandwidth)"
             + "".join(f"; {n}" for n in notes))
    return SpeedEstimate(placement.mode, prefill, decode, total, basis, workload, plinks, dlinks, m.pipeline, missing)


def placement_from_plan(plan) -> Placement:
    """The placement a `Plan` makes: in layer mode each device's layers; in tensor mode (`plan.split_mode`)
    each card's `tensor_split` proportion of every layer the host does not keep."""
    n, cpu_exp, cpu_ffn = plan.n_layer, set(plan.cpu_expert_layers), set(getattr(plan, "cpu_ffn_layers", ()))
    host_layers = tuple(il for il in plan.host.layers if il < n)
    host = Share(plan.host.device, host_layers, expert_layers=tuple(sorted(set(host_layers) | cpu_exp)),
                 output=n in plan.host.layers, ffn_layers=tuple(sorted(set(host_layers) | cpu_ffn)))
    if getattr(plan, "split_mode", "layer") == "tensor":
        on_cards = tuple(il for il in range(n) if il not in host_layers)
        total = sum(plan.tensor_split)
        cards = tuple(Share(dp.device, on_cards, plan.tensor_split[i] / total if total else 1 / len(plan.gpus),
                            tuple(il for il in on_cards if il not in cpu_exp), output=not host.output)
                      for i, dp in enumerate(plan.gpus))
        return Placement("tensor", cards, host)
    cards = tuple(Share(dp.device, tuple(il for il in dp.layers if il < n),
                        expert_layers=tuple(il for il in dp.layers if il < n and il not in cpu_exp),
                        output=n in dp.layers, ffn_layers=tuple(il for il in dp.layers if il < n and il not in cpu_ffn))
                  for dp in plan.gpus)
    return Placement("layer", cards, host)


@dataclass
class Choice:
    """The faster candidate for a workload (None when none can be estimated) and why, in words."""

    best: SpeedEstimate | None
    reason: str


def choose(candidates: Sequence[SpeedEstimate]) -> Choice:
    """The candidate with the least total time for its workload, and a sentence saying why (estimates)."""
    known = [c for c in candidates if c.total_s is not None]
    unknown = [c for c in candidates if c.total_s is None]
    why_not = "; ".join(dict.fromkeys(m.split(": ", 1)[-1] for c in unknown for m in c.missing))
    if not known:
        return Choice(None, f"cannot compare the candidates' speed: {why_not or 'none given'}")
    best = min(known, key=lambda c: c.total_s)
    w = best.workload
    text = (f"{best.mode} mode is estimated fastest for {w.prompt_tokens:,} prompt and {w.gen_tokens:,} generated "
            f"tokens: {best.total_s:.1f} s")
    for o in known:
        if o is not best:
            text += (f"; {o.mode} mode {o.total_s:.1f} s ({best.mode} mode's prefill "
                     f"{_ratio(o.prefill_s, best.prefill_s)} as fast, its decode "
                     f"{_ratio(best.decode_tps, o.decode_tps)}{_why(best, o)})")
    if unknown:
        text += f"; {', '.join(sorted({c.mode for c in unknown}))} mode not compared: {why_not}"
    return Choice(best, text + " (estimates, not measurements)")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "?"


def _why(best: SpeedEstimate, other: SpeedEstimate) -> str:
    """What tips it: tensor mode's all-reduces, or its cards working at once."""
    tensor = best if best.mode == "tensor" else other if other.mode == "tensor" else None
    if tensor is None or not tensor.prefill_s or tensor.prefill_links_s is None:
        return ""
    share = f"all-reduces take {tensor.prefill_links_s / tensor.prefill_s:.0%} of tensor mode's prefill"
    return f"; every card works on every layer at once, {share}" if tensor is best else f"; {share}"
