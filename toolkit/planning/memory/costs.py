"""The per-device memory model of a plan (all sizes in bytes), following llama.cpp's allocations:

- weights: each layer's tensors on the device its layer is assigned to; token embeddings on the host;
  the output head (output.weight, output_norm) on the device of layer n_layer (the last GPU in use,
  or the host); tied embeddings get a second copy there (TENSOR_DUPLICATED in load_tensors).
- KV cache: per attention layer on that layer's device (offload_kqv), kv_size = n_ctx padded to 256
  cells, sliding-window layers pad256(n_swa + n_ubatch) cells (llama_kv_cache_iswa), row sizes by type.
- recurrent state: per recurrent layer on that layer's device, f32, one row set per sequence
  (llama_memory_recurrent holds max(1, n_seq_max) cells). Its own term (`DevicePlan.state`, the RS buffer).
- compute buffers: measured by llama.cpp itself on derived models (`compute.py`), plus the graph-input
  copies that each device holds when the graph is split.
- host: token embeddings, layers left on the CPU with their KV, the CPU's compute buffer and the logits
  buffer (n_vocab floats per sequence: llama_context::output_reserve(n_seq_max)).
- parallel plans (PlanOptions.parallel): the unified KV cache keeps n_ctx cells for all sequences, state and
  logits scale with n_seq_max, the reserved graph outputs n_outputs_max rows (llama_context::sched_reserve).
- CUDA's own memory (`cuda.py`) on CUDA devices: flash attention's f16 K/V copies over a quantized cache, the
  first CUDA device's copies of CPU-resident weights and KV for prompt processing, the pool's high-water, and
  a reserve outside every buffer. `planner` searches over layer assignments with these costs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Callable

from . import compute as compute_mod
from . import cuda as cuda_mod
from . import inputs as inputs_mod
from ..devices import GPU_BANDWIDTH_SHARE, Device
from ..options import PlanOptions
from ..plan import DevicePlan
from ..user_tensors import CPU, UserTensors, device_names, user_tensors
from .split import (SCHED_COPIES, device_compute, moe_split_peaks, recurrent_split, recurrent_tails, shared_kv_reads,
                    split_inputs)
from ...errors import CtxqError
from ...gguf.info import KV_PAD, ModelInfo, kv_cells
from ...gguf.info import layer_kv_bytes
from ...units import GiB, MiB, round_up

RPC_MARGIN = 32 * MiB  # rounding of llama.cpp's per-buffer alignment, measured on RPC workers
HOST_MARGIN = 1 * GiB  # the Python process, llama.cpp's own heap and the OS page cache for mmap


@dataclass
class Costs:
    """Per-layer and per-device costs for one (n_ctx, KV types, flash attention) choice."""

    info: ModelInfo
    layer_weights: list[int]
    layer_kv: list[int]
    layer_state: list[int]  # recurrent state per layer (one sequence)
    output_weights: int
    peaks: compute_mod.ComputePeaks
    inputs: int  # one copy of the split-graph inputs (masks, residual, indices), as the host builds them
    resid: int  # the residual stream, f32 [n_embd, n_ubatch]
    n_ubatch: int
    inputs_recurrent: int  # one copy of the inputs of a device without attention layers (no masks, no KV indices)
    logits: int
    head: int = 0  # the output device's peak at the head, before input copies
    flash_attn: bool = True
    f16_cache: bool = True
    cuda: cuda_mod.LayerTable | None = None  # CUDA's per-layer terms, when a device's backend is CUDA
    reserve: int | None = None  # the caller's reserve per GPU (bytes), over the device's and the backend's
    layer_experts: list[int] = field(default_factory=list)  # routed-expert bytes per layer (part of layer_weights)
    cpu_experts: frozenset[int] = frozenset()  # layers whose experts sit in CPU memory (tensor overrides)
    recurrent_tails: list[tuple[int, int]] = field(default_factory=list)  # (layer, reader) pairs (recurrent_tails)
    mtp_layers: frozenset[int] = frozenset()  # NextN blocks llama.cpp leaves unloaded: slots outside the graph
    host_gathers: int = 0  # rows the host gathers for a split graph's devices beside the embeddings (inputs.host_gathers)
    host_experts: int = 0  # the host's peak for one layer's routed experts in CPU memory (inputs.host_experts)
    host_experts_freed: int | None = None  # the same with the attention mask freed among them (inputs.host_experts' hole)
    cache_inputs: tuple[int, int] = (0, 0)  # iSWA: one copy of the full and the sliding cache's mask and KV indices
    altup: tuple[int, int, int] = (0, 0, 0)  # Gemma 3n's split inputs (inputs.altup_inputs)
    per_layer_slab: int = 0  # per layer, the slabs the derived models cut from layer 0's peak (inputs.per_layer_slabs)
    one_device: Callable[[], int] | None = None  # the whole graph's peak on one device (one_device_peak), asked lazily
    layer_ffn: list[int] = field(default_factory=list)  # dense FFN bytes per layer (part of layer_weights unless spilled)
    cpu_ffn: frozenset[int] = frozenset()  # layers whose dense FFN sits in host memory (tensor overrides), attention
    # and KV on the layer's card
    host_ffn: int = 0  # the host's peak for one layer's dense FFN in host memory (inputs.host_ffn)
    user: UserTensors | None = None  # the user's -ot placement, a fixed base under ctxq's own moves (user_tensors)

    def sums(self, layers) -> tuple[int, int, int, int]:
        """Weights, KV, state and expert bytes of `layers` (a range: prefix sums; the search asks often)."""
        if not (isinstance(layers, range) and layers.step == 1) or len(self.layer_experts) != len(self.layer_kv):
            ls = list(layers)
            return tuple(sum(col[i] for i in ls) for col in (self.layer_weights, self.layer_kv, self.layer_state,
                                                               self.layer_experts))
        if not layers:  # also a range past the last layer (every slot on the CPU)
            return 0, 0, 0, 0
        return tuple(col[layers.stop] - col[layers.start] for col in self._prefix)

    @cached_property
    def totals(self) -> dict:
        """Memo of device totals for the planner's search, by (first slot, end slot, device, first CUDA device,
        slots_key)."""
        return {}

    @cached_property
    def _prefix(self) -> tuple[list[int], ...]:
        return tuple(list(itertools.accumulate(col, initial=0)) for col in
                     (self.layer_weights, self.layer_kv, self.layer_state, self.layer_experts))

    def with_cpu_experts(self, layers) -> Costs:
        """These costs with the experts of `layers` in CPU memory: those layers' device weights lose them.
        Any tensor override turns llama.cpp's pipeline parallelism off (`pipeline`)."""
        return self._placed(frozenset(layers), self.cpu_ffn)

    def with_cpu_ffn(self, layers) -> Costs:
        """These costs with the dense FFN of `layers` in host memory (`-ot blk\\.N\\.ffn_...=CPU`): those layers'
        device weights lose it; their attention, norms and KV cache stay on the device."""
        return self._placed(self.cpu_experts, frozenset(layers))

    def _placed(self, experts: frozenset, ffn: frozenset) -> Costs:
        # layer_ffn and layer_experts hold only what the user's patterns left (costs()); the rest of what they took
        # leaves the layer whatever ctxq moves
        ffn_of = self.layer_ffn or [0] * len(self.layer_experts)
        u = self.user
        taken = [m - e for m, e in zip(u.moved, u.moved_experts)] if u else [0] * len(self.layer_experts)
        lw = [d - t - (f if il in ffn else 0) + (0 if il in experts else e) for il, (d, e, f, t) in
              enumerate(zip(self.info_dense, self.layer_experts, ffn_of, taken))]
        return replace(self, layer_weights=lw, cpu_experts=experts, cpu_ffn=ffn)

    def host_ffn_layers(self, layers) -> set[int]:
        """Of `layers`, those whose dense FFN (ctxq's) or user-placed tensors sit in host memory: the host runs a
        split of each, its result a residual-sized input back on the layer's device; cuda.py's op-offload copies."""
        return {il for il in layers if il in self.cpu_ffn} | (self.user.host_layers(layers) if self.user else set())

    @property
    def info_dense(self) -> list[int]:
        return [la.dense_bytes for la in self.info.layers]

    def pipeline(self, n_cpu_slots: int) -> bool:
        """llama_context: pipeline parallelism only when every layer is offloaded and no tensor is
        overridden (`!model.has_tensor_overrides()`)."""
        return n_cpu_slots == 0 and not self.cpu_experts and not self.cpu_ffn and not self.user


