"""CUDA's own memory terms (ctxq.planning.cuda) against figures worked out by hand from the vendored
llama.cpp source. No GPU: the terms are formulas; their sources are cited in the module and docs/cuda.md.

Geometries are real header-only GGUFs (Q4_K_M recipe): Llama-3-70B (80 layers, n_embd 8192, 64 heads,
8 KV heads, head_dim 128, n_ff 28672, vocab 128256) and Llama-3-8B (32 layers, 4096, 32/8 heads, n_ff 14336).
"""

from __future__ import annotations

import pytest

from ctxq.gguf.info import model_info
from ctxq.planning.memory import cuda
from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf
from ctxq.units import GiB, MiB


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda_geometries")
    return {k: model_info(write_synthetic_gguf(d / f"{k}.gguf", GEOMETRIES[k]))
            for k in ("llama3-70b", "llama3-8b", "gemma2-9b", "tiny")}


def test_fa_copies_quantized_kv(info):
    # 70B, 65536 cells, q8_0 K and V, ubatch 512: TILE/MMA kernels -> f16 copies of both views.
    # dst = 128*64*512*4 = 16,777,216 (a multiple of 128: no padding); K = 65536*1024*2 = 134,217,728; V the same.
    assert cuda.fa_quantized_kv_copies(info["llama3-70b"], range(80), 65536, 512, "q8_0", "q8_0", True) == 268_435_456
    # 8B, 32768 cells, q4_0: 2 * 32768 * 1024 * 2 = 134,217,728
    assert cuda.fa_quantized_kv_copies(info["llama3-8b"], range(32), 32768, 512, "q4_0", "q4_0", True) == 134_217_728


def test_fa_copies_only_when_the_kernel_needs_them(info):
    i70 = info["llama3-70b"]
    assert cuda.fa_quantized_kv_copies(i70, range(80), 65536, 512, "f16", "f16", True) == 0
    assert cuda.fa_quantized_kv_copies(i70, range(80), 65536, 512, "q8_0", "q8_0", False) == 0
    # one token, q8_0/q8_0: the VEC kernel is compiled for that pair (GGML_CUDA_FA_QUANTS) -> no copy
    assert cuda.fa_quantized_kv_copies(i70, range(80), 65536, 1, "q8_0", "q8_0", True) == 0
    # one token, q8_0 K with f16 V: no VEC instance -> f16 fallback, K only: 65536*1024*2 = 134,217,728
    assert cuda.fa_quantized_kv_copies(i70, range(80), 65536, 1, "q8_0", "f16", True) == 134_217_728
    assert cuda.fa_quantized_kv_copies(i70, [], 65536, 512, "q8_0", "q8_0", True) == 0


def test_fa_copies_of_sliding_window_layers(info):
    # Gemma-2-9B layer 0 is a sliding-window layer: pad256(4096 + 512) = 4608 cells; 8 KV heads x 256 = 2048.
    # 4608 * 2048 * 2 * 2 = 37,748,736. Layer 1 is full: 32768 * 2048 * 2 * 2 = 268,435,456 (the maximum).
    g = info["gemma2-9b"]
    assert cuda.fa_quantized_kv_copies(g, [0], 32768, 512, "q8_0", "q8_0", True) == 37_748_736
    assert cuda.fa_quantized_kv_copies(g, [0, 1], 32768, 512, "q8_0", "q8_0", True) == 268_435_456


def test_offload_weight_copies(info):
    # The largest single host weight: layer 0's ffn_down is Q6_K (use_more_bits, il < n/8):
    # 70B: 28672*8192 = 234,881,024 values / 256 * 210 B = 192,675,840 (28672 = 56*512: no row padding)
    assert cuda.offload_weight_copies(info["llama3-70b"], [0, 1], False, 65536, 512) == 192_675_840
    # 8B: 14336*4096 = 58,720,256 / 256 * 210 = 48,168,960
    assert cuda.offload_weight_copies(info["llama3-8b"], [0, 1, 2], False, 65536, 512) == 48_168_960
    # the output head on the CPU: 8192*128256 = 1,050,673,152 / 256 * 210 = 861,880,320 (Q6_K)
    assert cuda.offload_weight_copies(info["llama3-70b"], [], True, 65536, 512) == 861_880_320
    # below GGML_OP_OFFLOAD_MIN_BATCH (32) nothing is offloaded; nothing on the CPU, nothing copied
    assert cuda.offload_weight_copies(info["llama3-70b"], [0, 1], True, 65536, 31) == 0
    assert cuda.offload_weight_copies(info["llama3-70b"], [], False, 65536, 512) == 0


