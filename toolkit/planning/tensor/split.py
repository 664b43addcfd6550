"""Where llama.cpp's tensor mode (`-sm tensor`) puts each tensor's bytes, card by card.

In tensor mode llama.cpp makes one "meta" device of every GPU it is given and cuts each tensor of the
offloaded layers across them (`llama_meta_device_get_split_state`, src/llama-model.cpp): the attention's
Q/K/V and the FFN's up/gate by rows (axis 1), attention output and FFN down by columns (axis 0), the KV
cache by heads (axis 0), and everything else (norms, router, shared experts, a tied output's copy) whole on
every card. Each cut follows `tensor_split` as cumulative float32 fractions, rounded down to a granularity
(whole KV heads, 128-wide FFN blocks), and the rounding rotates from layer to layer (`rotation`) so that the
remainder does not always land on the last card. This module is that function as data: for one model,
`TensorSplit(gguf, info, n, type_k, type_v).at(proportions)` gives each card's bytes per layer (weights and KV), which
`planning.tensor` sums for a plan. It is checked against real loads over RPC workers (each worker's
`GGML_RPC_DEBUG` log of the buffers it allocates: scripts/accuracy.py's tensor section), not against itself.

Segments (`_segments`), granularity (`_granularity`) follow the same source, the gated delta nets of
Qwen3-Next / Qwen3.5 and the recurrent state included (`state_widths`, `CardBytes.card_state`); llama.cpp's own
refusals are asked of the linked libllama (`not_planned`, llama/archs.py). Where llama.cpp has special rules ctxq
does not copy (DeepSeek-V4, other recurrent families), the plan refuses tensor mode in one line rather than guess.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ...gguf.info import OUTPUT_NORM, ModelInfo
from ...gguf.reader import GGML_BLOCKS, GGML_TYPES, GGUFFile
from .hybrid import MIRRORED_STATE, QWEN_GATED, RECURRENT_PLANNED, qwen_segments, recurrent_granularity, state_widths

# Architectures llama.cpp splits by rules of their own (gated Q, linear attention segments, grouped output,
# aliased caches) that this module does not copy: ctxq does not plan tensor mode for them.
SPECIAL = frozenset(("deepseek4", "dflash", "hrm_text"))

ALIGN = 128  # the largest buffer alignment among the backends (CUDA's 128; CPU and RPC 32): an over-estimate

# Tensors outside the blocks made with a layer's buffer type (llm_tensor_info LAYER_REPEATING), so whole on every card
# with it: Gemma 4's per-layer input projection (layer 0); rope_freqs, with the first layer using it (gemma4.cpp: the
# first full-attention one; later layers' TENSOR_DUPLICATED copies are the same tensor in the same buffer).
LAYER_TENSORS = {
    "per_layer_model_proj.weight": lambda info: 0,
    "per_layer_proj_norm.weight": lambda info: 0,
    "rope_freqs.weight": lambda info: next((il for il, la in enumerate(info.layers)
                                            if la.attention and not la.sliding), 0) if info.arch == "gemma4" else 0,
}

MIRRORED, PARTIAL = -1, -2  # whole on every card; whole on every card, summed (ffn_down_exps.bias)

_B = r"blk\.\d+\."
_RULES = [  # (pattern, axis, companion tensors whose type sets the granularity), in llama.cpp's order
    (_B + r"attn_q\.weight|" + _B + r"attn_(k|v)\.weight", 1, ("attn_output.weight", "ssm_out.weight")),
    (_B + r"attn_q\.bias|" + _B + r"attn_(k|v)\.bias", 0, ("attn_output.weight", "ssm_out.weight")),
    (_B + r"attn_qkv\.weight", 1, ("attn_output.weight", "ssm_out.weight")),
    (_B + r"attn_qkv\.bias", 0, ("attn_output.weight", "ssm_out.weight")),
    (_B + r"attn_(q|k)_norm\.weight", "qk_norm", ("attn_output.weight",)),
    (r"cache_(k|v)_l\d+|" + _B + r"attn_sinks\.weight", 0, ("attn_output.weight",)),
    (_B + r"attn_output\.weight", 0, ()),
    (_B + r"attn_output\.bias", MIRRORED, ()),
    (_B + r"attn_gate\.weight", 1, ("attn_output.weight", "ssm_out.weight")),
    (_B + r"ssm_dt\.bias|" + _B + r"ssm_a", 0, ("ssm_out.weight",)),  # gated delta nets (Qwen3-Next, Qwen3.5)
    (_B + r"ssm_(alpha|beta|ba)\.weight", 1, ("ssm_out.weight",)),
    (r"cache_(r|s)_l\d+", "state", ("ssm_out.weight",)),  # the recurrent state: mirrored for LFM2 (below)
    (_B + r"ssm_conv1d\.weight", 1, ("ssm_out.weight",)),
    (_B + r"ssm_out\.weight", 0, ()),
    (_B + r"ffn_(up|gate)(_exps)?\.weight", 1, ("ffn_down.weight", "ffn_down_exps.weight")),
    (_B + r"ffn_(up|gate)(_exps)?\.bias", 0, ("ffn_down.weight", "ffn_down_exps.weight")),
    (_B + r"ffn_gate_up(_exps)?\.weight", 1, ("ffn_down.weight", "ffn_down_exps.weight")),
    (_B + r"ffn_down(_exps)?\.weight", 0, ("ffn_down.weight", "ffn_down_exps.weight")),
    (_B + r"ffn_down\.bias", MIRRORED, ()),
    (_B + r"ffn_down_exps\.bias", PARTIAL, ("ffn_down_exps.weight",)),
    (r"output\.weight", 1, ()),
    (r"output\.bias", 0, ()),
]
_RULES = [(re.compile(p), axis, comp) for p, axis, comp in _RULES]
_FFN = re.compile(_B + r"ffn_(up|gate|gate_up|down)(_exps|_shexp)?\.(weight|bias)")
_Q = re.compile(_B + r"attn_q\.(weight|bias)")
_KV = re.compile(_B + r"attn_(k|v)\.(weight|bias)|cache_(k|v)_l\d+")
_QKV = re.compile(_B + r"attn_qkv\.(weight|bias)")
_UP = re.compile(_B + r"ffn_up(_exps)?\.(weight|bias)")
_GATE_UP = re.compile(_B + r"ffn_gate_up(_exps)?\.weight")
_SINKS = re.compile(_B + r"attn_sinks\.weight")
_OUT = re.compile(_B + r"attn_output\.weight")
_GATE = re.compile(_B + r"attn_gate\.weight")


def not_planned(arch: str, info: ModelInfo) -> str | None:
    """Why ctxq cannot plan tensor mode for this model (one line), or None. Whether llama.cpp refuses the
    architecture is asked of the linked libllama (llama/archs.py: llm_arch_supports_sm_tensor)."""
    from ...llama.archs import refuses_tensor_mode

    if refuses_tensor_mode(arch):
        return f"llama.cpp does not run tensor mode for architecture '{arch}' (LLAMA_SPLIT_MODE_TENSOR not implemented)"
    if arch in SPECIAL or (arch not in RECURRENT_PLANNED and any(la.recurrent for la in info.layers)):
        return (f"ctxq does not plan tensor mode for '{arch}' yet (its recurrent or gated layers are split by rules "
                "of their own): use split_mode=layer")
    return None


def row_bytes(type_: int, n: int) -> int:
    """ggml_row_size(type, n)."""
    block, size = GGML_BLOCKS[type_]
    return n // block * size


def _split(ne: int, scan: list, g: int, n: int, rotation: int) -> list[int]:
    """One segment of `ne` elements cut over n cards: llama.cpp's float32 scan, each boundary rounded down
    to g, the last card in rotated order taking the rest."""
    import numpy as np

    out = [0] * n
    low = 0
    total = np.float32(scan[-1])
    for j in range(n - 1):
        if total == 0:
            high = ne * (j + 1) // n
        else:
            high = int(np.float32(ne) * np.float32(scan[j]) / total)  # float32 product and quotient, truncated
        high -= high % g
        out[(j + rotation) % n] = high - low
        low = high
    out[(n - 1 + rotation) % n] = ne - low
    return out


@dataclass
class CardBytes:
    """Each card's bytes in tensor mode for one split: weights[il][j] and the K and V bytes per cache cell
    k_cell[il][j], v_cell[il][j] of each layer, out[j] the output head (output.weight, output_norm, a tied
    model's copy of token_embd); mirrored[il] the part of layer il's weights on every card (in weights)."""

    proportions: tuple[float, ...]
    weights: list[list[int]]
    k_cell: list[list[int]]
    v_cell: list[list[int]]
    out: list[int]
    mirrored: list[int]
    state: list[list[int]] | None = None  # state[il][j]: card j's recurrent state of layer il (one sequence)

    def card_weights(self, layers, has_output: bool) -> list[int]:
        n = len(self.proportions)
        return [sum(self.weights[il][j] for il in layers) + (self.out[j] if has_output else 0) for j in range(n)]

    def card_state(self, layers, n_seq: int = 1) -> list[int]:
        """Recurrent-state bytes per card of `layers` (llama_memory_recurrent: max(1, n_seq_max) cells)."""
        n = len(self.proportions)
        return [sum(self.state[il][j] for il in layers) * max(1, n_seq) if self.state else 0 for j in range(n)]

    def card_kv(self, layers, cells) -> list[int]:
        """KV bytes per card of `layers`; cells(il): that layer's cache cells (times its streams)."""
        n = len(self.proportions)
        return [sum(_pad(self.k_cell[il][j] * cells(il)) * bool(self.k_cell[il][j])
                    + _pad(self.v_cell[il][j] * cells(il)) * bool(self.v_cell[il][j]) for il in layers)
                for j in range(n)]


class TensorSplit:
    """llama.cpp's split state for one model on n cards, the rules applied once (`at(proportions)` is then
    arithmetic: the planner asks for many proportions)."""

    def __init__(self, g: GGUFFile, info: ModelInfo, n_devices: int, type_k: str, type_v: str):
        self.n, self.n_layer = n_devices, info.n_layer
        model = _Model(g, info, n_devices)
        self.specs: list[tuple] = []  # (layer or -1 for the head, type, axis, shape, segments, rotation)
        self.fixed_layer = [0] * info.n_layer  # mirrored bytes per layer
        self.fixed_out = 0
        self.cache: list[list[tuple | None]] = []  # per layer: K and V specs (type, width, segments, rotation)
        for t in g.tensors:
            m = re.match(r"blk\.(\d+)\.", t.name)
            il = int(m.group(1)) if m else None
            if il is not None and (il >= info.n_layer or info.layers[il].mtp):
                continue  # NextN blocks llama.cpp does not load
            if il is None and t.name in LAYER_TENSORS:  # whole on every card with the layer that makes it
                self.fixed_layer[LAYER_TENSORS[t.name](info)] += _pad(t.nbytes)
                continue
            if il is None and not (t.name.startswith("output") or t.name == OUTPUT_NORM.get(info.arch)
                                   or (t.name == "token_embd.weight" and info.output_tied)):
                continue  # token_embd (CPU memory) and rope factors etc. (planned with the host)
            spec = model.spec(t.name, t.shape, t.type, il) if t.name != "token_embd.weight" else None
            if spec is None:
                if il is None:
                    self.fixed_out += _pad(t.nbytes)
                else:
                    self.fixed_layer[il] += _pad(t.nbytes)
            else:
                self.specs.append((-1 if il is None else il, t.type, *spec))
        for il in range(info.n_layer):
            la = info.layers[il]
            if not la.attention or la.mtp:
                self.cache.append([None, None])
                continue
            row = []
            for kind, width, tname in (("k", info.n_embd_k_gqa(il), type_k), ("v", info.n_embd_v_gqa(il), type_v)):
                typ = GGML_TYPES[tname.upper()]
                axis, shape, segs, rot = model.spec(f"cache_{kind}_l{il}", (width, 1), typ, il)
                row.append((typ, segs, rot))
            self.cache.append(row)
        self.state: list[list[tuple | int | None]] = []  # per layer: r and s specs (segments, rotation) or whole bytes
        n_r, n_s = state_widths(g, info)
        for il in range(info.n_layer):
            row = []
            for kind, width in (("r", n_r), ("s", n_s)):
                if not info.layers[il].recurrent or info.layers[il].mtp or not width:
                    row.append(None)
                    continue
                spec = model.spec(f"cache_{kind}_l{il}", (width, 1), GGML_TYPES["F32"], il)
                row.append(_pad(width * 4) if spec is None else (spec[2], spec[3]))  # f32 (type_r, type_s)
            self.state.append(row)
        self._np = model._np
        self.model = model

    def at(self, proportions) -> CardBytes:
        n = self.n
        prop = [float(p) for p in proportions]
        if len(prop) != n:
            raise ValueError(f"{len(prop)} proportions for {n} cards")
        scans = [self.model.scan(prop, r) for r in range(n)]
        memo: dict = {}

        def cut(segs, rot):
            key = (segs, rot)
            got = memo.get(key)
            if got is None:
                per = [0] * n
                for ne_s, nr_s, g_s in segs:
                    for j, c in enumerate(_split(ne_s, scans[rot], g_s, n, rot)):
                        per[j] += c * nr_s
                got = memo[key] = per
            return got

        weights = [[f] * n for f in self.fixed_layer]
        out = [self.fixed_out] * n
        for il, typ, axis, shape, segs, rot in self.specs:
            row = out if il < 0 else weights[il]
            for j, c in enumerate(cut(segs, rot)):
                if c:
                    s = list(shape)
                    s[axis] = c
                    row[j] += _pad(row_bytes(typ, s[0]) * s[1] * s[2] * s[3])
        k_cell, v_cell = [], []
        for il in range(self.n_layer):
            kv = []
            for spec in self.cache[il]:
                if spec is None:
                    kv.append([0] * n)
                else:
                    typ, segs, rot = spec
                    kv.append([row_bytes(typ, c) for c in cut(segs, rot)])
            k_cell.append(kv[0])
            v_cell.append(kv[1])
        state = []
        for row in self.state:
            per = [0] * n
            for spec in row:
                if isinstance(spec, int):  # mirrored: whole on every card
                    per = [x + spec for x in per]
                elif spec is not None:
                    per = [x + _pad(c * 4) * bool(c) for x, c in zip(per, cut(*spec))]
            state.append(per)
        return CardBytes(tuple(proportions), weights, k_cell, v_cell, out, list(self.fixed_layer), state)


def _pad(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _Model:
    """llama.cpp's split rules for one model: the hparams and tensors they read."""

    def __init__(self, g: GGUFFile, info: ModelInfo, n: int):
        import numpy as np

        self.g, self.info, self.n, self.arch = g, info, n, info.arch

        def key(name: str) -> int:
            v = g.arch_get(name, 0)
            return int(v) if isinstance(v, int) else 0

        # llama_hparams: ssm_d_state (head dim of the delta net), ssm_n_group (K heads), ssm_dt_rank (V heads)
        self.d_state, self.n_group, self.dt_rank, self.d_conv = (
            key("ssm.state_size"), key("ssm.group_count"), key("ssm.time_step_rank"), key("ssm.conv_kernel"))
        kinds = [(la.recurrent, la.sliding) for la in info.layers]
        seen: dict = {}
        self.il_eff = []
        for k in kinds:  # get_il_eff: earlier layers of the same kind (recurrent, sliding)
            self.il_eff.append(seen.get(k, 0))
            seen[k] = seen.get(k, 0) + 1
        self.n_layer_main = sum(1 for la in info.layers if not la.mtp)  # hparams.n_layer(): NextN blocks not counted
        # llama_hparams::n_embd_head_k(il) / n_embd_head_v(il): a sliding-window layer's own head size where the header
        # gives one (Gemma 4: key_length_swa 256 beside 512), else the full layers' (load_arch_hparams)
        swa = (key("attention.key_length_swa") or info.head_dim_k, key("attention.value_length_swa") or info.head_dim_v)
        self.head_dims = [swa if la.sliding else (info.head_dim_k, info.head_dim_v) for la in info.layers]
        self._np = np

    def rotation(self, il: int | None) -> int:
        return (self.n_layer_main if il is None else self.il_eff[il]) % self.n

    def scan(self, prop: list[float], rotation: int) -> list:
        np = self._np
        acc, out = np.float32(0), []
        for j in range(self.n):
            acc = np.float32(acc + np.float32(prop[(j + rotation) % self.n]))
            out.append(acc)
        return out

    def rule(self, name: str):
        for pat, axis, comp in _RULES:
            if pat.fullmatch(name):
                return axis, comp
        return MIRRORED, ()

    def _companion(self, il: int | None, comp: tuple[str, ...]) -> int:
        """The ggml type whose block size sets the granularity (tc.tensor_axis_0's)."""
        for c in comp:
            t = self.g.tensor(f"blk.{il}.{c}")
            if t is not None:
                return t.type
        raise ValueError(f"layer {il} has none of {', '.join(comp)}")

    def n_ff(self, il: int) -> int:
        for name in (f"blk.{il}.ffn_down.weight", f"blk.{il}.ffn_down_exps.weight"):
            t = self.g.tensor(name)
            if t is not None:
                return t.shape[0]
        return 0

    def spec(self, name: str, shape: tuple[int, ...], type_: int, il: int | None):
        """(axis, shape padded to 4 dims, segments ((elements, repeats, granularity), ...), rotation) of a
        tensor cut across the cards, or None when it is whole on every card."""
        axis, comp = self.rule(name)
        if axis == "qk_norm":
            if len(shape) < 2 or shape[1] == 1:
                return None
            axis = 1
        if axis == "state":  # get_tensor_config: LFM2's short-convolution state mirrored, else cut on axis 0
            if self.arch in MIRRORED_STATE:
                return None
            axis = 0
        if axis in (MIRRORED, PARTIAL) or axis >= len(shape):
            return None
        blck = GGML_BLOCKS[self._companion(il, comp) if comp else type_][0]
        segs = self._segments(name, shape[axis], il)
        gran = self._granularity(name, blck, il, segs, shape)
        shape4 = tuple(shape) + (1,) * (4 - len(shape))
        return axis, shape4, tuple((ne, nr, g) for (ne, nr), g in zip(segs, gran)), self.rotation(il)

    def _segments(self, name: str, ne: int, il: int | None) -> list[tuple[int, int]]:
        info = self.info
        if il is not None and self.arch in QWEN_GATED:
            return qwen_segments(self, name, ne, il)
        if il is not None and _QKV.fullmatch(name):
            la = info.layers[il]
            nq = la.n_head * self.head_dims[il][0]
            nk, nv = info.n_embd_k_gqa(il), info.n_embd_v_gqa(il)
            if nq + nk + nv != ne:
                raise ValueError(f"{name}: {ne} rows, not {nq} + {nk} + {nv}")
            return [(nq, 1), (nk, 2)] if nk == nv else [(nq, 1), (nk, 1), (nv, 1)]
        if il is not None and _UP.fullmatch(name):
            n_ff = self.n_ff(il)
            return [(n_ff, 2)] if n_ff and ne == 2 * n_ff else [(ne, 1)]
        if il is not None and _GATE_UP.fullmatch(name):
            return [(ne // 2, 2)]
        return [(ne, 1)]

    def _granularity(self, name: str, blck: int, il: int | None, segs, shape) -> list[int]:
        info = self.info
        if il is not None and info.layers[il].recurrent:  # get_split_granularity's linear attention
            g = recurrent_granularity(self, name, blck, len(segs))
            if g is not None:
                return g
        elif il is not None and info.layers[il].attention and info.layers[il].n_head_kv:
            la = info.layers[il]
            head_k, head_v = self.head_dims[il]
            n_gqa = la.n_head // la.n_head_kv
            n_embd_q = n_gqa * head_k
            perf = blck
            while perf < 128 and perf * self.n < n_embd_q:
                perf *= 2
            g_q = math.lcm(n_embd_q, perf)
            g_head = g_q // head_k
            if _SINKS.fullmatch(name):
                return [g_head]
            gated = self.arch in QWEN_GATED  # Q carries the output gate: n_embd_q doubled
            if _Q.fullmatch(name):
                return [math.lcm(2 * n_embd_q, perf) if gated else g_q]
            if _OUT.fullmatch(name):
                return [g_head * head_v]
            if _GATE.fullmatch(name):
                return [g_head if len(shape) > 1 and shape[1] == la.n_head else g_q]
            g_kv = g_q // n_gqa
            g_v = (g_kv // head_k) * head_v
            if _KV.fullmatch(name):
                return [g_v if ("attn_v" in name or "cache_v" in name) else g_kv]
            if _QKV.fullmatch(name):
                if gated:
                    return [math.lcm(2 * n_embd_q, perf), g_kv]
                return [g_q, g_kv, g_v] if len(segs) == 3 else [g_q, g_kv]
        if _FFN.fullmatch(name):
            return [math.lcm(blck, 128)] * len(segs)
        return [1] * len(segs)
