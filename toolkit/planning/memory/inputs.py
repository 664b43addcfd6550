"""Graph inputs of a split graph that depend on the architecture: rows the host gathers from per-layer tables,
the host's split for experts in CPU memory, Gemma 3n's altup streams. Read off llama.cpp's split graphs on RPC
devices (GGML_SCHED_DEBUG's split inputs) and sized from the model's header.
"""

from __future__ import annotations

from dataclasses import replace

from .compute import ComputePeaks, _alternating, layer_groups
from ...gguf.info import ModelInfo
from ...gguf.reader import GGUFFile


# Input-layer tables besides token_embd whose rows the host gathers per token for every layer (LLM_TENSOR_LAYER_INPUT,
# GGML_OP_GET_ROWS in llama-arch.cpp): Gemma 3n's per-layer embeddings (llama_model_gemma3n::build_inp_per_layer).
_HOST_GATHERED = ("per_layer_token_embd.weight",)


def host_gathers(src: GGUFFile, n_ubatch: int) -> int:
    """Bytes the host's compute buffer holds for the rows it gathers from such tables and hands to the devices of a
    split graph: f32 [row width, n_ubatch] each (Gemma 3n's `inp_per_layer_selected`, [n_embd_altup * n_layer,
    n_ubatch]). Tiny Gemma 3n at 64k on 2 RPC devices: the host's compute 5.01 MiB above the plan without it,
    this tensor 5.0 MiB (GGML_SCHED_DEBUG's split inputs)."""
    return sum(t.shape[0] * n_ubatch * 4 for t in src.tensors if t.name in _HOST_GATHERED)


def host_ffn(src: GGUFFile, n_ubatch: int) -> int:
    """The host's compute-buffer peak for the dense FFN of one layer whose FFN tensors sit in host memory (a plan that
    spills weights, never the cache), the largest over the layers. The scheduler gives the host a split for the mul_mat
    ops whose weights are in a CPU buffer and the weightless activation between them (ggml_backend_sched_split_graph);
    build_ffn (llama-graph.cpp) shapes them, all f32: the split's input, the normed FFN input [n_embd, n_ubatch];
    gate and up [n_ff, n_ubatch] and their GLU (a fused gate_up: [2 n_ff, n_ubatch], then the GLU); the down
    projection's result [n_embd, n_ubatch]. A MoE's shared experts (`ffn_*_shexp`) are the same FFN. Their sum bounds
    ggml-alloc's peak over the split; the split referee's dry run gives the chosen plan llama.cpp's own figure."""
    peak = 0
    for t in src.tensors:
        if t.name.startswith("blk.") and t.name.endswith((".ffn_down.weight", ".ffn_down_shexp.weight")) \
                and len(t.shape) >= 2:
            n_ff, n_embd = t.shape[:2]
            peak = max(peak, (2 * n_embd + 3 * n_ff) * n_ubatch * 4)
    return peak


def host_experts(src: GGUFFile, n_expert_used: int, n_ubatch: int, hole: int = 0) -> int:
    """The host's compute-buffer peak for the routed experts of one layer whose expert tensors sit in CPU memory,
    the largest over the model's layers. The scheduler gives the host a split of its own for them
    (ggml_backend_sched_split_graph: the mul_mat_id ops whose weights are in a CPU buffer and the weightless
    activation between them; GGML_SCHED_DEBUG's splits); build_moe_ffn (llama-graph.cpp) shapes them, f32 but
    the ids: the split's inputs, the FFN input [n_embd, n_ubatch] and the selected experts (a view spanning the
    argsort, I32 [n_expert, n_ubatch]); three [n_ff_exp, n_expert_used, n_ubatch] tensors (gate, up and their
    GLU; or up and the activation's steps, as Nemotron-H's relu and sqr; a fused gate_up is two); the down
    projection's result [n_embd, n_expert_used, n_ubatch] (and its biased copy). Their sum bounds ggml-alloc's
    peak over the split; at real widths it is the peak, as no later tensor fits the hole an earlier one leaves
    (Qwen3-30B-A3B's widths, 2 RPC devices, n_cpu_moe=2, 16k and 64k: 72.25 MiB above the graph inputs, real
    and this); small ones reuse holes (tiny Qwen3.5-MoE at 64k: 1.02 MiB real, 1.77 this).

    `hole`: bytes of a graph input freed before these splits run (the attention mask, once the last device split
    that receives it has started: `mask_freed`). ggml-alloc's best fit prefers any free block that fits to the
    buffer's end (ggml_dyn_tallocr_alloc), so the split's tensors go into the hole in turn while one fits
    (_above_hole). Qwen3-30B-A3B's widths on one RPC device, its mask freed, the host's compute above the graph
    inputs: 16k f16 (hole 16 MiB) 68.0 real, 72.25 before, 68.0 with this; 32k q8_0 44.0, 72.25, 44.0; 64k q8_0
    32.0, 72.25, 32.0; 131072 q4_0 (the down projection fits the hole) 4.0, 72.25, 4.0. DeepSeek-V3's widths
    (65536 q8_0, 3 RPC devices, layer 1's experts on the host, with the planner passing the devices' slots):
    158.0 real (gate and up in the 64 MiB hole, the FFN input's copy above), 222.0 before, 176.0 with this (the
    input and gate in the hole, up above): 18 MiB over, not under.
    Separate gate and up without a down bias only (the cases measured); otherwise as without a hole."""
    names = {t.name for t in src.tensors}
    peak = 0
    for t in src.tensors:
        if not t.name.endswith(".ffn_down_exps.weight"):
            continue
        n_ff, n_embd, n_expert = t.shape[:3]
        biased = t.name.replace(".weight", ".bias") in names
        down = n_embd * n_expert_used * n_ubatch * 4 * (2 if biased else 1)
        glu = n_ff * n_expert_used * n_ubatch * 4  # gate, up and their GLU, each
        if hole and not biased and t.name.replace("down", "gate") in names:
            peak = max(peak, _above_hole(hole, [n_embd * n_ubatch * 4, n_expert * n_ubatch * 4, glu, glu, glu], down))
        else:
            peak = max(peak, (n_embd + n_expert) * n_ubatch * 4 + 3 * glu + down)
    return peak