def kv_by_layer(info: ModelInfo, n_ctx: int, n_ubatch: int, type_k: str, type_v: str) -> list[int]:
    """Bytes of each layer's KV cache (gguf.info.layer_kv_bytes, for every layer)."""
    return [layer_kv_bytes(info, il, n_ctx, n_ubatch, type_k, type_v) for il in range(info.n_layer)]


def costs(info: ModelInfo, src, opts: PlanOptions, type_k: str, type_v: str, cuda: bool = False) -> Costs:
    """The costs for resolved options `opts` with these KV types; src is the model's GGUF header.
    cuda: some device is a CUDA card (its terms are computed once here)."""
    n_ctx, n_ubatch, flash_attn = opts.n_ctx, opts.n_ubatch, opts.flash_attn
    layer_kv = kv_by_layer(info, n_ctx, n_ubatch, type_k, type_v)
    out_w = info.output_bytes + (info.token_embd_bytes if info.output_tied else 0)
    peaks = compute_mod.compute_peaks(src, info, n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=opts.n_batch,
                                      type_k=type_k, type_v=type_v, flash_attn=flash_attn)
    n_seq = opts.parallel or 1
    # rows of result_output in the reserved graph; compute_peaks measures llama.cpp's default (n_batch >= n_ubatch)
    outputs = min(n_ubatch, opts.parallel) if opts.parallel else n_ubatch
    peaks = fewer_outputs(peaks, info.n_vocab * (n_ubatch - outputs) * 4)
    n_kv = round_up(n_ctx, KV_PAD)
    # Graph inputs that cross devices, read off llama.cpp's split graphs on RPC devices (docs/accuracy.md): the
    # attention mask ([n_kv, n_ubatch], f16 with flash attention, else f32; iSWA models carry a second one over the
    # window's cells, Costs.cache_inputs), the residual stream (f32 [n_embd, n_ubatch]) and index_inputs.
    mask_cells = n_kv + (kv_cells(info, n_ctx, n_ubatch, info.swa_layers.index(True)) if any(info.swa_layers) else 0)
    mask = mask_cells * n_ubatch * (2 if flash_attn else 4)
    resid = info.n_embd * n_ubatch * 4
    idx = index_inputs(info, n_ubatch, flash_attn, type_k, type_v)
    full, per_cache = n_kv * n_ubatch * (2 if flash_attn else 4), (idx - position_inputs(info, n_ubatch)) // 2
    user = user_tensors(src.tensors, info, opts.override_tensor or ())
    layer_w, layer_ffn = list(info.layer_bytes), [la.ffn_bytes for la in info.layers]
    layer_exp = [la.expert_bytes for la in info.layers]
    if user:  # the user's tensors leave their slots; ctxq's own moves take only the rest
        n = info.n_layer
        layer_w = [w - m for w, m in zip(layer_w, user.moved[:n])]
        layer_ffn = [f - m for f, m in zip(layer_ffn, user.moved_ffn)]
        layer_exp = [e - m for e, m in zip(layer_exp, user.moved_experts)]
        out_w -= user.moved[n]
    return Costs(info, layer_w, layer_kv, [n_seq * la.state_bytes for la in info.layers], out_w, peaks,
                 inputs=mask + resid + idx,
                 resid=resid, n_ubatch=n_ubatch, inputs_recurrent=resid + position_inputs(info, n_ubatch),
                 logits=n_seq * info.n_vocab * 4,
                 # result_output f32 [n_vocab, outputs] (by default the reserve outputs every token) and up to
                 # 3 residual-sized tensors beside it (Phi-3-mini 4k-32k: 3; Llama-3: 1), measured on RPC
                 head=info.n_vocab * outputs * 4 + 3 * resid, flash_attn=flash_attn,
                 f16_cache=type_k == "f16" and type_v == "f16",
                 cuda=cuda_mod.layer_table(info, n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v,
                                           flash_attn=flash_attn) if cuda else None,
                 reserve=opts.reserve, layer_experts=layer_exp, user=user,
                 recurrent_tails=recurrent_tails(info), mtp_layers=frozenset(il for il, la in enumerate(info.layers) if la.mtp),
                 host_gathers=inputs_mod.host_gathers(src, n_ubatch),
                 host_experts=inputs_mod.host_experts(src, info.n_expert_used, n_ubatch) if info.n_expert else 0,
                 host_experts_freed=inputs_mod.host_experts(src, info.n_expert_used, n_ubatch, hole=mask)
                 if info.n_expert and not any(info.swa_layers) else None,
                 cache_inputs=(full + per_cache, mask - full + per_cache) if any(info.swa_layers) else (0, 0),
                 altup=inputs_mod.altup_inputs(src, n_ubatch), per_layer_slab=inputs_mod.per_layer_slabs(src, n_ubatch),
                 layer_ffn=layer_ffn, host_ffn=inputs_mod.host_ffn(src, n_ubatch),
                 one_device=partial(one_device_peak, src, (n_ctx, n_ubatch, opts.n_batch, type_k, type_v, flash_attn),
                                    info.n_vocab * (n_ubatch - outputs) * 4, peaks.layer_steady))


