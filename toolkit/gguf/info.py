"""`ctxq inspect`: what a GGUF model is, and the numbers the planner needs, from its header alone."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from ..errors import GGUFError
from .reader import FILE_TYPES, GGML_TYPES, GGUFFile, read_gguf, tensor_nbytes
from ..units import round_up

# Sliding-window rules per architecture, as each llama_model_<arch>::load_arch_hparams sets them
# (src/models/<arch>.cpp): (default window or None when the key must be present, pattern).
# pattern n: layer il is SWA when il % n < n - 1 (llama_hparams::set_swa_pattern); 0: every attention
# layer (lfm2 marks each non-recurrent layer SWA when its window key is set).
SWA_RULES: dict[str, tuple[int | None, int]] = {
    "gemma2": (4096, 2),
    "gemma3": (None, 6),
    "gpt-oss": (None, 2),  # llama_model_openai_moe: load_swa_pattern(ml, 2), window key required
    "lfm2": (0, 0),
}

# How each hybrid architecture marks its recurrent layers (llama_model_<arch>::load_arch_hparams):
# "interval": `attention.recurrent_layers` array, else full_attention_interval (default 4), layer il
#   recurrent when (il + 1) % interval != 0 (qwen35, qwen3next);
# "kv0": recurrent when head_count_kv(il) == 0 (lfm2, granitehybrid);
# "kv0_ff0": recurrent when head_count_kv(il) == 0 and feed_forward_length(il) == 0; a layer with
#   neither is an MLP layer with no memory at all (nemotron_h, llama_model::create_memory's filters).
RECURRENT_RULES: dict[str, str] = {
    "qwen35": "interval", "qwen35moe": "interval", "qwen3next": "interval",
    "lfm2": "kv0", "lfm2moe": "kv0", "granitehybrid": "kv0",
    "nemotron_h": "kv0_ff0", "nemotron_h_moe": "kv0_ff0",
}
# Multi-section rope: inp_pos holds GGML_MROPE_SECTIONS (4) positions per token (llama_hparams::n_pos_per_embd;
# the MROPE / IMROPE architectures of llama_model_rope_type).
MROPE_ARCHS = {"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen3tts"}
# Mamba-2 mixers (llama_model_granite_hybrid / nemotron_h: ssm_in, ssm_conv1d, ssm_scan).
MAMBA2_ARCHS = {"granitehybrid", "nemotron_h", "nemotron_h_moe", "mamba2", "falcon-h1"}
FULL_ATTENTION_INTERVAL = 4  # the default of llama_model_qwen35 / qwen3next::load_arch_hparams
# Multi-token-prediction (NextN) blocks: the last `{arch}.nextn_predict_layers` blocks. These architectures
# create their tensors with TENSOR_SKIP unless llama_model_params.load_mtp (false by default; the
# load_arch_tensors of src/models/<arch>.cpp), and the KV cache keeps only il < n_layer()
# (llama_model::create_memory's filters): they stay layer slots (-ngl counts them) that hold nothing.
MTP_ARCHS = {"qwen35", "qwen35moe", "qwen3next", "glm4moe", "glm-dsa", "glm5-next", "deepseek2", "deepseek32",
             "deepseek4", "nemotron_h", "mimo2", "step35", "bailingmoe3", "cohere2moe", "hy_v3"}
STATE_TYPE_BYTES = 4  # recurrent_type_r / _s are GGML_TYPE_F32 (llama_model::create_memory)

# Output norms under another name (LLM_TENSOR_OUTPUT_NORM_LFM2 is "token_embd_norm", llama-arch.cpp): they sit
# with the output head, not with the token embeddings on the host.
OUTPUT_NORM = {"lfm2": "token_embd_norm.weight", "lfm2moe": "token_embd_norm.weight"}
# Tensors outside the blocks in layer 0's buffer (llama_model_gemma3n::load_arch_tensors: tn(..., "weight", 0), a
# LLM_TENSOR_LAYER_REPEATING tensor) or the output's (LLM_TENSOR_LAYER_OUTPUT, llama-arch.cpp). Tiny Gemma 3n, 2 RPC
# devices: model buffers 3.28 / 13.96 MiB, 2.66 / 13.77 planned with them on the host (0.62 / 0.19 MiB).
LAYER_TENSORS, OUTPUT_TENSORS = {"per_layer_model_proj.weight": 0, "per_layer_proj_norm.weight": 0}, \
    {"altup_proj.weight", "altup_unembd_proj.weight"}

# The KV-cache types llama.cpp takes (common/arg.cpp's kv_cache_types, f32 aside), most precise first: every one
# runs flash attention on the CPU (ggml-cpu/ops.cpp needs a vec_dot for K and a to_float for V, which all have);
# on CUDA only the pairs compiled in run at speed (planning/kvpairs.py).
KV_TYPES = ("f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0")

# A tensor of layer il: `blk.<il>.` (llama.cpp's tensor names, LLM_TENSOR_NAMES).
BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# Routed-expert tensors (common/common.h LLM_FFN_EXPS_REGEX, searched in the name).
EXPERT_RE = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")
# A layer's dense FFN, or a MoE's shared experts (`_shexp`), that a plan may spill (overrides.FFN_REGEX)
FFN_RE = re.compile(r"^blk\.\d+\.ffn_(up|down|gate|gate_up)(_shexp|)\.")


def block_of(name: str) -> int | None:
    """The layer a tensor belongs to, or None for tensors outside the blocks."""
    m = BLOCK_RE.match(name)
    return int(m.group(1)) if m else None


def is_expert(name: str) -> bool:
    """A routed-expert tensor (its weights the MoE planner may place apart from the layer's)."""
    return EXPERT_RE.search(name) is not None


def kv_bytes(type_name: str, n_elements: int) -> int:
    """Bytes of one KV row of n_elements (ggml_row_size); GGUFError if the type's blocks do not divide it."""
    return tensor_nbytes(GGML_TYPES[type_name.upper()], (n_elements,))


KV_PAD = 256  # llama_context pads the KV cache to 256 cells (llama_kv_cache::get_padding)


def kv_cells(info: ModelInfo, n_ctx: int, n_ubatch: int, il: int) -> int:
    """Cells of layer il's KV cache at n_ctx: padded to 256; sliding-window layers hold a window
    (llama_kv_cache::get_size, llama_kv_cache_iswa)."""
    size = round_up(n_ctx, KV_PAD)
    if info.layers[il].sliding and info.n_swa:
        return min(size, round_up(info.n_swa + n_ubatch, KV_PAD))
    return size


def layer_kv_bytes(info: ModelInfo, il: int, n_ctx: int, n_ubatch: int, type_k: str, type_v: str) -> int:
    """Bytes of layer il's K and V cache; 0 for a layer without attention (the KV cache's layer filter)."""
    if not info.layers[il].attention:
        return 0
    return kv_cells(info, n_ctx, n_ubatch, il) * (kv_bytes(type_k, info.n_embd_k_gqa(il))
                                                 + kv_bytes(type_v, info.n_embd_v_gqa(il)))


@dataclass(frozen=True)
class LayerFacts:
    """One layer, as llama.cpp allocates it. The single source of per-layer facts for the planner."""

    attention: bool  # holds a KV cache (the attention filter of llama_model::create_memory)
    sliding: bool  # its KV cache is a window of n_swa tokens (llama_hparams::is_swa)
    recurrent: bool  # holds a recurrent state (llama_hparams::is_recr); hybrids like Falcon-H1 have both
    n_head: int
    n_head_kv: int
    state_bytes: int  # recurrent state per sequence: f32 rows of n_embd_r + n_embd_s (llama_memory_recurrent)
    dense_bytes: int  # weights of blk.<il>.* that are not routed experts
    expert_bytes: int  # routed-expert weights (EXPERT_RE)
    mtp: bool = False  # a NextN block llama.cpp does not load (MTP_ARCHS): no weights, KV or state
    # K, V row widths of its own KV when llama.cpp's accounting gave them (planning.facts; MLA: no V); None: heads
    k_width: int | None = None
    v_width: int | None = None
    ffn_bytes: int = 0  # of dense_bytes, the dense FFN's or shared experts' weights and biases (FFN_RE)

    @property
    def kind(self) -> str:
        """attention, sliding, recurrent, attention+recurrent, ffn (no memory: Nemotron-H's MLP layers), or
        mtp (a NextN block left unloaded)."""
        if self.mtp:
            return "mtp"
        attn = "sliding" if self.sliding else "attention" if self.attention else ""
        return "+".join(k for k in (attn, "recurrent" if self.recurrent else "") if k) or "ffn"

    weight_bytes = property(lambda self: self.dense_bytes + self.expert_bytes)


@dataclass
class ModelInfo:
    """A model's geometry and weight sizes; every size is in bytes."""

    path: str
    arch: str
    name: str | None
    file_type: str | None
    n_params: int
    file_size: int
    tensor_types: dict[str, int]  # ggml type name -> tensor count
    n_layer: int
    n_ctx_train: int | None
    n_embd: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_swa: int  # sliding window in tokens, 0 when the model has none
    layers: list[LayerFacts]  # per layer: kind, heads, state and weight bytes
    token_embd_bytes: int
    output_bytes: int  # output.weight and output_norm; 0 for the tied part when tied
    output_tied: bool  # no output.weight: the output reuses token_embd (a copy on the output device)
    output_type: str | None  # ggml type of the output projection's weight (or token_embd's when tied)
    other_bytes: int  # tensors outside layers, embeddings and output (rope factors, ...)
    kv_bytes_per_token: dict[str, int] = field(default_factory=dict)  # f16 / q8_0 / q4_0, attention layers
    n_pos_per_token: int = 1  # positions per token in the graph's inp_pos (4 with multi-section rope)
    # Mamba-2 layers: rows of ssm_in's output (z, xBC, dt) and of z (d_inner); 0 without them
    ssm_in_rows: int = 0
    ssm_d_inner: int = 0
    # mixture of experts: {arch}.expert_count / expert_used_count (llama_model_loader LLM_KV_EXPERT_*); 0 when dense
    n_expert: int = 0
    n_expert_used: int = 0

    @property
    def expert_layers(self) -> list[int]:
        """The layers holding routed-expert tensors."""
        return [il for il, la in enumerate(self.layers) if la.expert_bytes]

    @property
    def expert_read_fraction(self) -> float:
        """The share of a layer's expert bytes one token reads: expert_used_count / expert_count."""
        return self.n_expert_used / self.n_expert if self.n_expert else 1.0

    # per-layer columns of `layers`
    n_head = property(lambda self: [la.n_head for la in self.layers])
    n_head_kv = property(lambda self: [la.n_head_kv for la in self.layers])
    swa_layers = property(lambda self: [la.sliding for la in self.layers])
    recurrent_layers = property(lambda self: [la.recurrent for la in self.layers])

    @property
    def layer_bytes(self) -> list[int]:
        """Weights of blk.<il>.*, experts included."""
        return [la.weight_bytes for la in self.layers]

    @property
    def state_bytes_per_seq(self) -> int:
        """The recurrent state of all layers for one sequence."""
        return sum(la.state_bytes for la in self.layers)

    def n_embd_k_gqa(self, il: int) -> int:
        la = self.layers[il]
        return self.head_dim_k * la.n_head_kv if la.k_width is None else la.k_width

    def n_embd_v_gqa(self, il: int) -> int:
        la = self.layers[il]
        return self.head_dim_v * la.n_head_kv if la.v_width is None else la.v_width

    def to_dict(self) -> dict:
        d = asdict(self)
        for la, facts in zip(d["layers"], self.layers):
            la["kind"] = facts.kind
        d.update(n_head=self.n_head, n_head_kv=self.n_head_kv, swa_layers=self.swa_layers,
                 layer_bytes=self.layer_bytes, state_bytes_per_seq=self.state_bytes_per_seq)
        return d


def _per_layer(value, n_layer: int, what: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise GGUFError(f"{what} has {len(value)} entries for {n_layer} layers")
        return [int(v) for v in value]
    if not isinstance(value, int):
        raise GGUFError(f"{what} is missing or not an integer")
    return [value] * n_layer


def model_info(source: str | os.PathLike | GGUFFile) -> ModelInfo:
    """Read a GGUF's header and tensor index (never its weights) into a `ModelInfo`."""
    g = source if isinstance(source, GGUFFile) else read_gguf(source, skip_arrays=True)
    arch = g.arch
    n_layer = g.arch_get("block_count")
    n_embd = g.arch_get("embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int) or n_layer <= 0 or n_embd <= 0:
        raise GGUFError(f"{g.path}: missing {arch}.block_count or {arch}.embedding_length")
    n_head = _per_layer(g.arch_get("attention.head_count"), n_layer, f"{arch}.attention.head_count")
    n_head_kv = _per_layer(g.arch_get("attention.head_count_kv", n_head), n_layer,
                           f"{arch}.attention.head_count_kv")
    h0 = max(n_head) or 1
    head_dim_k = int(g.arch_get("attention.key_length", n_embd // h0))
    head_dim_v = int(g.arch_get("attention.value_length", n_embd // h0))

    n_mtp = g.arch_get("nextn_predict_layers", 0) if arch in MTP_ARCHS else 0
    n_mtp = n_mtp if isinstance(n_mtp, int) and 0 < n_mtp < n_layer else 0
    mtp = [il >= n_layer - n_mtp for il in range(n_layer)]
    recurrent = [r and not m for r, m in zip(_recurrent_layers(g, arch, n_layer, n_head_kv), mtp)]
    attention = [not r and not m and kv > 0 for r, m, kv in zip(recurrent, mtp, n_head_kv)]
    n_swa, swa_layers = _sliding_layers(g, arch, n_layer, attention)
    state = sum(state_widths(g, n_embd)) * STATE_TYPE_BYTES  # one recurrent layer's state per sequence

    dense, expert, ffn = [0] * n_layer, [0] * n_layer, [0] * n_layer
    expert_names: list[set[str]] = [set() for _ in range(n_layer)]
    routers = [False] * n_layer
    token_embd = output = other = 0
    output_type = None
    types: Counter[str] = Counter()
    n_params = 0
    for t in g.tensors:
        types[t.type_name] += 1
        n_params += t.n_elements
        il = block_of(t.name)
        if t.name in LAYER_TENSORS:
            dense[LAYER_TENSORS[t.name]] += t.nbytes
        elif il is not None and il < n_layer:
            if mtp[il]:
                continue  # TENSOR_SKIP: not loaded
            (expert if is_expert(t.name) else dense)[il] += t.nbytes
            ffn[il] += t.nbytes if FFN_RE.match(t.name) else 0
            if is_expert(t.name):
                expert_names[il].add(t.name.split(".")[2])
            routers[il] |= t.name.split(".")[2] == "ffn_gate_inp"
        elif t.name == "token_embd.weight":
            token_embd += t.nbytes
        elif t.name.startswith("output") or t.name == OUTPUT_NORM.get(arch) or t.name in OUTPUT_TENSORS:
            output += t.nbytes
            if t.name == "output.weight":
                output_type = t.type_name
        else:
            other += t.nbytes
    layers = [LayerFacts(attention=attention[il], sliding=swa_layers[il], recurrent=recurrent[il],
                         n_head=n_head[il], n_head_kv=n_head_kv[il] if attention[il] else 0,
                         state_bytes=state if recurrent[il] else 0, dense_bytes=dense[il], expert_bytes=expert[il],
                         mtp=mtp[il], ffn_bytes=ffn[il])
              for il in range(n_layer)]
    tied = g.tensor("output.weight") is None
    if tied and g.tensor("token_embd.weight") is not None:
        output_type = g.tensor("token_embd.weight").type_name

    n_vocab = g.get("tokenizer.ggml.tokens")
    if n_vocab is None:
        embd = g.tensor("token_embd.weight")
        n_vocab = embd.shape[1] if embd else 0
    ftype = g.get("general.file_type")
    file_type = None
    if isinstance(ftype, int):
        file_type = FILE_TYPES[ftype].removeprefix("MOSTLY_") if ftype in FILE_TYPES else f"FTYPE_{ftype}"

    info = ModelInfo(
        path=str(g.path), arch=arch, name=g.get("general.name"), file_type=file_type,
        n_params=n_params, file_size=g.file_size, tensor_types=dict(sorted(types.items())),
        n_layer=n_layer, n_ctx_train=g.arch_get("context_length"), n_embd=n_embd,
        head_dim_k=head_dim_k, head_dim_v=head_dim_v,
        n_vocab=int(n_vocab), n_swa=n_swa, layers=layers,
        token_embd_bytes=token_embd, output_bytes=output, output_tied=tied, output_type=output_type,
        other_bytes=other, n_pos_per_token=4 if arch in MROPE_ARCHS else 1,
    )
    n_expert = g.arch_get("expert_count", 0)
    info.n_expert = int(n_expert) if isinstance(n_expert, int) else 0
    used = g.arch_get("expert_used_count", 0)
    info.n_expert_used = int(used) if isinstance(used, int) else 0
    _check_experts(str(g.path), info.n_expert, expert_names, routers)
    if arch in MAMBA2_ARCHS:  # d_in_proj = 2 d_inner + 2 n_group d_state + n_head (load_arch_tensors)
        d_inner, d_state, n_group, heads = (int(g.arch_get(f"ssm.{k}", 0) or 0) for k in
                                            ("inner_size", "state_size", "group_count", "time_step_rank"))
        info.ssm_in_rows = 2 * d_inner + 2 * n_group * d_state + heads
        info.ssm_d_inner = d_inner
    info.kv_bytes_per_token = kv_per_token(info)
    return info


def kv_per_token(info: ModelInfo) -> dict[str, int]:
    """KV bytes per token of the attention layers for each KV type whose blocks divide their rows."""
    out: dict[str, int] = {}
    for kv in KV_TYPES:
        try:
            out[kv] = sum(kv_bytes(kv, info.n_embd_k_gqa(il)) + kv_bytes(kv, info.n_embd_v_gqa(il))
                          for il in range(info.n_layer) if info.layers[il].attention)
        except GGUFError:
            pass  # rows not a multiple of the type's block: llama.cpp cannot use that KV type
    return out


def _check_experts(path: str, n_expert: int, names: list[set[str]], routers: list[bool]) -> None:
    """A mixture-of-experts GGUF whose layer has a router (ffn_gate_inp) but lacks one of the stacked expert
    tensors the other layers have, or that llama.cpp's load_tensors requires of every architecture
    (ffn_down_exps, and ffn_up_exps or the fused ffn_gate_up_exps):
    llama.cpp would refuse it at load ("missing tensor"), so say which one before planning."""
    if not n_expert:
        return
    every = set().union(*names)  # the expert tensors the other layers have: the same in each MoE layer
    for il, (have, router) in enumerate(zip(names, routers)):
        if not router and not have:
            continue  # a dense layer (leading_dense_block_count, mlp_only_layers)
        missing = sorted(every - have) + [n for n in ("ffn_down_exps",) if n not in have and n not in every]
        if "ffn_gate_up_exps" not in have and "ffn_up_exps" not in have:
            missing.append("ffn_up_exps")
        if missing:
            raise GGUFError(f"{path}: blk.{il}.{missing[0]}.weight is missing: a mixture-of-experts layer "
                            f"({n_expert} experts) needs it; the file is incomplete or not a model llama.cpp loads")


def _recurrent_layers(g: GGUFFile, arch: str, n_layer: int, n_head_kv: list[int]) -> list[bool]:
    """Which layers hold a recurrent state, by the architecture's rule (RECURRENT_RULES)."""
    rule = RECURRENT_RULES.get(arch)
    if rule == "interval":
        arr = g.arch_get("attention.recurrent_layers")
        if isinstance(arr, list) and len(arr) == n_layer:
            return [bool(x) for x in arr]
        interval = g.arch_get("full_attention_interval", FULL_ATTENTION_INTERVAL)
        if not isinstance(interval, int) or interval <= 0:
            raise GGUFError(f"{arch}.full_attention_interval must be a positive integer, not {interval!r}")
        return [(il + 1) % interval != 0 for il in range(n_layer)]
    if rule == "kv0":
        return [kv == 0 for kv in n_head_kv]
    if rule == "kv0_ff0":
        n_ff = _per_layer(g.arch_get("feed_forward_length", 0), n_layer, f"{arch}.feed_forward_length")
        return [kv == 0 and ff == 0 for kv, ff in zip(n_head_kv, n_ff)]
    return [False] * n_layer


def _sliding_layers(g: GGUFFile, arch: str, n_layer: int, attention: list[bool]) -> tuple[int, list[bool]]:
    """(window in tokens, per-layer flags), by SWA_RULES and llama_model_base::load_swa_pattern."""
    if arch not in SWA_RULES:
        return 0, [False] * n_layer
    default, pattern = SWA_RULES[arch]
    window = g.arch_get("attention.sliding_window")
    n_swa = int(window) if isinstance(window, int) else (default or 0)
    if n_swa <= 0:
        return 0, [False] * n_layer
    pattern_arr = g.arch_get("attention.sliding_window_pattern")
    if isinstance(pattern_arr, list) and len(pattern_arr) == n_layer:
        flags = [bool(x) for x in pattern_arr]
    else:
        if isinstance(pattern_arr, int) and not isinstance(pattern_arr, bool):
            pattern = int(pattern_arr)
        flags = [pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer)]
    return n_swa, [f and a for f, a in zip(flags, attention)]


def state_widths(g: GGUFFile, n_embd: int) -> tuple[int, int]:
    """(n_embd_r, n_embd_s), llama_hparams': the convolution's last d_conv - 1 inputs, the SSM / delta-net state."""
    def key(name: str) -> int:
        v = g.arch_get(name, 0)
        return int(v) if isinstance(v, int) else 0

    l_cache = key("shortconv.l_cache")
    d_conv, d_inner, d_state, n_group = (key("ssm.conv_kernel"), key("ssm.inner_size"), key("ssm.state_size"),
                                         key("ssm.group_count"))
    # LFM2's short convolution; else Mamba-2's and gated delta nets' convolutions over x, B and C
    n_embd_r = n_embd * (l_cache - 1) if l_cache else max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    return n_embd_r, d_state * d_inner