def _above_hole(hole: int, sizes: list[int], down: int) -> int:
    """The bytes host_experts' split puts above the graph inputs where a free block of `hole` bytes lies among them:
    its inputs, gate, up and their GLU (`sizes`, in the order llama.cpp allocates them) each go into the hole's
    rest while it fits, else above; gate and up are freed before the down projection (`down` bytes), which goes into
    the hole's largest free run if it fits, else above what is still held there."""
    at, placed, top, held_above = 0, [], 0, []
    for i, size in enumerate(sizes):
        if size <= hole - at:
            placed.append((at, size, i in (2, 3)))
            at += size
        else:
            held_above.append((top, size, i in (2, 3)))
            top += size
    runs, run, end = [], 0, 0  # free runs of the hole once gate and up are freed
    for off, size, freed in placed + [(hole, 0, False)]:
        run = run + (off - end) + (size if freed else 0) if freed or off > end else run
        if not freed:
            runs.append(run)
            run = 0
        end = off + size
    if down <= max(runs, default=0):  # all of it in the hole but for the FFN input's copy, measured above the
        return max(top, sizes[0])  # inputs there (Qwen3-30B-A3B's widths at 131072 q4_0: 4.0 MiB real)
    # what stays above: up to the last tensor held there (a freed one at the top merges with the buffer's end)
    kept = max((off + size for off, size, freed in held_above if not freed), default=0)
    return max(top, kept + down)


def moe_split_layer_full(c, peaks: ComputePeaks, layers) -> ComputePeaks:
    """The one-layer peak of a device in a split graph with experts in CPU memory (the floor of
    split.moe_split_peaks), from the one-device derived model's (`peaks.layer_full`), as ggml-alloc places them
    (traced through an eval callback: each node's offset in the device's compute buffer):

    - less the embeddings input llm_graph_context::build_inp_embd makes beside the token ids: inp_embd f32
      [n_embd_inp, n_ubatch], a graph leaf no node reads (ggml_build_forward_select), which ggml-alloc allocates
      first and never frees (ggml_gallocr_alloc_graph_impl) and the scheduler assigns to the CPU with the other graph
      inputs: the one-device graph holds it under all its tensors, a device never. DeepSeek-V3's widths, layers 0-1
      on one RPC device with layer 1's experts on the host, 1k-64k q8_0: the CPU graph's tensors sit 14.0 MiB
      (one residual) above the device's from the first layer on; the device 383.01 / 431.01 MiB real at 16k / 64k,
      424.01 / 472.01 planned before, 410.01 / 458.01 with this (the other 27 MiB: the device receives the
      embeddings at its buffer's start, so its first layer's residual goes back there, under its second layer's
      attention, where the CPU graph's lands mid-buffer);
    - plus the down projection's copy where the device's first layer with experts on the host comes before its
      first attention layer: its split then ends at that layer's router, and the mask arrives only with the next
      split, whose first input is the down projection's result (a split's input copies are nodes allocated at its
      start, ggml_backend_sched_split_graph, without pipeline parallelism): the mask lands above it and the first
      split's live tensors, where the one-device graph allocates the mask before any node. Tiny Nemotron-H with
      experts, 3 RPC devices, the first holding layers 0-4 (Mamba-2, MoE on the host, Mamba-2, attention,
      Mamba-2): 6.2522 / 66.2522 MiB real at 4k / 64k q8_0, 6.16 / 66.16 planned before, 6.41 / 66.41 with this.
    `c` is memory.Costs."""
    full = peaks.layer_full - c.resid
    host = next((il for il in layers if il in c.cpu_experts and c.layer_experts[il]), None)
    attn = next((il for il in layers if c.info.layers[il].attention), None)
    if host is not None and attn is not None and host < attn:
        full += c.info.n_embd * max(c.info.n_expert_used, 1) * c.n_ubatch * 4  # f32 [n_embd, n_expert_used, n_ubatch]
    return replace(peaks, layer_full=full)