def one_device_peak(src, args: tuple, fewer: int, floor: int) -> int | None:
    """The compute buffer of the whole model's graph on the CPU alone: llama.cpp's dry run of the real header
    (compute.model_path) at the plan's settings, less `fewer` bytes of result_output but never below the layers'
    peak `floor` (fewer_outputs); None where llama.cpp refuses it. No derived model stands for it: ggml-alloc's
    placement at the head depends on every layer before it (tiny Falcon-H1 at 16k: the one-layer model with the
    head 96.50 MiB, the two-layer one 96.75, the three-layer one 96.50, the whole model 96.75; tiny Falcon-H1 and
    Gemma 4 were one residual under, 0.25 MiB). One dry run more, for CPU-alone plans only (after llama.cpp's
    import: 15 ms for a Llama-3-8B-shaped header, 33 ms a 70B-shaped one; cached on disk)."""
    from ...llama.accounting import dry_run_compute  # here: as compute._dry_run, no llama.cpp import when cached

    n_ctx, n_ubatch, n_batch, type_k, type_v, flash_attn = args
    try:
        whole = dry_run_compute(compute_mod.model_path(src), n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch,
                                type_k=type_k, type_v=type_v, flash_attn=flash_attn)
    except CtxqError:
        return None
    return max(whole - fewer, floor) if fewer > 0 else whole


