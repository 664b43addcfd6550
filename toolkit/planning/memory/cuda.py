"""CUDA's own memory terms: what a CUDA device allocates that the CPU/RPC dry run never shows.

Every function is a pure function of the plan's parameters and returns bytes. Each follows a function
of the llama.cpp that llama-cpp-python 0.3.36 vendors (`vendor/llama.cpp`, ggml of Oct 2026), named in
its comment; docs/cuda.md lists them with what is verified against public logs and what only derived.

Where the bytes live decides how they add up:

- the **compute buffer** (ggml-alloc sizes each tensor with the CUDA buffer type's `get_alloc_size`):
  the f16 copies of a quantized K/V for flash attention, and on the first CUDA device the copies of
  host-resident weights and KV that the scheduler offloads. ggml-alloc frees a tensor after its last
  use, so only the largest one is live at a time: each term is a maximum over layers, not a sum. Adding
  it to the compute measured without it is an upper bound (exact when that op is the graph's peak).
- the **pool** (ggml_cuda_pool_vmm: grows to its high-water mark and never shrinks; allocations are
  freed when the op returns): one op's temporaries at a time, so the pool is the maximum over ops.
- **outside every buffer**: CUDA context, cuBLAS handles and workspace, CUDA graphs: `cuda_reserve`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ...gguf.info import FFN_RE, ModelInfo, block_of, is_expert, kv_cells, layer_kv_bytes
from ...gguf.once import file_stamp
from ...gguf.reader import TensorInfo, tensor_nbytes
from ...gguf.shards import read_model
from ...units import MiB, round_up
from ..kvpairs import cuda_compiled_pairs

CUDA_ALIGN = 128  # ggml_backend_cuda_buffer_type_get_alignment; GGML_PAD(end, 128) in get_f16_extra_data
OP_OFFLOAD_MIN_BATCH = 32  # ggml_cuda init: getenv("GGML_OP_OFFLOAD_MIN_BATCH") or 32
MATRIX_ROW_PADDING = 512  # ggml-cuda common.cuh: quantized rows padded in get_alloc_size and MMQ
Q8_1_MMQ_BYTES, Q8_1_MMQ_VALUES = 144, 128  # sizeof(block_q8_1_mmq), QK8_1_MMQ (mmq.cuh)
MMQ_J_MAX = 128  # upper bound of ggml_cuda_mmq_get_J_max: extra q8_1 blocks MMQ allocates (mmq.cu)
CC_VOLTA, CC_TURING, CC_HOPPER = 700, 750, 900  # GGML_CUDA_CC_* (common.cuh)
MMQ_DP4A_MAX_BATCH_SIZE = 64  # mmq.cuh: Volta uses cuBLAS for quantized weights from this batch
CUBLAS_WORKSPACE_HOPPER, CUBLAS_WORKSPACE = 32 * MiB, 4 * MiB  # ggml_backend_cuda_context::cublas_handle

# Memory outside every buffer on one CUDA card. Measured (docs/cuda.md, ../shared/research/cuda-memory.md):
# llama.cpp's exit breakdown reports 'unaccounted' = total - free - (model + context + compute) of
# 451-456 MiB per RTX 4090 (llama.cpp PR #15860) and 703-714 MiB per RTX PRO 6000 Blackwell (96 GiB, 188 SMs;
# ~561 MiB of it in use before the model loaded, i.e. the CUDA context; dfch/biz.dfch.LlmOps). That figure
# also holds the pool's high-water, which ctxq models apart (`pool`), so 768 MiB = the largest measurement
# (714) rounded up to the next 256 MiB covers context, cuBLAS handle and workspace (32 MiB on Hopper and
# newer, included in the Blackwell figure), CUDA graphs and VMM granularity. llama.cpp's --fit keeps
# 1024 MiB free (common.h fit_params_target) because it has no pool model; ctxq keeps that for backends it
# does not model (Vulkan, Metal, ...).
CUDA_RESERVE = 768 * MiB
OTHER_GPU_RESERVE = 1024 * MiB


def _fa_needs_f16(type_k: str, type_v: str, n_tokens: int) -> tuple[bool, bool]:
    """Which of K and V ggml_cuda_flash_attn_ext_get_alloc_size (fattn.cu) copies to f16.

    ggml_cuda_get_best_fattn_kernel picks TILE/MMA (always f16 copies) for more than one token (Ada+ with a
    quantized cache keep VEC up to 2 tokens: treated as TILE, an over-estimate); VEC copies only a pair
    without a compiled kernel (kvpairs.cuda_compiled_pairs: the build's GGML_CUDA_FA_QUANTS) or f32. A K/V that already is f16 is never copied."""
    tile = n_tokens > 1
    fallback = (type_k, type_v) not in cuda_compiled_pairs()
    need_k = type_k != "f16" and (tile or fallback or type_k == "f32")
    need_v = type_v != "f16" and (tile or fallback or type_v == "f32")
    return need_k, need_v


def fa_layer_copies(info: ModelInfo, il: int, n_ctx: int, n_ubatch: int, type_k: str, type_v: str,
                    flash_attn: bool) -> int:
    """Bytes one FLASH_ATTN_EXT result of layer il gains over ggml_nbytes in a CUDA buffer.

    ggml_cuda_flash_attn_ext_get_f16_extra_data (fattn-common.cuh): end = dst + nbytes(dst); for each
    copy, pad end to 128 and add nelements(K or V view) * 2. The reserve graph views n_kv = all cells
    (llama_kv_cache_context at full size) and has min(n_ctx, n_ubatch) tokens (llama_context::sched_reserve)."""
    if not flash_attn or not info.layers[il].attention:
        return 0
    n_tokens = min(n_ctx, n_ubatch)
    need_k, need_v = _fa_needs_f16(type_k, type_v, n_tokens)
    if not (need_k or need_v):
        return 0
    n_kv = kv_cells(info, n_ctx, n_ubatch, il)
    dst = info.head_dim_v * info.n_head[il] * n_tokens * 4  # f32 [head_dim_v, n_head, n_tokens]
    end = dst
    if need_k:
        end = round_up(end, CUDA_ALIGN) + n_kv * info.n_embd_k_gqa(il) * 2
    if need_v:
        end = round_up(end, CUDA_ALIGN) + n_kv * info.n_embd_v_gqa(il) * 2
    return end - dst


def fa_quantized_kv_copies(info: ModelInfo, layers, n_ctx: int, n_ubatch: int, type_k: str, type_v: str,
                           flash_attn: bool) -> int:
    """What a CUDA device's compute buffer gains with flash attention over a non-f16 K/V cache: the
    largest layer's f16 K and V copies (ggml_backend_cuda_buffer_type_get_alloc_size -> fattn.cu
    ggml_cuda_flash_attn_ext_get_alloc_size). One attention result is live at a time, so a maximum."""
    return max((fa_layer_copies(info, il, n_ctx, n_ubatch, type_k, type_v, flash_attn) for il in layers),
               default=0)


@lru_cache(maxsize=16)
def _matmul_weights(path: str, stamp: tuple | None = None) -> tuple[dict[int, tuple[TensorInfo, ...]], dict[str, TensorInfo]]:
    """The header's matmul weights (2-D and up; norms and biases are not) by layer, and the rest by name;
    every shard's, for a split model. Read once per version of the file (`stamp`, part of the cache's key): the
    planner asks for thousands of layouts."""
    by_layer: dict[int, list[TensorInfo]] = {}
    other: dict[str, TensorInfo] = {}
    for t in read_model(path).tensors:
        if len(t.shape) < 2:
            continue
        il = block_of(t.name)
        if il is not None:
            by_layer.setdefault(il, []).append(t)
        else:
            other[t.name] = t
    return {il: tuple(ts) for il, ts in by_layer.items()}, other


def weight_tensors(info: ModelInfo, layers, output: bool) -> list[TensorInfo]:
    """The matmul weights of `layers` (and the output head when `output`) read from the GGUF's header;
    a tied output is token_embd (TENSOR_DUPLICATED onto the output device)."""
    by_layer, other = _matmul_weights(info.path, file_stamp(info.path))
    out = [t for il in layers for t in by_layer.get(il, ())]
    head = other.get("token_embd.weight" if info.output_tied else "output.weight") if output else None
    return out + ([head] if head is not None else [])


def cuda_nbytes(t: TensorInfo) -> int:
    """A tensor's size in a CUDA buffer: a quantized tensor whose rows are not a multiple of 512 gets one
    row's padding more (ggml_backend_cuda_buffer_type_get_alloc_size, [TAG_ALLOC_SIZE_EXPAND])."""
    pad = -t.shape[0] % MATRIX_ROW_PADDING
    if not pad or t.type_name in ("F32", "F16", "BF16"):
        return t.nbytes
    return t.nbytes + tensor_nbytes(t.type, (pad,))


def offload_weight_copies(info: ModelInfo, cpu_layers, output_on_cpu: bool, n_ctx: int, n_ubatch: int,
                          min_batch: int = OP_OFFLOAD_MIN_BATCH) -> int:
    """The first CUDA device's compute-buffer room for one host-resident weight at a time.

    ggml_backend_sched_backend_id_from_cur (ggml-backend.cpp, cause "1.off"): an op whose weight sits in a
    host buffer of the CPU backend runs on the first backend whose offload_op says yes;
    ggml_backend_cuda_device_offload_op says yes from a batch of min_batch (GGML_OP_OFFLOAD_MIN_BATCH, 32).
    The weight becomes a split input copied into that backend's compute buffer; ggml_backend_sched_split_graph
    starts a new split at each such weight "so the memory of the previously offloaded weights can be
    reused": the peak is the largest single weight, not all CPU weights. token_embd is a GET_ROWS (batch 0):
    never offloaded. Pipeline parallelism (which would keep every copy) is off whenever layers sit on the CPU.
    """
    if min(n_ctx, n_ubatch) < min_batch or not (list(cpu_layers) or output_on_cpu):
        return 0
    return max((cuda_nbytes(t) for t in weight_tensors(info, cpu_layers, output_on_cpu)), default=0)


def offload_kv_copies(info: ModelInfo, cpu_layers, n_ctx: int, n_ubatch: int, type_k: str, type_v: str,
                      flash_attn: bool, min_batch: int = OP_OFFLOAD_MIN_BATCH) -> int:
    """The first CUDA device's room for a CPU layer's attention: the scheduler's "expand gpu" passes give
    the attention of a CPU layer (between offloaded matmuls) to that device too, and its K and V views live
    in the host KV buffer, so both are copied in as split inputs (ggml_backend_sched_split_graph, "4.cpy"),
    plus the f16 copies of fa_layer_copies for a quantized cache. One layer at a time."""
    if min(n_ctx, n_ubatch) < min_batch:
        return 0
    return max((layer_kv_bytes(info, il, n_ctx, n_ubatch, type_k, type_v)
                + fa_layer_copies(info, il, n_ctx, n_ubatch, type_k, type_v, flash_attn) for il in cpu_layers),
               default=0)


def fa_off_pool(info: ModelInfo, layers, n_ctx: int, n_ubatch: int, flash_attn: bool) -> int:
    """Pool high-water of attention without flash attention (llm_graph_context::build_attn_mha, f16 cache).

    KQ = mul_mat(k, q) carries GGML_PREC_F32, so ggml_cuda_mul_mat_cublas computes in f32 and
    ggml_cuda_mul_mat_cublas_impl converts the f16 K view to f32 in the pool: n_kv * n_embd_k_gqa * 4.
    KQV = mul_mat(v, softmax(KQ)) computes in f16 (fast-fp16 GPUs): softmax(KQ) converted to f16,
    n_kv * n_tokens * n_head * 2, plus an f16 dst_temp of n_tokens * head_dim_v * n_head * 2 (not on Volta:
    an over-estimate there). Each op frees its temporaries, so the larger of the two, at the largest n_kv
    (a full cache) and a full ubatch."""
    if flash_attn:
        return 0
    n_tokens = min(n_ctx, n_ubatch)

    def layer(il: int) -> int:
        if not info.layers[il].attention:  # recurrent and MLP-only layers have no KQ
            return 0
        n_kv = kv_cells(info, n_ctx, n_ubatch, il)
        kq = n_kv * info.n_embd_k_gqa(il) * 4
        kqv = n_kv * n_tokens * info.n_head[il] * 2 + n_tokens * info.head_dim_v * info.n_head[il] * 2
        return max(kq, kqv)

    return max((layer(il) for il in layers), default=0)


MMQ_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ2_XXS",
             "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL", "MXFP4"}  # ggml_cuda_should_use_mmq


