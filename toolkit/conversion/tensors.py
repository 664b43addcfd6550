"""The tensors of a converted GGUF: which ones, in llama.cpp's names and types, and writing them.

`plan_tensors` maps a checkpoint's tensors through gguf's `TensorNameMap` with the family's
transforms; mixture-of-experts weights are first stacked into one 3-D tensor per layer and
projection (`ctxq.converters.experts`). `write` streams them into a GGUF, one block at a time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as FT

from ..converters.base import Family, TensorPlan, head_dim, output_is_token_embd, permute_rope, write_common
from ..converters.checkpoint import Checkpoint
from ..converters.experts import n_experts, stack_experts
from ..converters.tokenizer import Vocab
from ..errors import ConversionError
from ..gguf.reader import tensor_nbytes

# progress(done, total, what): what is "write:<tensor>" while bytes are written here, and
# "quantize:<tensor>" while ctxq.conversion.quantize works tensor by tensor.
Progress = Callable[[int, int, str], None]

FLOAT_TYPES = {"f32": (T.F32, FT.ALL_F32), "f16": (T.F16, FT.MOSTLY_F16), "bf16": (T.BF16, FT.MOSTLY_BF16),
               "q8_0": (T.Q8_0, FT.MOSTLY_Q8_0)}
_QK8_0 = gguf.GGML_QUANT_SIZES[T.Q8_0][0]  # 32 weights per Q8_0 block
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# Kept F32 by llama.cpp's converter at every float type (ModelBase.prepare_tensors): routers and conv
# kernels, and every tensor not named .weight (biases, Mamba's ssm_a and ssm_d, which ggml_ssm_scan needs in F32)
def plan_tensors(ckpt: Checkpoint, family: Family, cfg: dict, kind: str) -> list[TensorPlan]:
    """Every output tensor in llama.cpp's naming with its type and a loader applying the family's transforms."""
    n_layer = cfg["num_hidden_layers"]
    nmap = gguf.get_tensor_name_map(family.arch, n_layer)
    n_head = cfg["num_attention_heads"]
    n_head_kv = cfg.get("num_key_value_heads") or n_head
    if isinstance(n_head_kv, list):  # per layer (hybrids, Family.config): 0 where a layer has no attention
        n_head_kv = max(n_head_kv)
    skip_head = output_is_token_embd(ckpt, family, cfg)
    tensors = ckpt.tensors
    if family.rename:
        tensors = {new: ref for name, ref in tensors.items() if (new := family.rename(name, cfg)) is not None}
    plans: list[TensorPlan] = []
    stacked, consumed = [], set()
    if family.experts is not None:
        stacked, consumed = stack_experts(tensors, n_experts(cfg), family.experts)
    for s in stacked:
        name = _gguf_name(nmap, s.name, family)
        kind_of = s.raw_type if s.raw_type is not None else _out_type(name, s.shape, kind)
        plans.append(TensorPlan(name, s.shape, kind_of, s.blocks, raw=s.raw_type is not None))
    for hf_name, ref in tensors.items():
        if hf_name in consumed:
            continue
        if hf_name.endswith("rotary_emb.inv_freq") or (skip_head and hf_name == "lm_head.weight"):
            continue  # llama.cpp derives these (or duplicates token_embd for a tied output)
        if family.rewrite and (parts := family.rewrite(hf_name, ref, cfg)) is not None:
            for part, shape, load in parts:  # whole tensors: these transforms mix rows (and they are small)
                name = part if part.startswith(("blk.", "token_embd", "output")) else _gguf_name(nmap, part, family)
                plans.append(TensorPlan(name, shape, _out_type(name, shape, kind), (lambda f: lambda: [f()])(load)))
            continue
        name = _gguf_name(nmap, hf_name, family)
        transform = None
        if family.permute_qk and re.search(r"\.attn_(q|k)\.", name):
            heads = n_head if ".attn_q." in name else n_head_kv
            transform = (lambda h: lambda x: permute_rope(x, h))(heads)
        elif family.norm_shift and name.endswith("norm.weight"):
            transform = (lambda s: lambda x: x + np.float32(s))(family.norm_shift)
        # Whole tensor when a transform needs it (Q/K permutation mixes rows within a head, and
        # those tensors are small); otherwise row blocks, so the embedding never sits in memory whole.
        blocks = (lambda r, f: (lambda: [f(r.load_f32())]) if f else r.iter_f32)(ref, transform)
        plans.append(TensorPlan(name, ref.shape, _out_type(name, ref.shape, kind), blocks))
    for name, arr in (family.extra_tensors(cfg) if family.extra_tensors else {}).items():
        plans.append(TensorPlan(name, arr.shape, T.F32, (lambda a: lambda: [a])(arr)))
    if not any(p.name == "token_embd.weight" for p in plans):
        raise ConversionError(f"{ckpt.folder}: no token embedding tensor (model.embed_tokens.weight)")
    if head_dim(cfg) % 2:
        raise ConversionError(f"head_dim {head_dim(cfg)} is odd; rotary embeddings need an even head size")
    plans.sort(key=lambda p: (int(m.group(1)) if (m := _BLOCK_RE.match(p.name)) else
                              (-1 if p.name.startswith("token_embd") else n_layer), p.name))
    return plans


def _gguf_name(nmap: gguf.TensorNameMap, hf_name: str, family: Family) -> str:
    # a router's selection bias is a bias to gguf's map (llama.cpp's ModelBase.map_tensor_name renames it alike)
    hf = hf_name.removeprefix("language_model.").replace("e_score_correction_bias", "e_score_correction.bias")
    name = nmap.get_name(hf, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ConversionError(f"tensor {hf_name} has no place in llama.cpp's {family.arch_name} architecture")
    # every tensor llama.cpp loads is NAME.weight or NAME.bias (gpt-oss's `sinks` has no suffix in HF),
    # except Mamba's A and D (tn(LLM_TENSOR_SSM_A, i) in load_arch_tensors: no suffix)
    return name if name.endswith((".weight", ".bias", ".ssm_a", ".ssm_d")) else name + ".weight"


# Kept F32 whatever the type, as llama.cpp's converter does (ModelBase.prepare_tensors: routers,
# convolution kernels of recurrent layers): their ops need F32, or they are tiny and precision-critical.
_F32_KINDS = re.compile(r"\.(ffn_gate_inp|ffn_gate_inp_shexp|ssm_conv1d|shortconv\.conv)\.weight$")


def _out_type(name: str, shape: tuple[int, ...], kind: str) -> T:
    # As llama.cpp's converter: norms, biases and other 1-D tensors stay F32 (they are tiny and
    # several ops need F32 for them); Q8_0 needs rows that are whole blocks, else F16.
    # Expert biases are 2-D (experts x rows) but biases all the same.
    if len(shape) < 2 or name.endswith("norm.weight") or not name.endswith(".weight") or _F32_KINDS.search(name):
        return T.F32
    target = FLOAT_TYPES[kind][0]
    if target == T.Q8_0 and shape[-1] % _QK8_0:
        return T.F16
    return target


def nbytes(p: TensorPlan) -> int:
    return tensor_nbytes(p.type, tuple(reversed(p.shape)))  # TensorPlan shapes are in numpy order


def _encode(x: np.ndarray, t: T) -> np.ndarray:
    if t == T.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if t == T.F16:
        return x.astype(np.float16)
    return gguf.quants.quantize(x, t)  # BF16 (round to nearest even) and Q8_0, in numpy


def write(path: Path, family: Family, cfg: dict, vocab: Vocab, plans: list[TensorPlan], kind: str,
           name: str, progress: Progress | None, total: int) -> None:
    w = gguf.GGUFWriter(path, family.arch_name)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_file_type(FLOAT_TYPES[kind][1])
    if kind == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_common(cfg, w)
    w.add_vocab_size(len(vocab.tokens))
    if family.extra_hparams:
        family.extra_hparams(cfg, w)
    vocab.write(w)
    for p in plans:
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), nbytes(p), raw_dtype=p.type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # Tensor data is written here block by block (GGUFWriter.write_tensor_data takes whole
    # tensors): each tensor starts at the next multiple of the alignment, as the offsets it wrote say.
    f = w.fout[0]
    align = w.data_alignment
    done = 0
    try:
        for p in plans:
            f.write(b"\0" * (-f.tell() % align))
            start = f.tell()
            for block in p.blocks():
                data = block if p.raw else _encode(block, p.type)
                data.tofile(f)
                done += data.nbytes
                del data, block
                if progress:
                    progress(done, total, f"write:{p.name}")
            if f.tell() - start != nbytes(p):
                raise ConversionError(f"{p.name}: wrote {f.tell() - start} bytes, expected {nbytes(p)}")
        f.write(b"\0" * (-f.tell() % align))
    finally:
        w.close()