def fewer_outputs(peaks: compute_mod.ComputePeaks, fewer: int) -> compute_mod.ComputePeaks:
    """The peaks with `fewer` bytes of result_output at the head, never below the layers' own peak."""
    if fewer <= 0:
        return peaks
    kinds = {k: fewer_outputs(p, fewer) for k, p in peaks.by_kind.items()}
    return replace(peaks, output=max(peaks.output - fewer, peaks.layer_full), by_kind=kinds)


def index_inputs(info: ModelInfo, n_ubatch: int, flash_attn: bool, type_k: str, type_v: str) -> int:
    """One copy of the graph inputs besides the masks and the residual (scripts/underestimates.py).

    Per KV cache (iSWA models have two, llama_kv_cache_iswa): `attn_inp_k_idxs` I64 [n_ubatch] and
    `attn_inp_v_idxs` I64 [n_ubatch], or [n_ubatch * n_embd_v_gqa_max] when the V cache is transposed
    (flash attention off; llama_kv_cache::build_input_v_idxs); with a quantized cache the Hadamard
    rotations `attn_inp_k_rot` f32 [nrot, nrot] (nrot: the largest power of two >= 64 dividing the K head
    size) and `attn_inp_v_rot` f32 [64, 64] (llama_kv_cache::build_input_k_rot / build_input_v_rot).
    Plus `inp_pos` I32 [n_ubatch * n_pos_per_token] and `out_ids` I32 [n_ubatch] (llm_graph_input_pos,
    llm_graph_input_out_ids).
    """
    n_caches = 2 if any(info.swa_layers) else 1
    v_rows = 1 if flash_attn else max(info.n_embd_v_gqa(il) for il in range(info.n_layer))
    per_cache = n_ubatch * 8 * (1 + v_rows)
    if type_k not in UNQUANTIZED and info.head_dim_k % 64 == 0:  # ggml_is_quantized(type_k) (llama_kv_cache)
        nrot = 64
        while info.head_dim_k % (nrot * 2) == 0:
            nrot *= 2
        per_cache += nrot * nrot * 4
    if type_v not in UNQUANTIZED and info.head_dim_v % 64 == 0:
        per_cache += 64 * 64 * 4
    return n_caches * per_cache + position_inputs(info, n_ubatch)