def matmul_pool_bytes(t: TensorInfo, n_tokens: int, cc: int = CC_TURING) -> int:
    """Pool temporaries of one matmul with weight t and n_tokens columns (ggml_cuda_mul_mat, ggml-cuda.cu).

    - quantized, MMQ (ggml_cuda_should_use_mmq: supported type and Turing+, or Volta below batch 64):
      src1 quantized to q8_1 (ggml_cuda_mul_mat_q, mmq.cu): n_tokens * pad512(ne0) * 144/128 + J_max blocks;
    - quantized through cuBLAS (Volta from batch 64, types without MMQ): the whole weight converted to f16
      (ggml_cuda_mul_mat_cublas_impl src0_alloc), src1 to f16, f16 dst_temp (not on Volta);
    - f16: cuBLAS computes in f16 on the weight itself (no weight copy in this version): src1 to f16 and an
      f16 dst_temp; bf16: src1 to bf16, f32 output; f32: nothing."""
    ne0, ne1 = t.shape[0], t.n_elements // t.shape[0]
    name = t.type_name
    volta = CC_VOLTA <= cc < CC_TURING
    if name == "F32":
        return 0
    if name == "BF16":
        return ne0 * n_tokens * 2
    if name == "F16":
        return ne0 * n_tokens * 2 + (0 if volta else ne1 * n_tokens * 2)
    if name in MMQ_TYPES and (cc >= CC_TURING or n_tokens < MMQ_DP4A_MAX_BATCH_SIZE):
        return n_tokens * round_up(ne0, MATRIX_ROW_PADDING) * Q8_1_MMQ_BYTES // Q8_1_MMQ_VALUES \
            + MMQ_J_MAX * Q8_1_MMQ_BYTES
    return t.n_elements * 2 + ne0 * n_tokens * 2 + (0 if volta else ne1 * n_tokens * 2)


