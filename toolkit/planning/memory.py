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
from functools import cached_property

from . import compute as compute_mod
from . import cuda as cuda_mod
from .devices import Device
from .options import PlanOptions
from .plan import DevicePlan
from ..gguf.info import KV_PAD, ModelInfo, kv_cells
from ..gguf.info import layer_kv_bytes
from ..units import GiB, MiB, round_up

RPC_MARGIN = 32 * MiB  # rounding of llama.cpp's per-buffer alignment, measured on RPC workers
HOST_MARGIN = 1 * GiB  # the Python process, llama.cpp's own heap and the OS page cache for mmap
SCHED_COPIES = 4  # copies of graph inputs with pipeline parallelism (GGML_SCHED_MAX_COPIES)


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
    host_gathers: int = 0  # rows the host gathers for a split graph's devices beside the embeddings (compute.host_gathers)
    host_experts: int = 0  # the host's peak for one layer's routed experts in CPU memory (compute.host_experts)
    cache_inputs: tuple[int, int] = (0, 0)  # iSWA: one copy of the full and the sliding cache's mask and KV indices
    altup: tuple[int, int, int] = (0, 0, 0)  # Gemma 3n's split inputs (compute.altup_inputs)

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
        """Memo of device totals by (first slot, end slot, device index, device, CPU slots) for the search."""
        return {}

    @cached_property
    def _prefix(self) -> tuple[list[int], ...]:
        return tuple(list(itertools.accumulate(col, initial=0)) for col in
                     (self.layer_weights, self.layer_kv, self.layer_state, self.layer_experts))

    def with_cpu_experts(self, layers) -> Costs:
        """These costs with the experts of `layers` in CPU memory: those layers' device weights lose them.
        Any tensor override turns llama.cpp's pipeline parallelism off (`pipeline`)."""
        cpu = frozenset(layers)
        lw = [d + (0 if il in cpu else e) for il, (d, e) in
              enumerate(zip(self.info_dense, self.layer_experts))]
        return replace(self, layer_weights=lw, cpu_experts=cpu)

    @property
    def info_dense(self) -> list[int]:
        return [la.dense_bytes for la in self.info.layers]

    def pipeline(self, n_cpu_slots: int) -> bool:
        """llama_context: pipeline parallelism only when every layer is offloaded and no tensor is
        overridden (`!model.has_tensor_overrides()`)."""
        return n_cpu_slots == 0 and not self.cpu_experts


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
    return Costs(info, list(info.layer_bytes), layer_kv, [n_seq * la.state_bytes for la in info.layers], out_w, peaks,
                 inputs=mask + resid + idx,
                 resid=resid, n_ubatch=n_ubatch, inputs_recurrent=resid + position_inputs(info, n_ubatch),
                 logits=n_seq * info.n_vocab * 4,
                 # result_output f32 [n_vocab, outputs] (by default the reserve outputs every token) and up to
                 # 3 residual-sized tensors beside it (Phi-3-mini 4k-32k: 3; Llama-3: 1), measured on RPC
                 head=info.n_vocab * outputs * 4 + 3 * resid, flash_attn=flash_attn,
                 f16_cache=type_k == "f16" and type_v == "f16",
                 cuda=cuda_mod.layer_table(info, n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v,
                                           flash_attn=flash_attn) if cuda else None,
                 reserve=opts.reserve, layer_experts=[la.expert_bytes for la in info.layers],
                 recurrent_tails=recurrent_tails(info), mtp_layers=frozenset(il for il, la in enumerate(info.layers) if la.mtp),
                 host_gathers=compute_mod.host_gathers(src, n_ubatch),
                 host_experts=compute_mod.host_experts(src, info.n_expert_used, n_ubatch) if info.n_expert else 0,
                 cache_inputs=(full + per_cache, mask - full + per_cache) if any(info.swa_layers) else (0, 0),
                 altup=compute_mod.altup_inputs(src, n_ubatch))


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
    if type_k != "f16" and info.head_dim_k % 64 == 0:
        nrot = 64
        while info.head_dim_k % (nrot * 2) == 0:
            nrot *= 2
        per_cache += nrot * nrot * 4
    if type_v != "f16" and info.head_dim_v % 64 == 0:
        per_cache += 64 * 64 * 4
    return n_caches * per_cache + position_inputs(info, n_ubatch)


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
    dp.kv, dp.state = kv, state
    dp.cpu_experts = [il for il in layers if il in c.cpu_experts] if c.cpu_experts else []
    dp.cpu_expert_bytes = sum(c.layer_experts[il] for il in dp.cpu_experts)
    run = [il for il in layers if il not in c.mtp_layers] if c.mtp_layers else layers  # layers in the graph
    peaks = _peaks(c, run)
    if c.cpu_experts and n_used > 1:
        peaks = _moe_split_peaks(c, peaks, run)
    ins = _inputs(c, run)
    if n_used > 1 and c.altup[0]:  # Gemma 3n (compute.altup_inputs): the stacked streams where it holds layers, the
        # graph start's outputs on the first layer's device and on the output one (altup_proj runs there), else
        # each layer's per-layer input
        stack, start, per_layer = c.altup
        ins += (stack + (start if 0 in run else per_layer * len(run)) if len(run) else 0) + (start if has_output else 0)
    dp.compute = _device_compute(c, peaks, ins, bool(run), has_output, n_used,
                                 pipeline=c.pipeline(n_cpu_slots))
    dp.experts = experts - sum(c.layer_experts[i] for i in dp.cpu_experts)
    if n_used > 1 or n_cpu_slots:
        dp.compute += recurrent_split(c, layers, SCHED_COPIES if c.pipeline(n_cpu_slots) else 1)
    if dev.kind != "gpu":
        dp.margin = RPC_MARGIN
        return dp
    dp.margin = reserve(c, dev)
    if dev.backend == "cuda" and c.cuda is not None:
        t = c.cuda.terms(layers, has_output, first_cuda, n_cpu_slots, dp.margin, c.cpu_experts)
        dp.cuda_copies, dp.cuda_pool = t.compute, t.pool
    return dp


