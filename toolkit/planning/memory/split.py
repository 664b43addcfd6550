"""What a split graph adds to a device's compute buffer, beside the one-device peaks that llama.cpp measures on
derived models (`compute.py`): the copies of the split's inputs each device receives, the residual the scheduler
keeps alive with pipeline parallelism, recurrent tails read across devices, and experts in CPU memory.
Each term is read off llama.cpp's split graphs on RPC devices (GGML_SCHED_DEBUG) and checked by real loads
(docs/accuracy-table.md); `memory.device_cost` adds them up.
"""

from __future__ import annotations

from functools import lru_cache

from .compute import ComputePeaks
from ...errors import CtxqError
from ...gguf.info import ModelInfo, block_of
from ...gguf.once import file_stamp
from ...gguf.reader import read_gguf

# `c: Costs` below is memory.Costs (not imported: memory imports this module)
SCHED_COPIES = 4  # copies of graph inputs with pipeline parallelism (GGML_SCHED_MAX_COPIES)


def device_compute(c: Costs, peaks: ComputePeaks, inputs: int, has_layers: bool, has_output: bool,
                    n_used: int, pipeline: bool, layers=()) -> int:
    """A device's compute buffer (scripts/underestimates.py checks each branch against llama.cpp on 37 cells).

    With several devices the graph is split and each device receives its split's inputs; with pipeline
    parallelism (llama_context: only when every layer is offloaded) it keeps SCHED_COPIES of them alive,
    else one. The steady peak already holds one copy."""
    if peaks.one_layer and (has_output or pipeline):  # one-layer peaks hold only without either: the mixed ones
        peaks = moe_split_peaks(c, c.peaks, layers) if peaks.moe_split else c.peaks
    if n_used <= 1:  # one device, no split: the graph's own peak, at the head or in the layers' steady state
        # (Phi-3-mini at 32k on the CPU: the layers' peak, 24 MiB above the one-layer model's)
        return max(peaks.output, peaks.layer_steady) if has_output else peaks.layer_steady
    copies = SCHED_COPIES if pipeline else 1
    if has_output and not has_layers:  # the output head alone: no attention, so no mask copies
        # the one-layer peak is its KQ matrix (flash attention off) or, where the head does not raise it
        # (small vocabularies: gpt-oss- and LFM2-shaped tiny models, 6.5 MiB real, 41 planned before), its
        # attention: neither is computed on this device
        # Its split holds the residual received (`copies` copies), the output norm's result and result_output f32
        # [n_vocab, n_outputs] (llama4.cpp: build_norm, then build_lora_mm(model.output)): c.head with its
        # 3 residual-sized tensors bounds that (Llama-4-Scout's shapes, 4 layers, 64k, flash attention: 146.0
        # MiB real, 166.0 planned; the one-device graph's head peak, which also holds what its layer left
        # behind, gave 224.0)
        if copies == 1:  # no pipeline (experts in CPU memory, CPU layers): the received input is freed once
            # result_norm (MUL, in place) has read it, so result_output [n_vocab, n_outputs] and one residual-sized
            # tensor (GGML_SCHED_DEBUG, n_cpu_moe=2, 65536 q8_0: DeepSeek-V3's widths 110.00 MiB real, 152.00
            # planned before; Llama-4-Scout's 106.00 real, 136.00 before), and where the graph picks the output
            # rows after the norm (gemma4.cpp: get_rows(result_norm, inp_out_ids) on this device) a second one:
            # tiny Gemma 4 MoE, 3 devices, 64k q8_0, n_cpu_moe=2, 1.29 MiB real, 1.04 with one residual
            return c.head - c.resid
        if not c.flash_attn or peaks.output <= peaks.layer_full:
            return c.head + copies * c.resid  # Llama-3-8B 32k: 258.0 MiB real, 258.5 planned
        return min(peaks.output + 3 * c.resid, c.head + copies * c.resid)  # measured on RPC devices
    steady = peaks.layer_steady + (copies - 1) * inputs + held_input(peaks, c.resid, copies)
    if not has_output:
        return steady
    if peaks.moe_split:  # experts in CPU memory (moe_split_peaks)
        return max(steady, c.head, peaks.output)
    head = c.head + copies * inputs
    if peaks.output <= peaks.layer_full:  # the head does not raise the one-layer peak
        return max(steady, head)
    # e.g. Mistral-Nemo-12B at 4k; with an f16 cache the output device keeps 3 residual-sized tensors
    # more (Mistral-Nemo-12B, 16k and 32k on 5 RPC devices: 18 MiB above the other terms in real loads)
    return max(steady, head, peaks.output + copies * inputs + (3 * c.resid if c.f16_cache else 0)
               + held_at_head(c, peaks, layers, copies))