def matmul_pool(info: ModelInfo, layers, has_output: bool, n_ctx: int, n_ubatch: int, cc: int = CC_TURING) -> int:
    """Pool high-water of the device's weight matmuls at a full ubatch: the largest of matmul_pool_bytes.
    A stacked expert weight (MUL_MAT_ID) multiplies n_expert_used rows per token (ggml_cuda_mul_mat_id:
    MMQ quantizes src1 [n_embd, n_expert_used, n_tokens] to q8_1; mmq.cu ggml_cuda_mul_mat_q with ids)."""
    n_tokens = min(n_ctx, n_ubatch)
    used = max(info.n_expert_used, 1)
    return max((matmul_pool_bytes(t, n_tokens * (used if is_expert(t.name) else 1), cc)
                for t in weight_tensors(info, layers, has_output)), default=0)


def cublas_workspace(cc: int = CC_TURING) -> int:
    """The static cuBLAS workspace per device and stream (ggml_backend_cuda_context::cublas_handle,
    common.cuh: 32 MiB from Hopper, cc 9.0, else 4 MiB). Part of cuda_reserve, shown for the docs."""
    return CUBLAS_WORKSPACE_HOPPER if cc >= CC_HOPPER else CUBLAS_WORKSPACE


def cuda_reserve(backend: str = "cuda") -> int:
    """Memory a card needs outside every buffer: CUDA_RESERVE (768 MiB) for CUDA, see its comment for the
    evidence; OTHER_GPU_RESERVE (1024 MiB, llama.cpp --fit's default target) for backends ctxq does not
    model; 0 for the CPU and RPC workers (their own margins stay with the planner)."""
    if backend == "cuda":
        return CUDA_RESERVE
    return 0 if backend in ("cpu", "rpc") else OTHER_GPU_RESERVE