def _peaks(c: Costs, layers) -> compute_mod.ComputePeaks:
    """The compute peaks for a device holding `layers`, by the kinds of layer it holds."""
    if not c.peaks.by_kind:  # not a hybrid: one set of peaks (the search calls this thousands of times)
        return c.peaks
    return c.peaks.of({c.info.layers[il].kind for il in layers})


def _moe_split_peaks(c: Costs, peaks: compute_mod.ComputePeaks, layers) -> compute_mod.ComputePeaks:
    """A device's peaks in a split graph with experts in CPU memory (no pipeline parallelism): a measured
    rule, not a derived one (RPC devices, Qwen3-30B-A3B-shaped layers, 16k and 64k; scripts/accuracy.py --moe).

    - a device keeping the experts of at most one of its layers: the layers' steady peak, less the down
      projection's f32 result [n_embd, n_expert_used, n_ubatch] of build_moe_ffn (llama-graph.cpp), which
      the host computes for an overridden layer; never below the one-layer peak (plus two residuals when
      it keeps one). Real 64.0 / 76.5 MiB at 16k (experts of no / one layer kept), planned 80.5 / 88.5;
      112.0 / 112.0 at 64k, planned 120.0 (the steady peak alone: 104.0 and 152.0); keeping two or more,
      the steady peak;
    - the output device holds no second copy of its inputs: real 304.75 / 300.75 MiB, the one-device graph's
      output peak 304.75, planned the larger of it and the head's (308.75)."""
    down = c.info.n_embd * max(c.info.n_expert_used, 1) * c.n_ubatch * 4
    kept = sum(1 for il in layers if il not in c.cpu_experts and c.layer_experts[il])
    # two layers keeping their experts: the measured two-layer peak (16k: 100.0 real, 104.0 planned)
    # one layer keeping them: its one-layer peak with the residual-sized copies in and out of the host's
    # expert splits alive beside it (16k, q8_0: 84.1 real, one-layer peak 80.5, planned 88.5)
    steady = peaks.layer_steady if kept >= 2 else max(peaks.layer_steady - down,
                                                      peaks.layer_full + (2 * c.resid if kept else 0))
    return compute_mod.ComputePeaks(peaks.layer_full, peaks.output, steady, moe_split=True)


