"""Compute-buffer sizes, from llama.cpp's own graph allocator.

A compute buffer is the peak of ggml-alloc's allocation over a worst-case graph: it depends on the
graph's shapes in ways no short formula captures (in-place reuse, fused ops, per-architecture graphs).
So ctxq asks llama.cpp: it writes a *derived* model, the same architecture keys and the same tensors
for one layer of each kind (full attention, sliding window) with the data region left as a sparse
hole, and makes a dry-run context (`no_alloc`) on the CPU backend. That takes milliseconds and
gives the exact peak of one device's graph (`ComputePeaks`):

- `layer_full`: a device holding layers but not the output head (vocabulary cut to 256; full and
  sliding-window layers measured together in one derived model);
- `output`: the device holding the output head (the real vocabulary).

In a split graph devices also hold copies of the graph inputs; `memory.device_cost` adds those.
Results are cached per (model, parameters), in memory and on disk under ctxq's cache (`_dry_run`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from ...errors import CtxqError, LlamaAborted
from ...gguf.info import RECURRENT_RULES, ModelInfo, kv_cells
from ...gguf.reader import GGUFFile
from ..derived import (_PER_LAYER_DIM, MIN_LAYERS, SHARED_KV_KEY, LayerFlags, first_shared, load_error, model_path,
                       with_reuse_targets, write_derived)

log = logging.getLogger(__name__)


_notes: dict[str, set[str]] = {}  # per model file: the fallbacks its plans took (notes_for)


def notes_for(src: GGUFFile) -> list[str]:
    """Lines for the plan of `src` on fallbacks its compute took (a derived model llama.cpp aborted on)."""
    return sorted(_notes.get(str(src.path), ()))


@dataclass(frozen=True)
class ComputePeaks:
    """Bytes of the compute buffer for one device, by what it holds."""

    layer_full: int  # a device holding layers but not the output head (full and SWA layers measured together)
    output: int  # the device that also holds the output head (peak over its layers and the head)
    layer_steady: int  # like layer_full, with two layers of each kind: the graph inputs stay alive across layers
    # hybrid models: the same peaks measured on layers of one kind alone, for a device holding only that kind
    by_kind: dict[str, ComputePeaks] = field(default_factory=dict, compare=False)
    moe_split: bool = False  # a device's peaks in a split graph with experts in CPU memory (split.moe_split_peaks)
    # the steady peak lies past the first layer's attention, where the one-device graph has freed the embeddings
    # that a device receives as its input (held_input, _input_freed)
    input_freed: bool = False
    # measured on the model's only layer of its kind (_full_only): a one-layer graph frees the split inputs after
    # that layer, as a device's split does without pipeline parallelism; with it (the inputs kept alive) or with the
    # head, where they were not measured to hold, split.device_compute takes the mixed peaks instead
    one_layer: bool = False

    def of(self, kinds: set[str]) -> ComputePeaks:
        """The peaks of a device holding layers of these kinds: its kind's own, or the largest of its
        kinds' for layers without attention; else the peaks of all kinds together (an upper bound)."""
        if not kinds or not kinds <= self.by_kind.keys():
            return self
        if len(kinds) > 1 and any(k != "recurrent" and k != "ffn" for k in kinds):
            return self  # attention with other kinds: measured together (Nemotron-H-shaped: 0.3 MiB above the max)
        # layers without attention run one after another: the peak is the largest of their kinds' (Nemotron-H-
        # shaped MLP and Mamba-2 layers: 17.83 MiB real on an RPC device, 17.85 planned, 40.9 with all kinds)
        got = [self.by_kind[k] for k in kinds]
        if len(got) == 1:
            return got[0]
        return ComputePeaks(max(p.layer_full for p in got), max(p.output for p in got),
                            max(p.layer_steady for p in got), input_freed=any(p.input_freed for p in got))


@lru_cache(maxsize=256)
def _dry_run(path: str, n_ctx: int, n_ubatch: int, n_batch: int, type_k: str, type_v: str, flash_attn: bool) -> int:
    """llama.cpp's compute buffers for the model at `path` in a CPU dry run (accounting.dry_run_compute)."""
    from ...llama.accounting import dry_run_compute

    return dry_run_compute(path, n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch, type_k=type_k, type_v=type_v,
                           flash_attn=flash_attn)