def altup_inputs(src: GGUFFile, n_ubatch: int) -> tuple[int, int, int]:
    """Gemma 3n's split inputs beside the residual and the masks, as GGML_SCHED_DEBUG lists them (tiny Gemma 3n,
    64k, 2 RPC devices): altup's stacked streams f32 [n_embd, n_ubatch, altup.num_inputs] and their permuted copy;
    the graph start's outputs (the gathered per-layer rows, host_gathers, and the scaled embeddings); one layer's
    per-layer input f32 [embedding_length_per_layer_input, n_ubatch]. Zeros for a model without altup."""
    n_altup = src.arch_get("altup.num_inputs")
    per_layer = int(src.arch_get("embedding_length_per_layer_input", 0) or 0) * n_ubatch * 4
    if not n_altup:
        # Gemma 4's E models: per-layer inputs without altup. GGML_SCHED_DEBUG (gemma4-6l at real widths, 3 RPC
        # devices): the first layer's device receives inp_per_layer whole (`(reshaped)`, the host's gathered rows,
        # which project_per_layer_inputs reads there), each other device its layers' views of it; the output
        # device only the norm and out_ids (no altup_proj)
        return (0, host_gathers(src, n_ubatch), per_layer) if per_layer else (0, 0, 0)
    resid = int(src.arch_get("embedding_length")) * n_ubatch * 4
    return 2 * int(n_altup) * resid, host_gathers(src, n_ubatch) + resid, per_layer


def altup_device(altup: tuple[int, int, int], run, has_output: bool) -> int:
    """Gemma 3n's split inputs (altup_inputs) on a device of a split graph running the layers `run`: the stacked
    streams where it holds layers, the graph start's outputs on the first layer's device and on the output one
    (altup_proj runs there), else each layer's per-layer input."""
    stack, start, per_layer = altup
    return (stack + (start if 0 in run else per_layer * len(run)) if len(run) else 0) + (start if has_output and stack else 0)


# f32 [n_embd_altup, n_layer, n_ubatch] tensors alive together where project_per_layer_inputs (gemma3n.cpp) runs:
# CPU dry runs of tiny Gemma 3n's derived models (64k, q8_0, flash attention) of 2, 4, 6 and 10 layers peak at
# 69.55, 73.52, 77.52 and 85.52 MiB, 2.0 MiB per layer = 4 slices f32 [256, 512].
PER_LAYER_SLABS = 4


def per_layer_slabs(src: GGUFFile, n_ubatch: int) -> int:
    """Bytes of one layer's slice of the graph start's per-layer slabs, f32 [n_embd_altup, n_ubatch].
    build_inp_per_layer and project_per_layer_inputs (gemma3n.cpp) shape the slabs over the model's n_layer, where a
    derived model (derived.write_derived) cuts per_layer_token_embd and per_layer_model_proj to the layers it keeps:
    its dry run's peak misses (n_layer - kept) slices of each. Zero for a model without per-layer inputs."""
    t = next((t for t in src.tensors if t.name in _HOST_GATHERED), None)
    return t.shape[0] // int(src.arch_get("block_count")) * n_ubatch * 4 if t else 0


def derived_layers(info: ModelInfo, mixed: bool) -> tuple[int, int]:
    """Layers in compute.compute_peaks' one-layer and steady derived models: one of each kind and those of
    compute._alternating (mixed peaks), or one and two of one kind (a kind's own peaks)."""
    if not mixed:
        return 1, 2
    groups = layer_groups(info)
    return len(groups), len(_alternating(info, tuple(sorted(il for ils in groups.values() for il in ils[:2]))))