def _inputs(c: Costs, layers) -> int:
    """One copy of a device's split-graph inputs: a device holding layers but no attention receives no
    masks nor KV indices, only the residual and the position / output ids (hybrids' recurrent layers:
    their state-copy indices are a few bytes; Qwen3.5-shaped, 32k, f16: 6.0 MiB real, not 102); an iSWA
    model's device holding one kind of layer only that cache's mask and indices."""
    if not c.peaks.by_kind:  # one set of peaks: every layer attends (hybrids and iSWA measure kinds apart)
        return c.inputs
    kinds = {c.info.layers[il].kind for il in layers}
    if kinds and not any(c.info.layers[il].attention for il in layers):
        return c.inputs_recurrent
    return c.inputs - (c.cache_inputs[0] if kinds == {"sliding"} else c.cache_inputs[1] if kinds == {"attention"} else 0)


def recurrent_tails(info: ModelInfo) -> list[tuple[int, int]]:
    """The recurrent layers whose output tail another layer's state reads come before: (layer, reader) pairs.

    A recurrent layer (build_mamba2_layer, build_delta_net, build_shortconv_block) expands its state copies
    into the graph at once, but its output tail (Mamba-2: `ggml_cont(z)`, the gated norm, ssm_out) only
    when a later layer uses it. The next layer that expands anything is the one that pulls it in: an
    attention layer's Q/K/V depend on it, so the tail follows at once; a recurrent layer's
    llm_graph_context::build_rs first expands its state reads (scale, get_rows, cpy on its own RS buffer),
    which depend on nothing, so the tail comes after them. The scheduler's pass 2 ("expand gpu down",
    ggml_backend_sched_split_graph) gives each weightless node the backend of the node before it."""
    pairs = []
    for il, la in enumerate(info.layers):
        if not la.recurrent:
            continue
        reader = next((j for j in range(il + 1, info.n_layer) if info.layers[j].kind not in ("ffn", "mtp")), None)
        if reader is not None and info.layers[reader].recurrent:
            pairs.append((il, reader))
    return pairs


def recurrent_split(c: Costs, layers, copies: int) -> int:
    """What recurrent tails (recurrent_tails) whose reader is on another device add, as real loads on RPC
    workers show them (scripts/accuracy.py --hybrid) beside the other terms:

    - the reader's device runs the reader's state reads in a split of their own before the tail's split
      comes back to it: one residual-sized block more in its buffer (LFM2-2.6B's shapes: 4.0 MiB, one
      residual; measured, not derived);
    - Mamba-2: `ggml_cont(z)` is weightless, so it runs on the reader's device: that device receives the view
      `z` of ssm_in's output (its span: (n_ubatch - 1) rows of ssm_in plus d_inner) and the layer's device
      receives `ggml_cont(z)` back (f32 [d_inner, n_ubatch]), each in `copies` copies, plus one residual-sized
      tensor in the split that finishes the layer (measured). Tiny Granite-4-hybrid and Nemotron-H-shaped
      models, 16k: the reader's device 7.2-9.0 MiB above the other terms, the layer's 3.0-4.5; Nemotron-H-8B's
      shapes: the reader's 120.0-128.0 MiB, the layer's 60.1 (planned 72.0)."""
    if not c.recurrent_tails:  # the search calls this thousands of times
        return 0
    held, extra, mamba2 = set(layers), 0, bool(c.info.ssm_in_rows)
    for il, reader in c.recurrent_tails:
        if il in held and reader not in held and mamba2:
            extra += copies * c.info.ssm_d_inner * c.n_ubatch * 4 + c.resid
        elif reader in held and il not in held:
            extra += c.resid
            if mamba2:
                extra += copies * (c.info.ssm_d_inner + (c.n_ubatch - 1) * c.info.ssm_in_rows) * 4
    return extra