def compute_peaks(src: GGUFFile, info: ModelInfo, *, n_ctx: int, n_ubatch: int, n_batch: int,
                  type_k: str, type_v: str, flash_attn: bool) -> ComputePeaks:
    """Peaks of one device's compute buffer, measured on llama.cpp's CPU backend in a dry run.

    The derived models hold the first layer (and for the steady peak the first two layers) of each kind
    in `info.layers` (full attention, sliding window, recurrent, MLP-only), in file order: their peak
    stands for a device holding any mix of the kinds, an upper bound for a device holding fewer.
    Architectures with sliding windows build an iSWA graph that needs both kinds present
    (llama_model::build_graph asserts is_swa_any), and hybrids a graph over both memories."""
    by_kind: dict[str, list[int]] = {}
    for il, la in enumerate(info.layers):
        if not la.mtp:  # unloaded NextN blocks are not in the graph
            by_kind.setdefault(la.kind, []).append(il)
    groups = layer_groups(info)
    args = (n_ctx, n_ubatch, n_batch, type_k, type_v, flash_attn)
    freed = _input_freed(src, info, flash_attn)
    mixed = replace(_peaks(src, info, list(groups.values()), args), input_freed=freed)
    if len(by_kind.get("sliding", ())) >= 2 and not any(info.recurrent_layers):
        # a device whose layers all slide (or chunk) has no full-attention KQ nor full mask: measured alone
        # (SLIDING_ONLY in tests/test_arch_matrix.py; two sliding layers give its steady peak)
        sliding = _shared_apart(info, [by_kind["sliding"]])
        kinds = {"sliding": replace(_peaks(src, info, sliding, args, False), input_freed=freed)}
        if "attention" in by_kind and (full := _full_only(src, info, by_kind, args, mixed)) is not None:
            kinds["attention"] = full
        return replace(mixed, by_kind=kinds)
    if not any(info.recurrent_layers) or len(by_kind) == 1:
        return mixed
    # Hybrids: a device holding only recurrent layers has no attention (and no KQ matrix without flash
    # attention), so each kind is measured alone too. Sliding-window models are not split by kind: their
    # iSWA graph needs both kinds present.
    # A kind with one layer in the model has no two-layer steady peak: its one-layer graph frees the graph
    # inputs after that layer, where a device holding it keeps them as split inputs (Qwen3.5-9B's shapes,
    # its one attention layer alone on an RPC device at 64k: 376.1 MiB real, 332.1 from the attention-only
    # model). Such an attention kind is left to the peaks of all kinds together (ComputePeaks.of).
    kinds = {k: _peaks(src, info, [ils], args) for k, ils in by_kind.items()
             if len(ils) >= 2 or k in ("recurrent", "ffn")}  # their only split input is the residual
    kinds = {k: replace(p, input_freed=freed) for k, p in kinds.items()}
    return ComputePeaks(mixed.layer_full, mixed.output, mixed.layer_steady, by_kind=kinds, input_freed=freed)


def layer_groups(info: ModelInfo) -> dict[tuple[str, bool], list[int]]:
    """The layers in the graph (unloaded NextN blocks left out) by kind, dense and expert layers of a kind apart:
    the mixed peaks' derived models hold the first (and first two) of each group."""
    groups: dict[tuple, list[int]] = {}
    for il, la in enumerate(info.layers):
        if not la.mtp:
            groups.setdefault((la.kind, la.expert_bytes > 0, _kv_shared(info, il)), []).append(il)
    return groups


def _kv_shared(info: ModelInfo, il: int) -> bool:
    """Layer il reads another layer's KV cache (planning.facts: attention without a cache of its own), where a derived
    model can keep that (derived.SHARED_KV_KEY). Such layers compute apart from the ones they read: Gemma 4 E2B/E4B's
    have no K/V projections and MLPs twice as wide (use_double_wide_mlp), so a derived model keeps one of each kind."""
    la = info.layers[il]
    return info.arch in SHARED_KV_KEY and la.attention and la.k_width == 0


def _shared_apart(info: ModelInfo, groups: list[list[int]]) -> list[list[int]]:
    """`groups` with their KV-shared layers (_kv_shared) as groups of their own."""
    out = []
    for ils in groups:
        out += [g for g in ([il for il in ils if not _kv_shared(info, il)], [il for il in ils if _kv_shared(info, il)])
                if g]
    return out


