"""Issue 28's architectures at real layer widths, as header-only GGUFs written by llama.cpp's own converter.

The config is the transformers class's defaults (which are the reference model's config.json: DeepSeek-V3,
Llama-4-Scout, OLMo-3-7B, Gemma 4) cut to a few layers. The model is made on torch's meta device (no memory),
its state dict is turned into the names and shapes `save_pretrained` would write (transformers'
`revert_weight_conversion`: per-expert tensors, tied weights dropped) and written as a BF16 safetensors file
whose data is a sparse hole. llama.cpp's `convert_hf_to_gguf.py` then runs unchanged in a child process, with
gguf-py's `GGUFWriter.write_tensors_to_file` replaced so that it skips over each tensor's bytes instead of
writing them: the metadata and tensor index are the converter's, the data a hole of the right size. Like the
hybrid section's real-width cells the vocabulary is cut (SmolLM2's 49,152 tokens, the tokenizer these
checkpoints carry) and, where a layer holds hundreds of experts, so is the expert count (said per entry):
expert weights are exact in every table so far, and the per-token compute depends on the experts used.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .. import tempfiles
from ..conversion.upstream import converter_dir, converter_env
from ..errors import CtxqError
from ..paths import ctxq_home
from .synthetic import write_sparse_safetensors
from .upstream_models import SPECS, SPM_IDS, SPM_VOCAB, NotBuildable, cache_key, make_config, write_tokenizer

_VOCAB = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=131072)


@dataclass(frozen=True)
class Real:
    base: str  # the entry of upstream_models.SPECS whose class and converter quirks this shares
    config: dict = field(default_factory=dict)  # over the class's defaults (the real model's)
    note: str = ""


REALISTIC: dict[str, Real] = {
    # DeepSeek-V3: 7168 wide, MLA (128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128); layer 0 dense
    # (18432), layer 1 MoE: 8 of its 256 experts of 2048, 8 used (as the real one), one shared
    "deepseek-v3-2l": Real("deepseek-v3", dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8,
                                               n_group=1, topk_group=1, scoring_func="sigmoid",
                                               topk_method="noaux_tc", rope_scaling=None),
                           note="8 of 256 experts"),
    # Llama-4-Scout: 5120 wide, 40 heads / 8 KV of 128, chunked attention (8192) on 3 of 4 layers, a NoPE
    # full-attention layer every 4th; MoE in every layer: 2 of its 16 experts of 8192, 1 used, and a shared one
    "llama4-scout-4l": Real("llama4", dict(num_hidden_layers=4, num_local_experts=2, layer_types=None,
                                            no_rope_layers=None, moe_layers=None), note="2 of 16 experts"),
    # OLMo-3-7B: 4096 wide, 32 heads of 128, FFN 11008, sliding window 4096 on 3 of 4 layers
    "olmo3-7b-4l": Real("olmo3", dict(num_hidden_layers=4, sliding_window=4096, layer_types=None)),
    # Gemma 4 (transformers' Gemma4TextConfig defaults): 2304 wide, 8 heads / 4 KV, sliding layers of 256-wide
    # heads (window 512) and every 6th full with 512-wide heads, per-layer embeddings of 256; 6 layers
    "gemma4-6l": Real("gemma4", dict(num_hidden_layers=6, layer_types=None, vocab_size_per_layer_input=SPM_VOCAB,
                                     per_layer_config={"05": {"head_dim": 512}})),
    # Gemma 4 E2B (google/gemma-4-E2B's text config): 1536 wide, 8 heads / 1 KV of 256 (512 on full layers), FFN
    # 6144 (twice as wide on the KV-shared layers), per-layer embeddings of 256, window 512, 20 of 35 layers sharing
    # the caches of earlier ones; here 8 layers s s s f, then 4 shared s s s f
    "gemma4-e2b-8l": Real("gemma4", dict(
        num_hidden_layers=8, hidden_size=1536, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, sliding_window=512, layer_types=["sliding_attention"] * 3 + ["full_attention"]
        + ["sliding_attention"] * 3 + ["full_attention"], num_kv_shared_layers=4, use_double_wide_mlp=True,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=SPM_VOCAB,
        per_layer_config={"03": {"head_dim": 512}, "07": {"head_dim": 512}}), note="8 of 35 layers, 4 shared"),
    # Gemma 4 E2B's first four layers (s s s f), none shared: its one 256-wide K head per layer (512 on the full one)
    # without the KV-shared tail, as a multi-query model (tensor/batch.py's rotated cache)
    "gemma4-e2b-4l": Real("gemma4", dict(
        num_hidden_layers=4, hidden_size=1536, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, sliding_window=512, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        num_kv_shared_layers=0, hidden_size_per_layer_input=256, vocab_size_per_layer_input=SPM_VOCAB,
        per_layer_config={"03": {"head_dim": 512}}), note="4 of 35 layers, none shared"),
}


def build_realistic(name: str) -> Path:
    """The header-only GGUF of `REALISTIC[name]` (f16), cached beside the tiny checkpoints."""
    if name not in REALISTIC:
        raise CtxqError(f"unknown real-width model {name!r}: one of {', '.join(REALISTIC)}")
    r = REALISTIC[name]
    dest = ctxq_home() / "upstream-models" / f"{name}-{cache_key(r.base, 'f16', r.config)}.gguf"
    if dest.is_file():
        return dest
    with tempfiles.building(dest), tempfiles.folder(dest, "build") as tmp:
        if dest.is_file():  # another process built it while this one waited
            return dest
        hf = tmp / "hf"
        hf.mkdir()
        _write_sparse_checkpoint(name, r, hf)
        part = tmp / "out.gguf"
        _run_sparse_converter(name, hf, part)
        os.replace(part, dest)
    return dest


def _write_sparse_checkpoint(name: str, r: Real, out: Path) -> None:
    import torch
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    s = SPECS[r.base]
    cls, cfg = make_config(name, s, {**_VOCAB, **(SPM_IDS if s.spm_bpe else {}), **r.config})
    with torch.device("meta"):
        model = cls(cfg)
    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))
    if s.renames:
        import re

        for pattern, repl in s.renames:
            state = {re.sub(pattern, repl, k): v for k, v in state.items()}
    cfg.save_pretrained(out)
    write_sparse_safetensors(out / "model.safetensors", {k: tuple(v.shape) for k, v in state.items()})
    if s.saved_config:
        import json

        cfg_file = out / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **s.saved_config}, indent=2) + "\n")
    write_tokenizer(out, s.added_tokens, s.spm_bpe)


# Run in the converter's child: GGUFWriter skips each tensor's bytes (a hole) instead of materializing them.
_SPARSE_MAIN = r'''
import runpy, sys
import gguf.gguf_writer as gw

def write_tensors_to_file(self, *, progress=False):
    self.write_ti_data_to_file()
    for fout in self.fout:
        self.write_padding(fout, fout.tell())
    for fout, tensors in zip(self.fout, self.tensors):
        for ti in tensors.values():
            fout.seek(gw.GGUFWriter.ggml_pad(ti.nbytes, self.data_alignment), 1)
            ti.tensor = None
        fout.truncate(fout.tell())
    self.state = gw.WriterState.WEIGHTS

gw.GGUFWriter.write_tensors_to_file = write_tensors_to_file
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])  # the converter imports its conversion/ package
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _run_sparse_converter(name: str, hf: Path, outfile: Path) -> None:
    folder = converter_dir()
    main = hf.parent / "sparse_convert.py"
    main.write_text(_SPARSE_MAIN)
    cmd = [sys.executable, str(main), str(folder / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
           "--outfile", str(outfile)]
    p = subprocess.run(cmd, env=converter_env(folder), cwd=folder, capture_output=True, text=True, timeout=900)
    if p.returncode:
        lines = [ln for ln in (p.stderr + p.stdout).strip().splitlines() if ln.strip()]
        raise NotBuildable(f"{name}: llama.cpp's converter failed: {lines[-1] if lines else p.returncode}")
