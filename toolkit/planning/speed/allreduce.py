"""The all-reduces of tensor mode (planning/speed/model.py): llama.cpp's generic butterfly and NCCL's ring."""

from __future__ import annotations

import math

ACT_BYTES = 4  # activations between layers and in the generic all-reduce are f32 (ggml's residual stream)
CUDA_CALL_S = 6e-6  # one cudaMemcpyAsync's start-up (profiles.CUDA_CALL_S's source)
# NCCL's path reduces f32 below these element counts and bf16 above them, by the number of cards
# (ggml_backend_cuda_comm_allreduce_nccl, ggml-cuda.cu; tuned there on RTX 4090s over PCIe 4.0 x16).
NCCL_F32_BELOW = {2: 32768, 3: 131072, 4: 262144}
ALLREDUCES = ("butterfly", "nccl")


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
    # each step's copies are issued one card after another from the host thread (push_data in allreduce_fallback's
    # loop over the cards): a CUDA call's start-up per card beside the exchange's own latency
    return steps * (link_latency + n_cards * CUDA_CALL_S + elements * ACT_BYTES / link_bandwidth)