def first_layer_peaks(peaks: ComputePeaks, info: ModelInfo, slab: int, mixed: bool) -> ComputePeaks:
    """The layers' peaks of the device running layer 0 with the PER_LAYER_SLABS slabs its derived models cut
    (per_layer_slabs, `slab` bytes per layer and slab). The head's peak is left: the slabs are freed by then.
    Tiny Gemma 3n on RPC devices, the first one's compute: 64k q8_0 (2 devices) and 64k f16 (3) 303.10 MiB real,
    291.33 planned before, 303.33 with this (305.33 with altup_steady's held stack); 16k f16 without flash attention
    (3) 304.07 real, 292.81 before, 304.81 (306.81): its steady peak lies in the attention on the CPU, at the graph
    start on the device, so this is a bound there."""
    one, two = derived_layers(info, mixed)
    return replace(peaks, layer_full=peaks.layer_full + (info.n_layer - one) * PER_LAYER_SLABS * slab,
                   layer_steady=peaks.layer_steady + (info.n_layer - two) * PER_LAYER_SLABS * slab)


def altup_steady(c, peaks: ComputePeaks, run, has_output: bool, copies: int) -> int:
    """What Gemma 3n's devices of a split graph hold beyond the steady peak and copies of their split inputs
    (altup_device), at the steady peak of a device holding layers, as GGML_SCHED_DEBUG lists its split inputs:
    - the layer input received: not the residual alone (split.held_input) but `l_out` [n_embd, n_ubatch, n_altup],
      its permuted copy and the active stream's view; with pipeline parallelism every copy stays alive through the
      device's layers (held_input's reason), where the one-device graph frees the stack at altup_predict;
    - the output device, not running layer 0, receives the per-layer rows it scales (inp_per_layer_selected) the
      model's n_layer wide, where its steady peak's derived model holds them at its kept layers' width; and each
      of its layers' per-layer input (a view of inp_per_layer), held as the stack is. With layers on the CPU (one
      copy, nothing held) the rows alone: layers 1-9 and the head on one RPC device, 16k and 64k f16 without flash
      attention, 168.26 / 648.26 MiB real, 166.52 / 646.52 before, 169.52 / 649.52 with this.
    Tiny Gemma 3n on RPC devices, compute: the middle device of 3 at 64k f16 22.54 MiB real, 21.56 planned before,
    23.56 with this; at 16k f16 without flash attention 34.05, 33.53 before, 35.53. The output device without
    flash attention (the head does not dominate): holding layer 9 (3 devices, 16k) 291.06 real, 287.54 before,
    293.04; layers 3-9 (split 1:3, 16k) 311.80, 303.31, 311.81; layers 6-9 (1:1, 64k) 1073.80, 1066.81, 1073.81.
    `c` is memory.Costs."""
    if not c.altup[0] or not len(run):
        return 0
    last = has_output and 0 not in run
    held = c.altup[0] + (len(run) * c.altup[2] if last else 0) if peaks.input_freed and copies > 1 else 0
    return held + ((c.info.n_layer - derived_layers(c.info, peaks is c.peaks)[1]) * c.per_layer_slab if last else 0)


def host_first_layer(c, compute: int, ins: int, mixed: bool) -> int:
    """The host's compute when it runs layer 0 itself (layers left on the CPU), from `compute`, its one-layer peak
    and one copy of the graph inputs `ins`: no split inputs held in copies here, so the larger of the layer's peak
    with inp_per_layer (the slab every layer reads) at the model's width, and the graph start's PER_LAYER_SLABS
    slabs at that width beside the inputs. Tiny Gemma 3n, 16k f16 without flash attention, layers 0-3 on the CPU
    and the rest on one RPC device: the host's compute 53.46 MiB real, 49.46 planned before, 54.76 with this
    (first_layer_peaks' bound: 67.46). `c` is memory.Costs."""
    one = derived_layers(c.info, mixed)[0]
    n, slab = c.info.n_layer, c.per_layer_slab
    return max(compute + (n - one) * slab, ins + PER_LAYER_SLABS * n * slab)


def mask_freed(info, counts, moved, n_used: int) -> bool:
    """Whether the host's attention mask is freed before the split of every expert layer in CPU memory (`moved`),
    every layer on a device: each device's split that receives the mask holds a dependency on it (ggml-backend's
    input_dep) until it starts, and the last such split is the first of the device holding the last attention layer.
    It starts before the host's expert split of any layer on or after that device's first layer: always with one
    device; with several, where the caller gives their layer slots (`counts`), else not assumed."""
    last = max((il for il, la in enumerate(info.layers) if la.attention), default=None)
    if last is None:
        return False
    if n_used == 1:
        return True
    if not counts:
        return False
    start = 0
    for k in counts:
        if start <= last < start + k:
            return start <= min(moved)
        start += k
    return False