def test_offload_of_a_tied_output_and_row_padding(info):
    # Gemma-2 ties its output to token_embd: on the CPU, the output matmul copies token_embd in.
    # 3584 x 256000 Q4_K = 917,504,000 values / 256 * 144 B = 516,096,000 (3584 = 7 * 512: no padding)
    assert cuda.offload_weight_copies(info["gemma2-9b"], [], True, 8192, 512) == 516_096_000
    # tiny: 256-wide Q4_K rows are padded to 512 values in a CUDA buffer, one row's worth more:
    # 256 x 256 Q4_K = 36,864 B + row_size(Q4_K, 256) = 144 -> 37,008
    attn_q = next(t for t in cuda.weight_tensors(info["tiny"], [0], False) if t.name == "blk.0.attn_q.weight")
    assert (attn_q.nbytes, cuda.cuda_nbytes(attn_q)) == (36_864, 37_008)


def test_offload_kv_copies(info):
    # A CPU layer's K and V views copied in for its attention: 70B f16 at 65536: 65536 * (2048 + 2048) = 268,435,456
    assert cuda.offload_kv_copies(info["llama3-70b"], [0, 1], 65536, 512, "f16", "f16", True) == 268_435_456
    # q8_0: 65536 * 2 * (1024 / 32 * 34) = 142,606,336, plus the f16 copies 268,435,456 = 411,041,792
    assert cuda.offload_kv_copies(info["llama3-70b"], [0], 65536, 512, "q8_0", "q8_0", True) == 411_041_792
    # 8B f16 at 8192: 8192 * 4096 = 33,554,432
    assert cuda.offload_kv_copies(info["llama3-8b"], [5], 8192, 512, "f16", "f16", False) == 33_554_432


def test_fa_off_pool(info):
    # KQV converts softmax(KQ) to f16: n_kv * n_ubatch * n_head * 2, plus an f16 dst_temp n_ubatch * 128 * n_head * 2;
    # KQ's f32 copy of K (n_kv * 1024 * 4) is smaller. 8B at 32768: 1,073,741,824 + 4,194,304 = 1,077,936,128
    assert cuda.fa_off_pool(info["llama3-8b"], range(32), 32768, 512, False) == 1_077_936_128
    # 70B at 32768: 32768*512*64*2 = 2,147,483,648 + 512*128*64*2 = 8,388,608 -> 2,155,872,256
    assert cuda.fa_off_pool(info["llama3-70b"], range(80), 32768, 512, False) == 2_155_872_256
    assert cuda.fa_off_pool(info["llama3-70b"], range(80), 32768, 512, True) == 0


def test_matmul_pool(info):
    # Turing+: every Q4_K_M matmul goes through MMQ; its q8_1 copy of the activations is largest for
    # ffn_down (ne0 = 28672): 512 * 28672 * 144 / 128 = 16,515,072 + 128 * 144 = 18,432 -> 16,533,504
    assert cuda.matmul_pool(info["llama3-70b"], range(80), True, 65536, 512) == 16_533_504
    # 8B: 512 * 14336 * 144 / 128 = 8,257,536 + 18,432 = 8,275,968
    assert cuda.matmul_pool(info["llama3-8b"], range(32), True, 65536, 512) == 8_275_968
    # Volta (cc 7.0) at batch >= 64 takes cuBLAS: the Q6_K output head converted to f16,
    # 1,050,673,152 * 2 = 2,101,346,304 + src1 8192 * 512 * 2 = 8,388,608 (no dst_temp on Volta) = 2,109,734,912
    assert cuda.matmul_pool(info["llama3-70b"], range(80), True, 65536, 512, cc=700) == 2_109_734_912


def test_reserve_is_positive_and_below_the_card():
    assert 0 < cuda.cuda_reserve() < 8 * GiB  # the smallest card of the README's 16,16,16,8,8 example
    assert cuda.cuda_reserve() == 768 * MiB
    assert cuda.cuda_reserve("vulkan") == 1024 * MiB  # a backend ctxq does not model: --fit's target
    assert cuda.cuda_reserve("rpc") == 0
    assert cuda.cublas_workspace(900) == 32 * MiB and cuda.cublas_workspace(890) == 4 * MiB