UNQUANTIZED = ("f32", "f16", "bf16")  # cache types llama.cpp does not rotate


def position_inputs(info: ModelInfo, n_ubatch: int) -> int:
    """`inp_pos` and `out_ids` (index_inputs)."""
    return (info.n_pos_per_token + 1) * n_ubatch * 4


def reserve(c: Costs, dev: Device) -> int:
    """Bytes a GPU keeps free outside every buffer: the caller's, the device's, else cuda.cuda_reserve."""
    for r in (c.reserve, dev.reserve):
        if r is not None:
            return r
    return cuda_mod.cuda_reserve(dev.backend)


def device_cost(c: Costs, layers: range, has_output: bool, n_used: int, dev: Device, *, first_cuda: bool = False,
                n_cpu_slots: int = 0) -> DevicePlan:
    """What a device holding `layers` (and the output head if has_output) needs, when n_used devices
    hold layers and the first n_cpu_slots layer slots sit on the CPU; first_cuda: it is the first CUDA
    device in llama.cpp's order (the op-offload target)."""
    dp = DevicePlan(dev, list(layers) + ([c.info.n_layer] if has_output else []))
    weights, kv, state, experts = c.sums(layers)
    dp.weights = weights + (c.output_weights if has_output else 0)
    if c.user:  # the user's tensors placed here, from any slot (their slots' costs lost them: costs())
        dp.override_bytes = c.user.bytes_to(device_names(dev))
        dp.weights += dp.override_bytes
    dp.kv, dp.state = kv, state
    dp.cpu_experts = [il for il in layers if il in c.cpu_experts] if c.cpu_experts else []
    dp.cpu_expert_bytes = sum(c.layer_experts[il] for il in dp.cpu_experts)
    dp.cpu_ffn = [il for il in layers if il in c.cpu_ffn] if c.cpu_ffn else []
    dp.cpu_ffn_bytes = sum(c.layer_ffn[il] for il in dp.cpu_ffn)
    run = [il for il in layers if il not in c.mtp_layers] if c.mtp_layers else layers  # layers in the graph
    peaks = _peaks(c, run)
    if c.cpu_experts and n_used > 1:  # its one-layer peak in that split graph first (inputs.moe_split_layer_full)
        peaks = moe_split_peaks(c, inputs_mod.moe_split_layer_full(c, peaks, run), run)
    ins = split_inputs(c, run)
    if (n_used > 1 or n_cpu_slots) and any(c.altup):  # a split graph
        ins += inputs_mod.altup_device(c.altup, run, has_output)
        held = inputs_mod.altup_steady(c, peaks, run, has_output, SCHED_COPIES if c.pipeline(n_cpu_slots) else 1)
        peaks = replace(peaks, layer_steady=peaks.layer_steady + held)
    dp.compute = device_compute(c, peaks, ins, bool(run), has_output, n_used,
                                 pipeline=c.pipeline(n_cpu_slots), layers=run)
    dp.experts = experts - sum(c.layer_experts[i] for i in dp.cpu_experts)
    if n_used > 1 or n_cpu_slots:
        copies = SCHED_COPIES if c.pipeline(n_cpu_slots) else 1
        dp.compute += recurrent_split(c, layers, copies) + shared_kv_reads(c, run, copies)
    if c.host_ffn_layers(layers):  # the FFN's (or the user's tensors') result comes back from the host's split: one
        # residual-sized input copy
        dp.compute += c.resid
    if dev.kind != "gpu":
        dp.margin = RPC_MARGIN
        return dp
    dp.margin = reserve(c, dev)
    if dev.backend == "cuda" and c.cuda is not None:
        # the user's host tensors as the spilled FFN's: op offload copies them to the first card (cuda.py)
        t = c.cuda.terms(layers, has_output, first_cuda, n_cpu_slots, dp.margin, c.cpu_experts,
                         frozenset(c.host_ffn_layers(range(c.info.n_layer))))
        dp.cuda_copies, dp.cuda_pool = t.compute, t.pool
    return dp