def held_input(peaks: ComputePeaks, resid: int, copies: int) -> int:
    """What a device holding layers but not the head keeps beyond `copies` of its split inputs and the
    one-device steady peak: the residual it receives. With pipeline parallelism (copies > 1) the scheduler
    flags every copy of a split's inputs as an output (ggml_backend_sched_split_graph, pass 5: "prevent
    ggml-alloc from overwriting the tensor"), so the copy in use stays alive through all the device's layers,
    where the one-device graph frees its layer input once the attention's residual add has read it: where the
    steady peak lies past the attention (`ComputePeaks.input_freed`), the device holds one residual more.
    Tiny SmolLM3, GLM-4.5, Llama 4 and Gemma 4 with flash attention at 16k and 64k on 2-3 RPC devices: 0.245 MiB
    (one residual, f32 [128, 512]) above the other terms on each such device; without flash attention 0.0."""
    return resid if peaks.input_freed and copies > 1 else 0


def held_at_head(c: Costs, peaks: ComputePeaks, layers, copies: int) -> int:
    """What the output device keeps at the head beyond the one-device output peak and its input copies: the
    residual it receives (held_input), where its first layer is an FFN-only layer and it holds attention (its
    inputs carry the mask). Such a layer reads its input at its very end (Nemotron-H's
    `nemotron_h_block_out = l_out + inpL`, GGML_SCHED_DEBUG: node #232 reads the split input), after its whole
    MoE working set; a device starting with an attention layer reads it at the attention's residual add. Measured
    on tiny Nemotron-H with experts, q8_0, flash attention, RPC devices, the output device's layers: 5-7 at 16k
    and 64k on [1,1] and [1,1,2] 0.25 MiB under without the term, exact with it; 3-7, 6-7 ([1,3], [1,2], [2,1],
    [1,1,1]) exact without it; 7 alone (no attention: [2,1,1], [1,2,1]) over already (+1.25, +0.50)."""
    if not layers or c.info.layers[layers[0]].kind != "ffn" or not any(c.info.layers[il].attention for il in layers):
        return 0
    return held_input(peaks, c.resid, copies)


def split_inputs(c: Costs, layers) -> int:
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


def moe_split_peaks(c: Costs, peaks: ComputePeaks, layers) -> ComputePeaks:
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
    # no layer with its experts in CPU memory: no host expert split interleaves with the device's own, whose steady
    # peak stands (GGML_SCHED_DEBUG, Llama-4-Scout's shapes, 64k q8_0, n_cpu_moe=2, 2:1:1: the device holding layer 3
    # alone runs one split; 104.09 MiB real, 114.17 its one-layer peak, 134.17 with two residuals)
    alone = kept and not any(il in c.cpu_experts for il in layers)
    steady = peaks.layer_steady if kept >= 2 or alone else max(peaks.layer_steady - down,
                                                               peaks.layer_full + (2 * c.resid if kept else 0))
    return ComputePeaks(peaks.layer_full, peaks.output, steady, moe_split=True, one_layer=peaks.one_layer)


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