def _peaks(src: GGUFFile, info: ModelInfo, groups: list[list[int]], args: tuple, mix: bool = True) -> ComputePeaks:
    """The peaks of derived models holding the first (and for the steady peak the first two, steady_layers) layers of
    each group (mix: sliding and full layers alternating, _alternating)."""
    one = tuple(sorted(ils[0] for ils in groups))
    two = tuple(sorted(il for ils in groups for il in ils[:steady_layers(info, ils)]))
    two = _alternating(info, two) if mix else two
    head = _ends_like_model(groups, one)
    if len(one) < MIN_LAYERS.get(info.arch, 1):  # the two-layer model's peak bounds the one layer's
        one, head = two, two if len(head) < 2 else head
    # KV-shared layers kept: with the layers whose caches they read in llama.cpp's KV-reuse callback
    first, sliding = first_shared(src), [la.sliding for la in info.layers]
    one, two, head = (with_reuse_targets(ls, sliding, first) for ls in (one, two, head))
    try:
        if any(info.swa_layers) and not _keeps_window(write_derived(src, one, True, _flags(info, one)), args):
            raise CtxqError("the derived model has no sliding window")  # EXAONE 4: only with 64 layers
        full = _dry_run(str(write_derived(src, head, False, _flags(info, head))), *args)
        layer = _dry_run(str(write_derived(src, one, True, _flags(info, one))), *args)
        # A one-layer graph frees its inputs after its only layer; a device holding many layers keeps them
        # alive from one layer to the next, so its steady peak is measured on two layers of each kind.
        steady = _dry_run(str(write_derived(src, two, True, _flags(info, two))), *args)
    except CtxqError as e:
        # a derived model llama.cpp refuses (hparams that depend on the layer count or on layers left out):
        # the real header's own compute buffer, the peak of every layer and the head, stands for each
        log.info("derived model refused (%s); compute from the real header", e)
        if isinstance(e, LlamaAborted):  # a header ctxq wrote that llama.cpp was not written for: say so
            _notes.setdefault(str(src.path), set()).add(
                f"llama.cpp aborted on a derived model of this {src.arch} ({e.reason}): compute buffers from the "
                "whole model's dry run, an upper bound")
        try:
            whole = _dry_run(model_path(src), *args)
        except CtxqError as e2:
            if (err := load_error(src, e2)) is e2:
                raise
            raise err from e2
        return ComputePeaks(layer_full=whole, output=whole, layer_steady=min(whole, _headless(src, info, args)))
    return ComputePeaks(layer_full=layer, output=full, layer_steady=steady)


def steady_layers(info: ModelInfo, ils: list[int]) -> int:
    """Layers of a group in the steady peak's derived model: two, three of a group with routed experts. A device
    running several MoE layers places the second one's experts above its router's small results (probs and argsort
    f32 [n_expert, n_ubatch], the selected weights), so that layer's residual, held through the next attention, lands
    36 KB higher (an eval callback's node offsets, tiny DeepSeek-V2-Lite, 14 layers on an RPC device at 4k-64k f16:
    13.4 KB under with two); the derived model's last layer frees the mask and fills its hole instead, so the two-layer
    model never shows it. Its peak with three layers is 31 KB above two, with four to six as with three."""
    return 3 if info.layers[ils[0]].expert_bytes else 2


def _ends_like_model(groups: list[list[int]], one: tuple[int, ...]) -> tuple[int, ...]:
    """The output peak's layers: `one`, with the group of the model's last layer represented by that layer, so
    that the head follows a layer of the kind it follows in the model. ggml-alloc frees each graph input after
    its last reader (ggml_gallocr_alloc_graph_impl), and the head's result_output lands above the holes left
    before it: after an attention layer the mask's hole is not yet reusable. Tiny Nemotron-H with experts (its
    last layer an FFN, layers 0, 1, 3 ending in attention): 112.51 MiB at 16k, 160.51 at 64k q8_0; the whole
    model and layers 0, 3, 7: 96.75 at both (the CPU alone 15.8 MiB over, the output device of 2 RPC 63.5)."""
    last = max(ils[-1] for ils in groups)
    tail = next(ils for ils in groups if ils[-1] == last)
    if len(groups) < 2 or tail[0] == max(one):
        return one
    return tuple(sorted(last if ils is tail else ils[0] for ils in groups))