def slots_key(n_cpu_slots: int, first_cuda: bool):
    """What of n_cpu_slots a device's cost depends on (device_cost): pipeline parallelism (off while any
    slot sits on the CPU: `Costs.pipeline`) and, on the first CUDA device only, the CPU layers' op-offload copies
    (cuda.LayerTable.terms). So the search costs a device once per range, not once per layer count it tries;
    tests/test_plan_speed.py checks this against device_cost at every count."""
    return n_cpu_slots if first_cuda else n_cpu_slots == 0


def _peaks(c: Costs, layers, slabs: bool = True) -> compute_mod.ComputePeaks:
    """The compute peaks for a device holding `layers`, by the kinds of layer it holds (with layer 0 and `slabs`,
    the per-layer slabs its derived models miss: inputs.first_layer_peaks)."""
    peaks = c.peaks.of({c.info.layers[il].kind for il in layers}) if c.peaks.by_kind else c.peaks
    if slabs and c.per_layer_slab and 0 in layers:
        return inputs_mod.first_layer_peaks(peaks, c.info, c.per_layer_slab, mixed=peaks is c.peaks)
    return peaks


def host_cost(c: Costs, n_cpu_layers: int, n_used: int, cpu: Device, counts=()) -> DevicePlan:
    """What the host needs with the first n_cpu_layers layer slots (llama.cpp keeps those on the CPU) and
    the experts of c.cpu_experts (tensor overrides to the CPU buffer type) of the layers on devices; counts: the
    devices' layer slots in order, where the caller knows them (inputs.mask_freed)."""
    n = c.info.n_layer
    layers = range(0, min(n_cpu_layers, n))
    has_out = n_cpu_layers == n + 1
    dp = DevicePlan(cpu, list(layers) + ([n] if has_out else []))
    moved = sorted(il for il in c.cpu_experts if il >= len(layers))  # experts of device layers kept here
    dp.cpu_experts = moved
    dp.cpu_expert_bytes = expert_host = sum(c.layer_experts[i] for i in moved)
    ffn = sorted(il for il in c.cpu_ffn if il >= len(layers))  # dense FFN of device layers kept here
    dp.cpu_ffn, dp.cpu_ffn_bytes = ffn, sum(c.layer_ffn[i] for i in ffn)
    ffn = sorted(c.host_ffn_layers(range(len(layers), n)))  # with the user's: the host runs their splits
    dp.weights = c.info.token_embd_bytes + c.info.other_bytes + sum(c.info.layer_bytes[i] for i in layers) \
        + (c.info.output_bytes if has_out else 0) + expert_host + dp.cpu_ffn_bytes
    if c.user:  # what the user's patterns take from the host's slots, and what they put in host memory
        dp.override_bytes = c.user.bytes_to({CPU})
        dp.weights += dp.override_bytes - c.user.from_slots([*layers, n + 1] + ([n] if has_out else []))
    dp.experts = expert_host + sum(c.layer_experts[i] for i in layers)
    dp.kv = sum(c.layer_kv[i] for i in layers)
    dp.state = sum(c.layer_state[i] for i in layers)
    if n_used == 0:  # everything on the CPU: the whole graph on one device (one_device_peak), else as one device
        # holding every layer and the head by the derived models' peaks
        whole = c.one_device() if c.one_device and has_out and len(layers) == n else None
        dp.compute = whole or device_compute(c, _peaks(c, layers) if c.per_layer_slab else c.peaks, c.inputs,
                                             bool(layers), has_out, 1, pipeline=False)
    elif len(layers):  # it runs those layers (and experts' matmuls): their peak and one copy of the inputs
        # (no pipeline parallelism with CPU layers or tensor overrides)
        peaks = _peaks(c, [*layers, *moved], slabs=False)
        ins = c.inputs if any(c.info.swa_layers) else split_inputs(c, [*layers, *moved])  # iSWA: both masks
        dp.compute = peaks.layer_full + ins + (recurrent_split(c, layers, 1) if n_used else 0)
        if c.per_layer_slab:  # it runs layer 0 and the graph start
            dp.compute = inputs_mod.host_first_layer(c, dp.compute, ins, mixed=peaks is c.peaks)
        dp.compute += c.host_ffn if ffn else 0  # its layers' peak, then a spilled FFN's split (bounded above)
    elif moved or ffn:  # every graph input, one copy alive until its last split (all masks), and the experts' or the
        # dense FFN's matmuls (inputs.host_experts, inputs.host_ffn: one split at a time); the residual: the
        # embeddings sent, whose hole ggml-alloc does not fill
        freed = moved and c.host_experts_freed is not None and inputs_mod.mask_freed(c.info, counts, moved, n_used)
        exp = (c.host_experts_freed if freed else c.host_experts) if moved else 0
        both = set(moved) & set(ffn)  # a layer's routed and shared experts both here: maybe one split, both alive
        dp.compute = c.inputs + ((exp + c.host_ffn) if both else max(exp, c.host_ffn if ffn else 0)) + c.host_gathers
    else:  # the host builds the inputs of a split graph, and keeps the token ids (llm_graph_input_embd's
        # inp_tokens, I32 [n_ubatch]) that its own split reads
        copies = SCHED_COPIES if n_used > 1 and c.pipeline(0) else 1
        dp.compute = copies * (c.inputs + c.n_ubatch * 4) + c.resid + c.host_gathers
    dp.compute += c.logits
    dp.margin = HOST_MARGIN
    return dp


def estimate_tps(gpus: list[DevicePlan], host: DevicePlan, token_embd: int, expert_fraction: float = 1.0) -> float | None:
    """Decode tokens/s if each token reads every dense weight, expert_fraction (expert_used_count /
    expert_count) of each device's expert bytes, the attention layers' whole KV cache (a full context) and
    the recurrent state once, device after device at its memory bandwidth (the host's for the experts kept in
    CPU memory: decode batches of one token stay below the op-offload batch). An estimate, not a measurement."""
    secs = 0.0
    for dp in [*gpus, host]:
        read = dp.weights - dp.experts + int(dp.experts * expert_fraction) + dp.kv + dp.state \
            - (token_embd if dp is host else 0)  # embeddings: one row per token
        if read <= 0:
            continue
        if not dp.device.bandwidth:
            return None
        secs += read / (dp.device.bandwidth * (GPU_BANDWIDTH_SHARE if dp.device.kind == "gpu" else 1.0))
    return 1.0 / secs if secs > 0 else None