@dataclass(frozen=True)
class CudaTerms:
    """CUDA's own bytes on one device, by where they live."""

    fa_kv_copies: int = 0  # compute buffer: f16 copies of a quantized K/V for flash attention
    offload_copies: int = 0  # compute buffer, first CUDA device: host weights / CPU-layer KV copied in
    pool: int = 0  # pool high-water: FA-off attention temporaries or matmul temporaries, the larger
    reserve: int = 0  # outside every buffer: context, cuBLAS, graphs

    @property
    def compute(self) -> int:
        """What the printed compute buffer gains over a CPU dry run's."""
        return self.fa_kv_copies + self.offload_copies

    @property
    def total(self) -> int:
        return self.compute + self.pool + self.reserve


def cuda_device_terms(info: ModelInfo, *, n_ctx: int, n_ubatch: int, type_k: str, type_v: str,
                      flash_attn: bool, layers, has_output: bool, first: bool = False, cpu_layers=(),
                      output_on_cpu: bool = False, backend: str = "cuda", cc: int = CC_TURING,
                      reserve: int | None = None) -> CudaTerms:
    """CUDA's terms for one device of a plan.

    layers: the layer indices on this device; has_output: it holds the output head; first: it is the first
    CUDA device in llama.cpp's order (the op-offload target); cpu_layers / output_on_cpu: what sits on the
    CPU (only read when first). backend: "cuda" (described GPUs are CUDA cards), "cpu"/"rpc" (all zero), or
    any other name (Vulkan, Metal: only the default reserve). cc: compute capability x100 (default Turing,
    the oldest card on which MMQ takes every quantized matmul). reserve: a user's override in bytes.
    """
    if backend != "cuda":
        return CudaTerms(reserve=cuda_reserve(backend) if reserve is None else reserve)
    cpu_layers = list(cpu_layers)
    if cpu_layers != list(range(len(cpu_layers))):  # llama.cpp keeps the first layers on the CPU
        raise ValueError("cpu_layers must be the first layers (0, 1, ...), as llama.cpp leaves them")
    table = layer_table(info, n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v, flash_attn=flash_attn,
                        cc=cc)
    n_cpu_slots = len(cpu_layers) + (1 if output_on_cpu and len(cpu_layers) == info.n_layer else 0)
    return table.terms(layers, has_output, first, n_cpu_slots, cuda_reserve() if reserve is None else reserve)