def _headless(src: GGUFFile, info: ModelInfo, args: tuple) -> int:
    """The steady peak of a device holding layers but not the head, for a model whose derived models llama.cpp
    refuses: a copy of the whole model with the vocabulary cut to _SMALL_VOCAB, so that its peak lies in the
    layers, not at result_output (f32 [n_vocab, n_ubatch]); the real header's peak when that is refused too.
    Tiny EXAONE 4 (64 layers: exaone4.cpp's window only at n_layer == 64) at 64k with flash attention, its
    49k vocabulary's head 96 MiB: the devices without the head 26.2 MiB over llama.cpp from the real header's
    peak (rpc2 q8_0 RPC0 395.57 MiB planned, 369.33 real; rpc3 f16 RPC0 468.76 / 442.51, RPC1 385.33 / 359.09),
    0.01-0.02 over with this one (the output device unchanged, 0.49 over)."""
    layers = tuple(il for il, la in enumerate(info.layers) if not la.mtp)
    try:
        return _dry_run(str(write_derived(src, layers, True)), *args)
    except CtxqError as e:
        log.info("small-vocabulary copy refused (%s)", e)
        return _dry_run(model_path(src), *args)


def _full_only(src: GGUFFile, info: ModelInfo, by_kind: dict[str, list[int]], args: tuple,
               mixed: ComputePeaks) -> ComputePeaks | None:
    """The peaks of an iSWA model's device whose layers are all full attention (None: not measurable).

    llama.cpp's iSWA graph needs a sliding layer (llama_model::create_memory asserts is_swa_any), so the
    derived models hold the full layers first and one sliding layer last: the sliding cache's inputs (its
    mask and KV indices, graph inputs that ggml-alloc places before any node and frees after their last
    reader, ggml_gallocr_alloc_graph_impl) are then alive at every layer's peak, and are taken off (where
    the sliding layer's peak is the larger, what is left still bounds the full layers'). A full-only device
    receives neither (split.split_inputs). Tiny OLMo 3 / Cohere2 / Llama 4 at 16k, flash attention off,
    3 RPC devices, the output device holding one full layer: planned 284.57 / 285.07 / 293.23 MiB at the
    mixed peak, llama.cpp 274.81 / 274.80 / 275.30; with these peaks 275.06 / 275.56 / 275.73."""
    fulls, sliding = by_kind["attention"], by_kind["sliding"][0]
    if any(src.tensor(n) is not None for n in _PER_LAYER_DIM):
        # Gemma 3n's derived models hold only their own layers' per-layer input slabs (GEMMA3N in
        # tests/test_arch_matrix.py: that device is under already)
        return None
    # one full layer: no two-layer steady peak, and a one-layer graph frees the inputs that a device keeps with
    # pipeline parallelism (Llama-4-Scout's shapes, 4 layers, 64k: its device 28 MiB under); without it the split
    # frees them too (ComputePeaks.one_layer)
    one, two = (fulls[0], sliding), (*fulls[:2], sliding) if len(fulls) >= 2 else (fulls[0], sliding)
    n_ctx, n_ubatch, flash_attn = args[0], args[1], args[5]
    try:
        if not _keeps_window(write_derived(src, one, True, _flags(info, one)), args):
            return None  # EXAONE 4: the mixed peaks are the real header's (_peaks)
        out, layer, steady = (_dry_run(str(write_derived(src, ls, small, _flags(info, ls))), *args)
                              for ls, small in ((one, False), (one, True), (two, True)))
    except CtxqError as e:  # a derived model llama.cpp refuses: the mixed peaks stand for it
        log.info("full-only derived model refused (%s)", e)
        return None
    # one copy of the sliding cache's inputs: its mask [window cells, n_ubatch] (f16 with flash attention, else
    # f32) and KV indices, I64 [n_ubatch] for K and for V, [n_ubatch * n_embd_v_gqa_max] when V is transposed
    # (flash attention off; llama_kv_cache::build_input_v_idxs); a quantized cache's rotations, a few KiB
    # (memory.index_inputs), are left in: kept, they can only raise the plan
    v_rows = 1 if flash_attn else max(info.n_embd_v_gqa(il) for il in range(info.n_layer))
    held = kv_cells(info, n_ctx, n_ubatch, sliding) * n_ubatch * (2 if flash_attn else 4) + n_ubatch * 8 * (1 + v_rows)
    # at the head the sliding inputs are freed, so its peak is kept whole, unless the head does not raise the
    # one-layer peak (split.device_compute then plans the head from its own terms)
    raised = out > layer
    layer, steady = min(layer - held, mixed.layer_full), min(steady - held, mixed.layer_steady)
    out = out if raised else layer
    # without flash attention the steady peak is the full layer's KQ matrix, in the device's first layer
    if len(fulls) < 2:
        # the model's only full layer, on a device whose split frees its inputs after it (experts in CPU memory, n_cpu_moe=2,
        # GGML_SCHED_DEBUG: Llama-4-Scout's shapes, 64k q8_0, 2:1:1, the device holding layer 3 alone: 104.09 MiB real,
        # 190.68 planned from the mixed peaks, whose derived model runs a chunked layer first; 134.17 from these)
        return ComputePeaks(layer, mixed.output, layer, input_freed=flash_attn and mixed.input_freed, one_layer=True)
    return ComputePeaks(layer, out, steady, input_freed=flash_attn and mixed.input_freed)