# llama.cpp's layer counts for tensor_split 16:16:16:8:8 over 81 slots (planner.llama_layer_counts):
# 21, 20, 20, 10, 10, the output head (slot 80) on the last GPU.
SPLIT_70B = [range(0, 21), range(21, 41), range(41, 61), range(61, 71), range(71, 80)]


def _terms(i, tk, tv, n_dev, **kw):
    return cuda.cuda_device_terms(i, n_ctx=65536, n_ubatch=512, type_k=tk, type_v=tv, flash_attn=True,
                                  layers=SPLIT_70B[n_dev], has_output=n_dev == 4, first=n_dev == 0, **kw)


def test_q8_0_compute_exceeds_f16_by_the_copies_on_every_gpu(info):
    """The issue's acceptance figure: 2 * 65536 * 1024 * 2 bytes more compute with q8_0 on every GPU."""
    want = 2 * 65536 * 1024 * 2
    for d in range(5):
        i70 = info["llama3-70b"]
        extra = _terms(i70, "q8_0", "q8_0", d).compute - _terms(i70, "f16", "f16", d).compute
        assert abs(extra - want) <= 0.15 * want, (d, extra)


def test_cpu_layers_grow_only_the_first_gpu(info):
    i70 = info["llama3-70b"]
    cpu = range(0, 5)
    shifted = [range(5, 21)] + SPLIT_70B[1:]  # the same devices with layers 0-4 left on the CPU
    base = cuda.cuda_device_terms(i70, n_ctx=65536, n_ubatch=512, type_k="f16", type_v="f16", flash_attn=True,
                                  layers=SPLIT_70B[0], has_output=False, first=True)
    with_cpu = cuda.cuda_device_terms(i70, n_ctx=65536, n_ubatch=512, type_k="f16", type_v="f16", flash_attn=True,
                                      layers=shifted[0], has_output=False, first=True, cpu_layers=cpu)
    # f16 KV of one CPU layer (268,435,456) outweighs its largest weight (192,675,840)
    assert with_cpu.offload_copies == 268_435_456
    assert with_cpu.compute > base.compute and with_cpu.total > base.total
    second = cuda.cuda_device_terms(i70, n_ctx=65536, n_ubatch=512, type_k="f16", type_v="f16", flash_attn=True,
                                    layers=shifted[1], has_output=False, first=False, cpu_layers=cpu)
    assert second.offload_copies == 0


def test_terms_add_up_and_other_backends(info):
    t = _terms(info["llama3-70b"], "q8_0", "q8_0", 0, cpu_layers=[], reserve=512 * MiB)
    assert t.reserve == 512 * MiB
    assert t.total == t.fa_kv_copies + t.offload_copies + t.pool + t.reserve
    v = _terms(info["llama3-70b"], "q8_0", "q8_0", 0, backend="metal")
    assert (v.compute, v.pool, v.reserve) == (0, 0, 1024 * MiB)
    assert _terms(info["llama3-70b"], "q8_0", "q8_0", 0, backend="rpc").total == 0


def test_cuda_logs_script_rows(tmp_path):
    """scripts/cuda_logs.py on three public logs: a reproduced one, the -ot ffn=CPU one, and a fork."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(cuda.__file__).resolve().parents[2]
    data = root.parent / "shared" / "data" / "cuda-logs-public.jsonl"
    if not data.is_file():
        pytest.skip(f"{data} (the public logs) is not next to this checkout")
    logs = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    pick = [e for e in logs if "issues/11200" in e["source"] or "Panchovix" in e["source"]
            or "pull/370" in e["source"]]
    f = tmp_path / "logs.jsonl"
    f.write_text("".join(json.dumps(e) + "\n" for e in pick))
    script = root / "scripts" / "cuda_logs.py"
    out = subprocess.run([sys.executable, str(script), "--logs", str(f)], capture_output=True, text=True,
                         timeout=300).stdout
    rows = [r for r in out.splitlines() if r.startswith("| ") and not r.startswith("| #")]
    assert len(rows) == 3
    # llama.cpp#11200: KV per device printed 2788 / 1564 MiB, predicted exactly; q8_0 with FA: 128 MiB copies
    assert "2788/2788, 1564/1564" in out and "fa 128" in out
    # the -ot ffn=CPU log: only CUDA0 grows, by one expert tensor (1540-2940 MiB), printed +2497
    assert "+2497" in out and "offload 1540-2940" in out
    assert "left out: fork ik_llama.cpp" in out