@dataclass(frozen=True)
class LayerTable:
    """CUDA's per-layer pieces, computed once per (model, n_ctx, KV types, ...) so that the planner's search
    can cost thousands of layouts: every term is a maximum over layers, so a device's term is the maximum of
    its layers' entries. `cuda_device_terms` is the one-device view of the same table."""

    fa: tuple[int, ...]  # fa_layer_copies per layer
    pool: tuple[int, ...]  # max(fa_off_pool, matmul_pool) of each layer alone
    pool_output: int  # matmul_pool of the output head
    offload_prefix: tuple[int, ...]  # [k]: offload copies with layers 0..k-1 on the CPU (k = 0..n_layer)
    offload_output: int  # offload_weight_copies of the output head left on the CPU
    offload_experts: tuple[int, ...] = ()  # expert_offload_copies of each layer's experts kept in CPU memory
    offload_ffn: tuple[int, ...] = ()  # ffn_offload_copies of each layer's dense FFN kept in host memory

    def terms(self, layers, has_output: bool, first: bool, n_cpu_slots: int, reserve: int,
              cpu_experts=frozenset(), cpu_ffn=frozenset()) -> CudaTerms:
        """The terms of a CUDA device holding `layers` (+ the output) when the first n_cpu_slots layer
        slots (llama.cpp keeps those on the CPU; slot n_layer is the output head) sit on the CPU, and the
        experts of `cpu_experts` and the dense FFN of `cpu_ffn` in host memory."""
        n = len(self.fa)
        n_cpu_layers, output_on_cpu = min(n_cpu_slots, n), n_cpu_slots > n
        offload = 0
        if first:
            offload = max(self.offload_prefix[n_cpu_layers], self.offload_output if output_on_cpu else 0,
                          max((self.offload_experts[il] for il in cpu_experts), default=0),
                          max((self.offload_ffn[il] for il in cpu_ffn), default=0) if self.offload_ffn else 0)
        on_device = list(layers) + (list(range(n_cpu_layers)) + list(cpu_experts) + list(cpu_ffn) if offload else [])
        pool = max([self.pool[il] for il in on_device]
                   + [self.pool_output if has_output or (offload and output_on_cpu) else 0])
        return CudaTerms(fa_kv_copies=max((self.fa[il] for il in layers), default=0), offload_copies=offload,
                         pool=pool, reserve=reserve)