def _input_freed(src: GGUFFile, info: ModelInfo, flash_attn: bool) -> bool:
    """ComputePeaks.input_freed: the steady peak lies past the first layer's attention. With flash attention
    it lies in the FFN, except for MLA (its absorbed query keeps it in the attention); without, it is the KQ
    matrix of the widest attention, past the first layer where that layer slides (a full layer's KQ over n_ctx
    cells, later: tiny OLMo 3, 16k, 3 RPC devices: one residual under without the term; Gemma 4 then one over)."""
    if flash_attn:
        return src.arch_get("attention.kv_lora_rank") is None
    first = next((la for la in info.layers if la.attention), None)
    return first is not None and first.sliding


def _alternating(info: ModelInfo, two: tuple[int, ...]) -> tuple[int, ...]:
    """The steady model's layers with its sliding and full-attention ones alternating (sliding, full, sliding,
    full in file order, where the model has them), so that each attention layer's peak has both masks alive,
    as on a device holding layers of both kinds with more after them. First two of each kind (Gemma 4's
    s s f s s f: 0 1 2 5) leave no sliding layer after the full ones, which freed the window's mask (f32
    [window cells, n_ubatch], flash attention off) before the full layers' KQ peak: tiny Gemma 4 at 16k, 3 RPC
    devices, 1.5 MiB under on each device holding layers; OLMo 3 1.0."""
    if not any(info.swa_layers):
        return two
    kinds = ("sliding", "attention")
    seq, want = [], None
    for il, la in enumerate(info.layers):
        if la.kind in kinds and la.kind != want and len(seq) < 4:
            seq.append(il)
            want = la.kind
    if len(seq) < 4:  # the model's layers do not alternate that often: the first two of each
        return two
    return tuple(sorted({*(il for il in two if info.layers[il].kind not in kinds), *seq}))


def _keeps_window(path: Path, args: tuple) -> bool:
    """llama.cpp gives the derived model a SWA cache too (some architectures switch their window on by the
    layer count: exaone4.cpp only at n_layer == 64; without it the derived graph has one mask, not two)."""
    from ...llama.accounting import accounting

    n_ctx, n_ubatch, n_batch, type_k, type_v, flash_attn = args
    acc = accounting(path, n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_batch, type_k=type_k, type_v=type_v,
                     flash_attn=flash_attn)
    return any(c.swa and c.layers for c in acc.caches)


def _flags(info: ModelInfo, layers: tuple[int, ...]) -> LayerFlags:
    """The kept layers' sliding and recurrent flags, written explicitly into a derived model (None where
    the model has no such layers: its own keys then say so)."""
    swa = tuple(info.layers[i].sliding for i in layers) if any(info.swa_layers) else None
    recr = tuple(info.layers[i].recurrent for i in layers) if RECURRENT_RULES.get(info.arch) == "interval" else None
    return LayerFlags(swa, recr)


def load_source(model) -> GGUFFile:
    """The header the planner works from: a local GGUF (a split one's shards merged) or a Hub
    model's, read remotely without its weights (`ctxq.models.model_header`)."""
    from ...models import model_header

    return model_header(model)