@lru_cache(maxsize=64)
def shared_expert_layers(path: str, stamp: tuple | None = None) -> frozenset[int]:
    """Layers with a shared-expert FFN (blk.<il>.ffn_*_shexp tensors), read from the model's header; empty where the
    header cannot be read here (a Hub model's: recurrent_split then keeps the shared experts' rule, the smaller)."""
    try:
        g = read_gguf(path, skip_arrays=True)
    except (OSError, ValueError, CtxqError):
        return frozenset()
    return frozenset(il for t in g.tensors if "_shexp." in t.name and (il := block_of(t.name)) is not None)


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
      shapes: the reader's 120.0-128.0 MiB, the layer's 60.1 (planned 72.0);
    - a layer with routed experts: build_moe_ffn (llama-graph.cpp) expands its experts' result into the graph
      (ggml_build_forward_expand), and with it the mixer's whole output, so no `z` crosses. Its tail is what
      follows: with shared experts (ffn_*_shexp, weighted: Granite 4, Qwen3.5-MoE, Kimi-Linear) it comes back to
      the layer's device, one residual as above (tiny Granite-4-MoE, [2,1,1] at 16k without flash attention and
      at 64k: the reader's device 10.54 / 10.79 MiB planned before, 6.04 real, now 6.23 / 6.48); without
      (LFM2-MoE: the add of moe_out and the residual, weightless) it runs on the reader's device, which receives
      both operands, in `copies` copies (GGML_SCHED_DEBUG: `node_151` and `ffn_moe_out-3`; tiny LFM2-MoE, the
      reader's device 0.75 MiB under before at [1,1] 64k q8_0 and [2,1,1] 16k f16, 0.00 now)."""
    if not c.recurrent_tails:  # the search calls this thousands of times
        return 0
    held, extra, mamba2 = set(layers), 0, bool(c.info.ssm_in_rows)
    for il, reader in c.recurrent_tails:
        moe = bool(c.layer_experts and c.layer_experts[il])
        if il in held and reader not in held and mamba2 and not moe:
            extra += copies * c.info.ssm_d_inner * c.n_ubatch * 4 + c.resid
        elif reader in held and il not in held:
            weightless = moe and il not in shared_expert_layers(c.info.path, file_stamp(c.info.path))
            extra += copies * c.resid if weightless else c.resid
            if mamba2 and not moe:
                extra += copies * (c.info.ssm_d_inner + (c.n_ubatch - 1) * c.info.ssm_in_rows) * 4
    return extra


def reused_layer(info: ModelInfo, il: int) -> int | None:
    """The layer whose KV cache layer il reads, where it has none of its own (planning.facts: attention, no K width):
    the last layer before the shared ones with a cache of its kind, as llama-model.cpp's KV-reuse callback gives
    Gemma 3n and Gemma 4 (n_layer_kv_from_start - 2 for a sliding layer, - 1 for a full one)."""
    la = info.layers[il]
    if not (la.attention and la.k_width == 0):
        return None
    return next((j for j in range(il - 1, -1, -1) if info.layers[j].k_width and info.layers[j].sliding == la.sliding),
                None)


def shared_kv_reads(c: Costs, layers, copies: int) -> int:
    """The caches a device's KV-shared layers read on another device: each such layer's K and V views of the cache it
    reads arrive as split inputs of their own (a view of another backend's buffer is copied; GGML_SCHED_DEBUG lists
    cache_k_l2 and cache_v_l2 once for each of layers 5 and 6 reading layer 2), in each of the scheduler's copies.
    Tiny Gemma 4 with 4 of its 8 layers shared (upstream_models' gemma4-kvshare), 32k f16 on 2 RPC devices, the
    device holding layers 5-7 and the head: the rules 66.78 MiB under llama.cpp's real load without the term."""
    held = set(layers)
    return copies * sum(c.layer_kv[j] for il in layers if (j := reused_layer(c.info, il)) is not None and j not in held)

