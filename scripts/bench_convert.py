"""Benchmark `ctxq convert` against llama.cpp's own `convert_hf_to_gguf.py` on the same checkpoint.

    python scripts/bench_convert.py [MODEL_DIR] [--type f32,f16] [--repeat 2] [--llama-src DIR]
    python scripts/bench_convert.py --family qwen35moe --type f16 --repeat 1   # a native 2026 family
    python scripts/bench_convert.py --family olmo3 --type f16 --repeat 1       # through the fallback
    python scripts/bench_convert.py --family gemma4 --type f16 --repeat 1      # Gemma 4, its own tokenizer

MODEL_DIR defaults to SmolLM2-135M-Instruct rebuilt as a Hugging Face checkpoint (ctxq.testing.models).
`--family` instead writes a random bf16 checkpoint at a real model's widths (fewer layers and experts,
SmolLM2's real tokenizer so that llama.cpp's converter recognises it; gemma4 has a Gemma-kind one):
`qwen35moe` is Qwen3.5-35B-A3B's layer (hidden 2048, gated DeltaNet 16/32 heads of 128, attention 16/2
heads of 256, experts of 512 plus a shared one) with 3 linear-attention layers, 1 full-attention layer
and the MTP block, 16 experts;
`olmo3` is OLMo-3-7B's layer (hidden 4096, MLP 11008) twice, which ctxq converts through llama.cpp's
converter (so its row shows the fallback's cost over running that converter directly); `gemma4` is
Gemma 4 E4B's layer (hidden 2560, MLP 10240, 8/2 heads of 256, full layers 512, per-layer input 256) six
times, the last two KV-shared, with a small Gemma-kind tokenizer (llama.cpp's `gemma4` tokenizer model).
llama.cpp's converter is the one `ctxq.conversion.upstream` fetches from the llama-cpp-python sdist of
the installed version (never committed) unless --llama-src names an unpacked llama.cpp. Each tool runs
in its own process; wall time and peak RSS (wait4's ru_maxrss, which covers the child's own children:
the fallback's converter; this parent stays small, so the inherited value does not matter) are the best
of --repeat runs. Prints both side by side with ctxq/llama.cpp ratios, and how many output tensors are
byte-identical.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def fetch_llama_cpp_source() -> Path:
    """llama.cpp's converter of the installed llama-cpp-python's sdist (fetched once into ctxq's cache)."""
    from ctxq.conversion.upstream import converter_dir

    return converter_dir()


# --- random checkpoints at real widths (bf16 safetensors written directly: no torch needed) ---------

def _bf16(rng, shape: tuple[int, ...], scale: float) -> bytes:
    import numpy as np

    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> None:
    """bf16 tensors: matrices ~ N(0, 1/fan_in), 1-D ones small (norms as zero-centred Qwen3.5 keeps them)."""
    import json
    import struct

    import numpy as np

    rng = np.random.default_rng(seed)
    header, off = {}, 0
    for name, shape in shapes.items():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            f.write(_bf16(rng, shape, 0.1 if len(shape) == 1 else shape[-1] ** -0.5))


def _qwen35moe_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, e, ff = cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    nk, nv, dk = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}

    def layer(p: str, linear: bool) -> None:
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if linear:
            conv = 2 * nk * dk + nv * dk
            shapes.update({p + "linear_attn.in_proj_qkv.weight": (conv, h), p + "linear_attn.in_proj_z.weight": (nv * dk, h),
                           p + "linear_attn.in_proj_a.weight": (nv, h), p + "linear_attn.in_proj_b.weight": (nv, h),
                           p + "linear_attn.conv1d.weight": (conv, 1, cfg["linear_conv_kernel_dim"]),
                           p + "linear_attn.A_log": (nv,), p + "linear_attn.dt_bias": (nv,),
                           p + "linear_attn.norm.weight": (dk,), p + "linear_attn.out_proj.weight": (h, nv * dk)})
        else:
            shapes.update({p + "self_attn.q_proj.weight": (2 * nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
                           p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                           p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        shapes[p + "mlp.gate.weight"] = (e, h)
        for x in range(e):
            shapes.update({f"{p}mlp.experts.{x}.gate_proj.weight": (ff, h), f"{p}mlp.experts.{x}.up_proj.weight": (ff, h),
                           f"{p}mlp.experts.{x}.down_proj.weight": (h, ff)})
        sh = cfg["shared_expert_intermediate_size"]
        shapes.update({p + "mlp.shared_expert.gate_proj.weight": (sh, h), p + "mlp.shared_expert.up_proj.weight": (sh, h),
                       p + "mlp.shared_expert.down_proj.weight": (h, sh), p + "mlp.shared_expert_gate.weight": (1, h)})

    for il, kind in enumerate(cfg["layer_types"]):
        layer(f"model.layers.{il}.", kind == "linear_attention")
    layer("mtp.layers.0.", False)
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
    return shapes


def _olmo3_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, ff, n = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for il in range(n):
        p = f"model.layers.{il}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (h, h),
                       p + "self_attn.v_proj.weight": (h, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                       p + "mlp.down_proj.weight": (h, ff)})
    return shapes


def _gemma4_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """transformers 5's Gemma4ForCausalLM state dict: KV-shared layers have no k/v projections or k_norm,
    tied output (no lm_head), per-layer embeddings of hidden_size_per_layer_input per layer."""
    h, v, ff, n, pl = (cfg[k] for k in ("hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers",
                                        "hidden_size_per_layer_input"))
    nh, nkv, first_shared = cfg["num_attention_heads"], cfg["num_key_value_heads"], n - cfg["num_kv_shared_layers"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "model.embed_tokens_per_layer.weight": (v, n * pl),
              "model.per_layer_model_projection.weight": (n * pl, h),
              "model.per_layer_projection_norm.weight": (pl,)}
    for il, kind in enumerate(cfg["layer_types"]):
        p, hd = f"model.layers.{il}.", cfg["global_head_dim" if kind == "full_attention" else "head_dim"]
        shapes.update({p + "layer_scalar": (1,), p + "self_attn.q_proj.weight": (nh * hd, h),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.o_proj.weight": (h, nh * hd),
                       p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                       p + "mlp.down_proj.weight": (h, ff), p + "per_layer_input_gate.weight": (pl, h),
                       p + "per_layer_projection.weight": (h, pl)})
        if il < first_shared:
            shapes.update({p + "self_attn.k_proj.weight": (nkv * hd, h), p + "self_attn.v_proj.weight": (nkv * hd, h),
                           p + "self_attn.k_norm.weight": (hd,)})
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_per_layer_input_norm"):
            shapes[f"{p}{norm}.weight"] = (h,)
    return shapes


def _smollm2_tokenizer(dest: Path) -> int:
    """SmolLM2's real tokenizer files; its vocabulary size."""
    import json

    tok = Path(subprocess.run([sys.executable, "-c", "from ctxq.testing.models import rebuild_smollm2_hf; "
                               "print(rebuild_smollm2_hf())"], capture_output=True, text=True, check=True).stdout.strip())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, dest / f)
    return json.loads((tok / "config.json").read_text())["vocab_size"]


def _gemma_tokenizer(dest: Path, vocab_size: int = 300) -> int:
    """A Gemma-kind tokenizer.json (ctxq.testing.gemma_tokenizer, as tests/test_convert_gemma4.py writes it)
    trained on this script's docstring; its vocabulary size."""
    from ctxq.testing.gemma_tokenizer import write_gemma_tokenizer

    return write_gemma_tokenizer(dest, __doc__.split("\n"), vocab_size)


_SWA, _FULL = "sliding_attention", "full_attention"
FAMILIES = {
    "qwen35moe": ({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "hidden_size": 2048,
                   "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                   "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512, "num_experts": 16, "num_experts_per_tok": 8,
                   "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mtp_num_hidden_layers": 1,
                   "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                       "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                   "tie_word_embeddings": False, "dtype": "bfloat16"}, _qwen35moe_shapes, _smollm2_tokenizer),
    "olmo3": ({"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": 4096, "intermediate_size": 11008,
               "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 65536,
               "rms_norm_eps": 1e-6, "hidden_act": "silu", "sliding_window": 4096, "rope_theta": 500000.0,
               "layer_types": ["sliding_attention", "full_attention"], "attention_bias": False,
               "tie_word_embeddings": False, "dtype": "bfloat16", "pad_token_id": 0, "eos_token_id": 0},
              _olmo3_shapes, _smollm2_tokenizer),
    # E4B's layer; 6 layers, the last 2 KV-shared after a sliding and a full one (what llama.cpp's cache
    # reuse needs, converters/gemma4.py), MLPs not double-wide
    "gemma4": ({"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 2560,
                "intermediate_size": 10240, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
                "head_dim": 256, "global_head_dim": 512, "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 2,
                "layer_types": [_SWA, _SWA, _SWA, _FULL, _SWA, _FULL], "use_double_wide_mlp": False,
                "sliding_window": 512, "final_logit_softcapping": 30.0, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
                "rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                                       "partial_rotary_factor": 0.25},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                "tie_word_embeddings": True, "dtype": "bfloat16", "pad_token_id": 0, "eos_token_id": 1,
                "bos_token_id": 2}, _gemma4_shapes, _gemma_tokenizer),
}


# transformers tokenizes a Qwen3.5 folder with its Qwen3_5Tokenizer (chosen by model_type), whose
# pre-tokenizer is not SmolLM2's, so llama.cpp's converter would not recognise the hash; for --family
# runs only that check answers the tokenizer's real pre-tokenizer (the name ctxq recognises too).
_PRE_AS_GIVEN = """import runpy, sys
folder, pre = sys.argv.pop(1), sys.argv.pop(1)
sys.path.insert(0, folder)
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv[0] = folder + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def make_family(name: str, dest: Path) -> Path:
    """A random bf16 checkpoint of `name` at real widths, with its family's tokenizer."""
    import json

    cfg, shapes, tokenizer = FAMILIES[name]
    dest.mkdir(parents=True, exist_ok=True)
    n_tok = tokenizer(dest)
    cfg = {**cfg, "vocab_size": n_tok}
    if "hidden_size_per_layer_input" in cfg:  # Gemma 4: one per-layer row per token (converters/gemma4.py)
        cfg["vocab_size_per_layer_input"] = n_tok
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_safetensors(dest / "model.safetensors", shapes(cfg))
    return dest


def run(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace")
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.exit(f"{cmd[0]} failed ({p.returncode}):\n{err[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def same_tensors(a: Path, b: Path) -> tuple[int, int]:
    """Tensors with equal type and bytes, counted in a child process: reading the files here would
    grow this process, and children inherit its peak RSS in ru_maxrss."""
    out = subprocess.run([sys.executable, __file__, "--compare", str(a), str(b)], capture_output=True,
                         text=True, check=True).stdout.split()
    return int(out[0]), int(out[1])


def _compare(a: Path, b: Path) -> tuple[int, int]:
    import numpy as np
    from gguf import GGUFReader

    ra, rb = GGUFReader(a), GGUFReader(b)
    tb = {t.name: t for t in rb.tensors}
    same = sum(1 for t in ra.tensors if t.name in tb and t.tensor_type == tb[t.name].tensor_type
               and np.array_equal(np.asarray(t.data), np.asarray(tb[t.name].data)))
    return same, len(ra.tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="Hugging Face model folder (default: rebuilt SmolLM2-135M-Instruct)")
    ap.add_argument("--type", default="f32,f16", help="comma-separated output types (f32, f16, bf16, q8_0)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per tool and type; the best is kept")
    ap.add_argument("--llama-src", type=Path, help="an unpacked llama.cpp with convert_hf_to_gguf.py")
    ap.add_argument("--family", choices=sorted(FAMILIES), help="a random checkpoint of this family at real widths")
    ap.add_argument("--compare", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--make", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare:
        print(*_compare(*args.compare))
        return
    if args.make:
        make_family(args.make[0], Path(args.make[1]))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench_convert."))
    if args.family:  # in a child, so this process stays small (see same_tensors)
        args.model = str(tmp / args.family)
        subprocess.run([sys.executable, __file__, "--make", args.family, args.model], check=True)
    elif args.model is None:
        args.model = subprocess.run([sys.executable, "-c", "from ctxq.testing.models import rebuild_smollm2_hf; "
                                     "print(rebuild_smollm2_hf())"], capture_output=True, text=True,
                                    check=True).stdout.strip()
    try:
        src = args.llama_src or fetch_llama_cpp_source()
        # llama.cpp's converter runs from a copy in the temporary folder, with its own gguf-py.
        work = tmp / "llama.cpp"
        if not work.exists():
            work.mkdir()
            for name in ("convert_hf_to_gguf.py", "conversion", "gguf-py"):
                (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, work / name)
        env = {**os.environ, "PYTHONPATH": str(work / "gguf-py")}
        size_in = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
        ctxq_exe = str(Path(sys.executable).with_name("ctxq"))
        rows = []
        for kind in args.type.split(","):
            ours, theirs = tmp / f"ctxq-{kind}.gguf", tmp / f"llama-{kind}.gguf"
            best = {"ctxq": (1e9, 1 << 62), "llama.cpp": (1e9, 1 << 62)}
            for _ in range(args.repeat):  # alternate, so both see the same page cache
                pre = args.family and FAMILIES[args.family][2] is _smollm2_tokenizer  # see _PRE_AS_GIVEN
                entry = ["-c", _PRE_AS_GIVEN, str(work), "smollm"] if pre else [str(work / "convert_hf_to_gguf.py")]
                w, r = run([sys.executable, *entry, args.model, "--outtype", kind, "--outfile", str(theirs)],
                           env=env, cwd=work)
                best["llama.cpp"] = (min(best["llama.cpp"][0], w), min(best["llama.cpp"][1], r))
                w, r = run([ctxq_exe, "convert", args.model, kind, "-o", str(ours), "--force"])
                best["ctxq"] = (min(best["ctxq"][0], w), min(best["ctxq"][1], r))
            same, n = same_tensors(ours, theirs)
            rows.append((kind, best, ours.stat().st_size, theirs.stat().st_size, same, n))
            ours.unlink()
            theirs.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    label = f"random {args.family} at real widths" if args.family else args.model
    print(f"model: {label}, {size_in / 2**20:.0f} MiB of safetensors  (best of {args.repeat} runs each)")
    print(f"{'type':<6} {'tool':<10} {'wall s':>8} {'peak RSS MiB':>13} {'output MiB':>11}")
    for kind, best, size_ours, size_theirs, same, n in rows:
        (wo, ro), (wt, rt) = best["ctxq"], best["llama.cpp"]
        print(f"{kind:<6} {'llama.cpp':<10} {wt:>8.2f} {rt / 2**20:>13.1f} {size_theirs / 2**20:>11.1f}")
        print(f"{kind:<6} {'ctxq':<10} {wo:>8.2f} {ro / 2**20:>13.1f} {size_ours / 2**20:>11.1f}")
        print(f"{kind:<6} {'ratio':<10} {wo / wt:>7.2f}x {ro / rt:>12.2f}x   "
              f"(targets: wall <= 1.0x, RSS <= 0.5x; {same}/{n} tensors byte-identical)")


if __name__ == "__main__":
    main()