def _device_compute(c: Costs, peaks: compute_mod.ComputePeaks, inputs: int, has_layers: bool, has_output: bool,
                    n_used: int, pipeline: bool) -> int:
    """A device's compute buffer (scripts/underestimates.py checks each branch against llama.cpp on 37 cells).

    With several devices the graph is split and each device receives its split's inputs; with pipeline
    parallelism (llama_context: only when every layer is offloaded) it keeps SCHED_COPIES of them alive,
    else one. The steady peak already holds one copy."""
    if n_used <= 1:  # one device, no split: the graph's own peak, at the head or in the layers' steady state
        # (Phi-3-mini at 32k on the CPU: the layers' peak, 24 MiB above the one-layer model's)
        return max(peaks.output, peaks.layer_steady) if has_output else peaks.layer_steady
    copies = SCHED_COPIES if pipeline else 1
    if has_output and not has_layers:  # the output head alone: no attention, so no mask copies
        # the one-layer peak is its KQ matrix (flash attention off) or, where the head does not raise it
        # (small vocabularies: gpt-oss- and LFM2-shaped tiny models, 6.5 MiB real, 41 planned before), its
        # attention: neither is computed on this device
        if not c.flash_attn or peaks.output <= peaks.layer_full:
            return c.head + copies * c.resid  # Llama-3-8B 32k: 258.0 MiB real, 258.5 planned
        return peaks.output + 3 * c.resid  # measured on RPC devices (docs/accuracy-table.md)
    steady = peaks.layer_steady + (copies - 1) * inputs + compute_mod.held_input(peaks, c.resid, copies)
    if not has_output:
        return steady
    if peaks.moe_split:  # experts in CPU memory (_moe_split_peaks)
        return max(steady, c.head, peaks.output)
    head = c.head + copies * inputs
    if peaks.output <= peaks.layer_full:  # the head does not raise the one-layer peak
        return max(steady, head)
    # e.g. Mistral-Nemo-12B at 4k; with an f16 cache the output device keeps 3 residual-sized tensors
    # more (Mistral-Nemo-12B, 16k and 32k on 5 RPC devices: 18 MiB above the other terms in real loads)
    return max(steady, head, peaks.output + copies * inputs + (3 * c.resid if c.f16_cache else 0))


def host_cost(c: Costs, n_cpu_layers: int, n_used: int, cpu: Device) -> DevicePlan:
    """What the host needs with the first n_cpu_layers layer slots (llama.cpp keeps those on the CPU) and
    the experts of c.cpu_experts (tensor overrides to the CPU buffer type) of the layers on devices."""
    n = c.info.n_layer
    layers = range(0, min(n_cpu_layers, n))
    has_out = n_cpu_layers == n + 1
    dp = DevicePlan(cpu, list(layers) + ([n] if has_out else []))
    moved = sorted(il for il in c.cpu_experts if il >= len(layers))  # experts of device layers kept here
    dp.cpu_experts = moved
    dp.cpu_expert_bytes = expert_host = sum(c.layer_experts[i] for i in moved)
    dp.weights = c.info.token_embd_bytes + c.info.other_bytes + sum(c.info.layer_bytes[i] for i in layers) \
        + (c.info.output_bytes if has_out else 0) + expert_host
    dp.experts = expert_host + sum(c.layer_experts[i] for i in layers)
    dp.kv = sum(c.layer_kv[i] for i in layers)
    dp.state = sum(c.layer_state[i] for i in layers)
    if n_used == 0:  # everything on the CPU: as one device holding every layer and the head
        dp.compute = _device_compute(c, c.peaks, c.inputs, bool(layers), has_out, 1, pipeline=False)
    elif len(layers):  # it runs those layers (and experts' matmuls): their peak and one copy of the inputs
        # (no pipeline parallelism with CPU layers or tensor overrides)
        dp.compute = _peaks(c, [*layers, *moved]).layer_full + (c.inputs if any(c.info.swa_layers)  # both masks
                                                                 else _inputs(c, [*layers, *moved])) \
            + (recurrent_split(c, layers, 1) if n_used else 0)
    elif moved:  # every graph input, one copy alive until its last split (all masks), and the experts' matmuls
        # (compute.host_experts); the residual: the embeddings sent, whose hole ggml-alloc does not fill
        dp.compute = c.inputs + c.host_experts + c.host_gathers
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
        secs += read / dp.device.bandwidth
    return 1.0 / secs if secs > 0 else None
