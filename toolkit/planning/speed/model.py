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

from dataclasses import asdict, dataclass, field
from typing import Sequence

from ...errors import InvalidOption
from ..devices import GPU_BANDWIDTH_SHARE, GPU_COMPUTE_SHARE, Device
from .allreduce import ACT_BYTES, ALLREDUCES, CUDA_CALL_S, allreduce_s  # noqa: F401 (speed.allreduce_s, CUDA_CALL_S)
from .choice import Choice, choose  # noqa: F401 (speed.choose: the faster candidate, in words)
from .shape import LayerShape, ModelShape, model_shape  # noqa: F401 (speed.model_shape is the entry point)
from ..options import DEFAULT_N_BATCH, DEFAULT_N_UBATCH

GGML_SCHED_MAX_COPIES = 4  # micro-batches in flight with pipeline parallelism (ggml/src/ggml-backend.cpp)
OP_OFFLOAD_MIN_BATCH = 32  # weights in CPU memory go to the GPU for batches of 32+ tokens (ggml-cuda.cu)
# Host memory the driver must stage (pageable: an mmap'd model, `-ot ...=CPU` weights, a host layer's KV cache)
# copies to a card below pinned memory's rate (the card's link): published shares 0.30 (9.6 against 32.4 GB/s for
# one expert, kekzl/imp PR #1409, 2026-08-13, WSL2), 0.5 (a copy-bound 26k prefill at 166 pageable against 330 t/s
# pinned, llama.cpp PR 28223, 2026-09-02) and about 0.8 (pinning gave +21 % to a copy-bound prefill, llama.cpp
# #25859). The middle one; a profile's [cpu] pageable_gbs replaces it.
PAGEABLE_SHARE = 0.5
DEFAULT_GEN_TOKENS = 128  # llama-bench's tg128: the generation figure the published rows use


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
    # whole host layers' weights in the first GPU's pinned host buffer (`--no-mmap`: llama_model_loader puts them in
    # ggml_backend_dev_host_buffer_type unless mmap'd); `-ot ...=CPU` names the CPU's own, pageable buffer type
    host_pinned: bool = False


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
        gpu = dev.kind == "gpu"
        bw, fl = (GPU_BANDWIDTH_SHARE, GPU_COMPUTE_SHARE) if gpu else (1.0, 1.0)
        if dev.flops is None:
            if self.strict and flops:
                raise _Unknown(f"unknown compute throughput of {dev.name}: give --profile with tflops_f16 "
                               "(a card described by --gpus or an RPC worker has none)")
            self.assumed.add(dev.name)
            return nbytes / (dev.bandwidth * bw)
        return max(flops / (dev.flops * fl), nbytes / (dev.bandwidth * bw))

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

    @property
    def offload_card(self) -> Device | None:
        """The card llama.cpp copies host weights to for a batch of 32+ tokens: the first backend whose device has
        `offload_op` (ggml_backend_sched_backend_id_from_cur, cause "1.off"): CUDA's and the other GPU backends';
        ggml's RPC devices have none (ggml-rpc.cpp), so over RPC workers the host computes its own weights."""
        return next((c.device for c in self.p.cards if c.device.kind == "gpu"), None)

    def host_copy_s(self, nbytes: float, pinned: bool, calls: int = 1) -> float:
        """Host memory to the offload card, at its link (pinned) or at the staged pageable rate."""
        gpu = self.offload_card
        link = self.link([gpu], need=True)[0]
        h = self.host.device if self.host else None
        pageable = h.pageable_bandwidth if h is not None and h.pageable_bandwidth else link * PAGEABLE_SHARE
        return calls * CUDA_CALL_S + nbytes / (link if pinned else min(link, pageable))

    def streamed(self, il: int, T: int, experts_only: bool, ffn_only: bool = False) -> float:
        """Weights in host memory for a batch of 32+ tokens: copied to the offload card, then multiplied there. In
        mainline llama.cpp the two add: ggml_backend_sched_compute_splits copies a split's inputs on the card's
        stream, then computes the split on it (no prefetch). Of an expert tensor only the experts some token of the
        batch routes to are copied (the same function, MUL_MAT_ID); a dense tensor is copied whole."""
        la, gpu = self.s.layers[il], self.offload_card
        touched = 1 - (1 - self.s.used_fraction) ** T
        nbytes = la.ffn_bytes if ffn_only else la.expert_bytes * touched + (
            0 if experts_only else la.mixer_bytes + la.ffn_bytes)
        flops = 2 * T * (la.ffn_params if ffn_only else la.expert_params * self.s.used_fraction
                         + (0 if experts_only else la.mixer_params + la.ffn_params))
        pinned = bool(self.p.host_pinned) and not ffn_only and not experts_only
        return self.host_copy_s(nbytes, pinned, 3) + self.roof(gpu, flops, nbytes)

    def host_attention_offloaded(self, il: int, T: int, d0: int) -> float:
        """A host layer's attention at a batch of 32+ tokens: FLASH_ATTN_EXT is not placed by a weight
        (ggml_backend_sched_backend_id_from_cur skips it), so pass 2 expands the offloaded projections' card to it;
        the layer's K and V views (the cells in use) cross from the host's plain CPU buffer (llama_kv_cache uses
        ggml_backend_cpu_buffer_type for a layer not offloaded: pageable) every micro-batch, and the new rows go
        back to the host cache (set_rows on the CPU, where the cache's buffer is)."""
        la, gpu = self.s.layers[il], self.offload_card
        if not la.attn_flops_per_key:
            return 0.0
        cached = d0 + T if not la.window else min(d0 + T, la.window + T)
        back = self.copy_s(gpu, self.host.device, T * la.kv_bytes_per_key)
        return self.host_copy_s(la.kv_bytes_per_key * cached, False, 2) + self.attention(gpu, il, T, d0, 1.0) + back

    def card_s(self, c: Share, il: int, T: int, d0: int) -> tuple[float, float]:
        """(mixer, ffn) seconds of card c's share of layer il: the two stretches between tensor mode's syncs."""
        d, f = c.device, c.fraction
        ffn = (self.weights(d, il, T, f, "ffn") if il in c.ffns else 0.0) \
            + (self.experts(d, il, T, f) if il in c.experts else 0.0)
        return self.weights(d, il, T, f, "mixer") + self.attention(d, il, T, d0, f), ffn

    def host_s(self, T: int, d0: int) -> float:
        """The host's share of one micro-batch: its layers and the experts or FFN it keeps for the cards' layers.
        At 32+ tokens with a card that offloads, the whole host layer runs on that card (its weights and K/V copied
        in); below that, or over RPC workers only, the CPU computes it from host memory."""
        if not self.host:
            return 0.0
        h, t = self.host.device, 0.0
        offload = self.offload_card is not None and T >= OP_OFFLOAD_MIN_BATCH
        for il in self.host.layers:
            if offload:
                t += self.streamed(il, T, False) + self.host_attention_offloaded(il, T, d0)
            else:
                t += self.attention(h, il, T, d0, 1.0) + self.weights(h, il, T, 1.0, "mixer") \
                    + self.weights(h, il, T, 1.0, "ffn") + self.experts(h, il, T, 1.0)
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
    pinned = not getattr(plan, "use_mmap", True)  # --no-mmap: llama_model_loader keeps the GPU's host buffer type
    if getattr(plan, "split_mode", "layer") == "tensor":
        on_cards = tuple(il for il in range(n) if il not in host_layers)
        total = sum(plan.tensor_split)
        cards = tuple(Share(dp.device, on_cards, plan.tensor_split[i] / total if total else 1 / len(plan.gpus),
                            tuple(il for il in on_cards if il not in cpu_exp), output=not host.output)
                      for i, dp in enumerate(plan.gpus))
        return Placement("tensor", cards, host, host_pinned=pinned)
    cards = tuple(Share(dp.device, tuple(il for il in dp.layers if il < n),
                        expert_layers=tuple(il for il in dp.layers if il < n and il not in cpu_exp),
                        output=n in dp.layers, ffn_layers=tuple(il for il in dp.layers if il < n and il not in cpu_ffn))
                  for dp in plan.gpus)
    return Placement("layer", cards, host, host_pinned=pinned)