def layer_table(info: ModelInfo, *, n_ctx: int, n_ubatch: int, type_k: str, type_v: str, flash_attn: bool,
                cc: int = CC_TURING) -> LayerTable:
    """The per-layer pieces of CUDA's terms for one plan's settings."""
    args = (n_ctx, n_ubatch)
    n = info.n_layer
    offload, prefix = 0, [0]
    for il in range(n):
        offload = max(offload, offload_weight_copies(info, [il], False, *args),
                      offload_kv_copies(info, [il], *args, type_k, type_v, flash_attn))
        prefix.append(offload)
    return LayerTable(
        fa=tuple(fa_layer_copies(info, il, *args, type_k, type_v, flash_attn) for il in range(n)),
        pool=tuple(max(fa_off_pool(info, [il], *args, flash_attn), matmul_pool(info, [il], False, *args, cc))
                   for il in range(n)),
        pool_output=matmul_pool(info, [], True, *args, cc), offload_prefix=tuple(prefix),
        offload_output=offload_weight_copies(info, [], True, *args),
        offload_experts=tuple(expert_offload_copies(info, [il], *args) for il in range(n)),
        offload_ffn=tuple(ffn_offload_copies(info, [il], *args) for il in range(n)))


def ffn_offload_copies(info: ModelInfo, cpu_ffn_layers, n_ctx: int, n_ubatch: int,
                       min_batch: int = OP_OFFLOAD_MIN_BATCH) -> int:
    """The first CUDA device's compute-buffer room for one host-resident dense FFN weight at a time: the rule of
    expert_offload_copies for `ffn_up/gate/down` (a MUL_MAT whose weight sits in a host buffer runs on the first
    CUDA device from a batch of min_batch tokens, the scheduler copying the weight there; one split per weight)."""
    if min(n_ctx, n_ubatch) < min_batch:
        return 0
    by_layer, _ = _matmul_weights(info.path, file_stamp(info.path))
    return max((cuda_nbytes(t) for il in cpu_ffn_layers for t in by_layer.get(il, ()) if FFN_RE.match(t.name)), default=0)


def expert_offload_copies(info: ModelInfo, cpu_expert_layers, n_ctx: int, n_ubatch: int,
                          min_batch: int = OP_OFFLOAD_MIN_BATCH) -> int:
    """The first CUDA device's compute-buffer room for one CPU-resident expert tensor at a time.

    The same rule as offload_weight_copies (ggml_backend_sched_backend_id_from_cur, "1.off"): a MUL_MAT_ID
    whose stacked expert weight sits in a host buffer runs on the first CUDA device once its batch
    (ne[2], the tokens; ggml_backend_cuda_device_offload_op) reaches min_batch, and the scheduler copies the
    whole 3-D tensor into that device's compute buffer (ggml_dup_tensor_layout of the split input; the
    copy of only the used experts' ranges, llama.cpp PR #15346, still sizes the buffer by the whole tensor).
    Each weight starts a new split, so the largest tensor, not the sum."""
    if min(n_ctx, n_ubatch) < min_batch:
        return 0
    by_layer, _ = _matmul_weights(info.path, file_stamp(info.path))
    return max((cuda_nbytes(t) for il in cpu_expert_layers for t in by_layer.get(il, ()) if is_expert(t.name)),
               default=0)
