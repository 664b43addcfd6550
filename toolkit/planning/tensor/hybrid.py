"""llama.cpp's tensor-mode split rules for recurrent layers and their state: the gated delta nets of Qwen3-Next and
Qwen3.5 (dense and MoE), and LFM2's short convolutions (mirrored). Read from `llama_meta_device_get_split_state`
(src/llama-model.cpp: get_tensor_config, get_split_segments, get_split_granularity) of the vendored llama.cpp;
used by `tensor_split._Model`, which applies them. Checked against real loads over RPC workers
(tests/test_tensor_hybrids.py): weights, KV and recurrent state per card.
"""

from __future__ import annotations

import math
import re

from ...gguf.info import ModelInfo, state_widths as info_state_widths
from ...gguf.reader import GGUFFile

_B = r"blk\.\d+\."
_QKV = re.compile(_B + r"attn_qkv\.(weight|bias)")
_GATE = re.compile(_B + r"attn_gate\.weight")
_GATE_UP = re.compile(_B + r"ffn_gate_up(_exps)?\.weight")
_CONV = re.compile(_B + r"ssm_conv1d\.weight")
_SSM_OUT = re.compile(_B + r"ssm_out\.weight")
_HEADS = re.compile(_B + r"ssm_dt\.bias|" + _B + r"ssm_a|" + _B + r"ssm_(alpha|beta)\.weight")
_BA = re.compile(_B + r"ssm_ba\.weight")
_R, _S = re.compile(r"cache_r_l\d+"), re.compile(r"cache_s_l\d+")
# Architectures whose gated Q and linear-attention segments llama.cpp cuts by rules of their own
# (get_split_segments' TAG_SPLIT_QGATE_QWEN); the LFM2 short-convolution state is mirrored (get_tensor_config).
QWEN_GATED = frozenset(("qwen3next", "qwen35", "qwen35moe", "qwen4exp"))
MIRRORED_STATE = frozenset(("lfm2", "lfm2moe"))
# Recurrent architectures whose every tensor and state this module cuts as llama.cpp does (checked against real
# loads: tests/test_tensor_hybrids.py); other recurrent ones ctxq does not plan in tensor mode yet.
RECURRENT_PLANNED = QWEN_GATED | MIRRORED_STATE


def state_widths(g: GGUFFile, info: ModelInfo) -> tuple[int, int]:
    """(n_embd_r, n_embd_s) of a recurrent layer: llama_hparams::n_embd_r / n_embd_s (gguf.info.state_widths)."""
    return info_state_widths(g, info.n_embd)


def qwen_segments(m, name: str, ne: int, il: int) -> list[tuple[int, int]]:
    """get_split_segments for Qwen3-Next / Qwen3.5 (src/llama-model.cpp, TAG_SPLIT_QGATE_QWEN): the gated Q
    of the attention layers, and the delta net's K/V heads (Qwen3-Next repeats K heads per V head in blocks,
    Qwen3.5 interleaves them: V segmented on the scale of K)."""
    info = m.info
    if not info.layers[il].recurrent and _QKV.fullmatch(name):
        return [(info.layers[il].n_head * info.head_dim_k * 2, 1), (info.n_embd_v_gqa(il), 2)]
    hk = m.d_state
    key_dim, value_dim = hk * m.n_group, hk * m.dt_rank
    if m.arch == "qwen3next":
        if _QKV.fullmatch(name) or _CONV.fullmatch(name):
            return [(key_dim, 2), (value_dim, 1)]
        if _R.fullmatch(name):
            return [(key_dim * (m.d_conv - 1), 2), (value_dim * (m.d_conv - 1), 1)]
    else:
        ratio = m.dt_rank // m.n_group
        if _QKV.fullmatch(name) or _CONV.fullmatch(name):
            return [(key_dim, 2 + ratio)]
        if _GATE.fullmatch(name) or _SSM_OUT.fullmatch(name):
            return [(key_dim, ratio)]
        if _HEADS.fullmatch(name):
            return [(m.n_group, ratio)]
        if _R.fullmatch(name):
            return [(key_dim * (m.d_conv - 1), 2 + ratio)]
        if _S.fullmatch(name):
            return [(m.n_group * hk * hk, ratio)]
    if _GATE_UP.fullmatch(name):
        return [(ne // 2, 2)]
    return [(ne, 1)]


def recurrent_granularity(m, name: str, blck: int, n_segs: int) -> list[int] | None:
    """get_split_granularity for a recurrent layer (src/llama-model.cpp, `hparams.is_recr(il)`): whole delta-net
    heads of ssm_d_state, at least lcm(block, 128) wide; None for a tensor it does not name (the FFN rule then)."""
    hd = m.d_state
    if not hd:
        return None
    g_qkv = math.lcm(math.lcm(blck, 128), hd)
    for pats, g in (((_QKV, _GATE, _CONV, _SSM_OUT), g_qkv), ((_HEADS,), g_qkv // hd), ((_BA,), 2 * (g_qkv // hd)),
                    ((_R,), g_qkv * (m.d_conv - 1)), ((_S,), g_qkv * hd)):
        if any(p.fullmatch(name) for p in pats):
            return [g] * n_segs
    return None
