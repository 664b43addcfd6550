"""The settings that make a plan, in one object: `PlanOptions`.

Every field defaults to None, "not given", so a caller's choice stays visible until `resolved()`
fills the rest from the defaults below, once (a flag or keyword > a profile > these defaults; the
profile supplies devices and host memory, see `devices.resolve_devices`). `ctxq plan`, `ctxq run`,
`ctxq serve`, `ctxq.plan()` and `ctxq.load()` all build one of these; the field names are the
keywords and the command-line flags' destinations.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..errors import InvalidOption
from ..gguf.info import KV_TYPES
from .kvpairs import parse_kv
from .user_tensors import parse_overrides

DEFAULT_N_CTX = 4096  # llama.cpp's own default context (common_params.n_ctx)
DEFAULT_N_BATCH = 2048  # common_params.n_batch
DEFAULT_N_UBATCH = 512  # common_params.n_ubatch
MAX_N_CTX = 2**32 - 1  # llama_context_params.n_ctx is a uint32_t
MAX_PARALLEL = 256  # LLAMA_MAX_SEQ (src/llama-cparams.h): llama_context refuses a larger n_seq_max
DEFAULT_PREFER = "quality"
DEFAULT_KV = "auto"
PREFER = ("quality", "speed")
OFFLOADS = ("auto", "weights", "layers")  # PlanOptions.offload
SPLIT_MODES = ("layer", "tensor", "auto")  # llama.cpp's -sm layer / -sm tensor; auto: both planned, compared
DEFAULT_SPLIT_MODE = "layer"


@dataclass(frozen=True)
class PlanOptions:
    """What to plan for. None everywhere means "not given"; see `resolved()` for the defaults.

    n_ctx: tokens of context (never shrunk to fit). kv: "auto" searches the K/V pairs the devices run at speed,
    least measured loss first (planning/kvpairs.py); a type ("q8_0") fixes K and V, a pair ("q8_0/q4_0") each
    (type_k / type_v override one of them). max_kl: keep the cache within this mean KL against f16, as `ctxq
    quality` measured it for this model (layers move to the CPU to hold it). flash_attn: None is on (a quantized V
    cache needs it). split: None or "auto" searches; "16:16:16:8:8" (ratios, as llama.cpp's
    tensor_split) or "19,19,19,10,14" (layer counts) evaluates that split. prefer: "quality" keeps KV
    at q8_0 or better when layers can go to the CPU instead; "speed" the reverse. reorder: let the
    plan change the GPUs' order. Devices: gpus ("16,16,16,8,8", "3x16,2x8" or GiB sizes), profile
    (a name in profiles/ or a .toml), rpc (ggml RPC workers, "HOST:PORT[=GiB],..."), simulate (RPC
    devices of these GiB sizes, no GPU margin); none given: the devices llama.cpp sees.
    cpu_memory: bytes of host RAM to plan with (default: the profile's, else available now).
    reserve: bytes kept free on every GPU outside llama.cpp's buffers (default: the backend's, 768 MiB
    for CUDA, see planning/memory/cuda.py; a profile may set it per card).
    cpu_moe / n_cpu_moe: keep the expert tensors of a mixture-of-experts model in CPU memory, of every
    layer or of the layers below N, as llama.cpp's --cpu-moe / --n-cpu-moe (router and shared experts
    stay with their layer). Neither given: the plan keeps the experts of as few layers as needed in CPU
    memory before it moves any whole layer there; expert_offload=False turns that off (whole layers only).
    parallel: sequences decoded together in one context (llama.cpp's -np with a unified KV cache, -kvu):
    n_ctx cells shared by all, one output row and one recurrent state per sequence. None: one sequence
    and llama.cpp's defaults (what `Llama` makes).
    split_mode: "layer" (llama.cpp's -sm layer: whole layers per card, the default), "tensor" (-sm tensor: every
    layer cut across the cards, proportions searched; planning/tensor/mode.py) or "auto" (both planned, their speeds
    estimated; the faster by `ctxq bench`'s kept measurements on these devices, else layer mode).
    prompt_tokens / gen_tokens: the workload `split_mode="auto"` times each mode for, prefill then generation
    (default: the whole context, then 128 tokens).
    tensor_cards: tensor mode over exactly these cards (indices into the devices; the others are not given to
    llama.cpp), as `ctxq bench` measures each candidate (planning/tensor/candidates.py); None: searched.
    offload: what goes to host memory when the cards cannot hold every layer at the context: "weights" (dense FFN
    weights of chosen layers, `-ot ...=CPU`; attention, norms and the whole KV cache stay on the cards), "layers"
    (whole layers with their KV cache, llama.cpp's -ngl), or "auto" (the default: the placement with the least
    estimated time for the workload; weights where the devices say too little to estimate). planning/spill/placement.py.
    override_tensor: llama.cpp's -ot / --override-tensor, "PATTERN=BUFFER" entries (a string may hold several,
    comma-separated): the tensors whose names match go to that buffer, CPU or a device as llama.cpp or the plan
    names it (CUDA0, RPC0[host:port], GPU1), the first matching entry winning; ctxq plans its own moves around them
    (planning/user_tensors.py). Layer mode only.
    """

    n_ctx: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    kv: str | None = None
    max_kl: float | None = None
    type_k: str | None = None
    type_v: str | None = None
    flash_attn: bool | None = None
    split: str | list | tuple | None = None
    prefer: str | None = None
    reorder: bool | None = None
    gpus: str | list | tuple | None = None
    profile: str | None = None
    rpc: object = None  # a spec string, or endpoints (`ctxq.rpc.RpcEndpoint`)
    simulate: str | list | tuple | None = None
    cpu_memory: int | None = None
    reserve: int | None = None
    cpu_moe: bool | None = None
    n_cpu_moe: int | None = None
    expert_offload: bool | None = None
    parallel: int | None = None
    split_mode: str | None = None
    prompt_tokens: int | None = None
    gen_tokens: int | None = None
    tensor_cards: tuple | list | None = None
    offload: str | None = None
    no_mmap: bool | None = None  # llama.cpp's --no-mmap: whole host layers' weights in the first GPU's pinned buffer
    override_tensor: str | tuple | list | None = None  # llama.cpp's -ot: "PATTERN=BUFFER[,...]" or several of them

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def take(cls, kwargs: dict, base: PlanOptions | None = None) -> PlanOptions:
        """`base` (or none) updated with the keywords in `kwargs` that name a field, which are removed
        from `kwargs`; a keyword given as None keeps the base's value."""
        given = {k: kwargs.pop(k) for k in cls.names() if k in kwargs}
        return (base or cls()).updated(**given)

    def updated(self, **given) -> PlanOptions:
        """A copy with the given (not None) values replacing these."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def resolved(self) -> PlanOptions:
        """Defaults filled in and every value checked; raises InvalidOption naming the keyword."""
        kv = self.kv or DEFAULT_KV
        prefer = self.prefer or DEFAULT_PREFER
        n_batch = self.n_batch or DEFAULT_N_BATCH
        # llama_context clamps n_ubatch to n_batch (cparams.n_ubatch = min(n_batch, n_ubatch)): never over a -b given
        r = replace(self, n_ctx=self.n_ctx or DEFAULT_N_CTX, n_batch=n_batch,
                    n_ubatch=self.n_ubatch or min(DEFAULT_N_UBATCH, n_batch), kv=kv, prefer=prefer,
                    flash_attn=True if self.flash_attn is None else self.flash_attn,
                    split=None if self.split in (None, "auto") else self.split,
                    reorder=True if self.reorder is None else self.reorder,
                    split_mode=str(self.split_mode or DEFAULT_SPLIT_MODE).lower(),
                    offload=str(self.offload or "auto").lower())
        if self.override_tensor is not None:
            r = replace(r, override_tensor=parse_overrides(self.override_tensor) or None)
            if self.reorder is None and any(not e.endswith("=CPU") for e in r.override_tensor or ()):
                r = replace(r, reorder=False)  # a device named in an entry keeps its place (CUDA0 stays CUDA0)
            if r.override_tensor and r.split_mode != "layer":  # tensor mode cuts every layer across the cards
                raise InvalidOption(f"override_tensor plans in layer mode only, not split_mode={r.split_mode}: use "
                                    "-sm layer", option="override_tensor", value=self.override_tensor)
        if r.offload not in OFFLOADS:
            raise InvalidOption(f"`offload` {self.offload!r}: choose weights, layers or auto", option="offload",
                                value=self.offload)
        if self.tensor_cards is not None:
            if r.split_mode != "tensor":
                raise InvalidOption("`tensor_cards` names the cards of tensor mode: give it with split_mode=tensor",
                                    option="tensor_cards", value=self.tensor_cards)
            r = replace(r, tensor_cards=tuple(int(i) for i in self.tensor_cards))
        if r.split_mode not in SPLIT_MODES:
            raise InvalidOption(f"`split_mode` {self.split_mode!r}: choose layer, tensor or auto", option="split_mode",
                                value=self.split_mode)
        for name in ("n_ctx", "n_batch", "n_ubatch"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidOption(f"{name} must be positive, got {value}", option=name, value=value)
        if self.n_ctx is not None and self.n_ctx > MAX_N_CTX:
            raise InvalidOption(f"n_ctx {self.n_ctx} is beyond llama.cpp's largest context, {MAX_N_CTX} tokens "
                                "(a 32-bit count)", option="n_ctx", value=self.n_ctx, limit=MAX_N_CTX)
        for name in ("prompt_tokens", "gen_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidOption(f"{name} must be 0 or more tokens, got {value}", option=name, value=value)
        if self.prompt_tokens is not None and self.prompt_tokens > r.n_ctx:
            raise InvalidOption(f"prompt_tokens {self.prompt_tokens:,} is beyond the context ({r.n_ctx:,} tokens): "
                                "the prompt has to fit in it", option="prompt_tokens", value=self.prompt_tokens,
                                limit=r.n_ctx)
        if self.parallel is not None and not 1 <= self.parallel <= MAX_PARALLEL:
            raise InvalidOption(f"parallel must be 1 to {MAX_PARALLEL} sequences, got {self.parallel}",
                                option="parallel", value=self.parallel, limit=MAX_PARALLEL)
        if self.reserve is not None and self.reserve < 0:
            raise InvalidOption(f"reserve must be 0 or more bytes, got {self.reserve}", option="reserve",
                                value=self.reserve)
        if self.n_cpu_moe is not None and self.n_cpu_moe < 0:  # common/arg.cpp refuses it too
            raise InvalidOption(f"n_cpu_moe must be 0 or more layers, got {self.n_cpu_moe}", option="n_cpu_moe",
                                value=self.n_cpu_moe)
        if prefer not in PREFER:
            raise InvalidOption(f"`prefer` must be quality or speed, not {prefer!r}", option="prefer", value=prefer)
        parse_kv(kv)  # InvalidOption for anything but auto, a type or a K/V pair
        for name in ("type_k", "type_v"):
            t = getattr(self, name)
            if t is not None and t not in KV_TYPES:
                raise InvalidOption(f"`{name}` must be one of {', '.join(KV_TYPES)}, not {t!r}", option=name, value=t)
        if self.max_kl is not None and not self.max_kl >= 0:
            raise InvalidOption(f"max_kl must be 0 or more (nats of mean KL), got {self.max_kl}", option="max_kl",
                                value=self.max_kl)
        for other in ("rpc", "gpus", "profile"):  # simulated devices stand for all of them
            if self.simulate is not None and getattr(self, other):
                raise InvalidOption(f"give `simulate` or `{other}`, not both", option="simulate", value=self.simulate)
        return r

    def cpu_expert_layers(self, expert_layers: list[int], n_layer: int) -> list[int]:
        """The layers (of `expert_layers`, those holding experts) whose experts these options put in
        CPU memory; InvalidOption for a model without experts or an n_cpu_moe beyond `n_layer`."""
        if not self.cpu_moe and not self.n_cpu_moe:
            return []
        name, value = ("cpu_moe", True) if self.cpu_moe else ("n_cpu_moe", self.n_cpu_moe)
        if not expert_layers:
            raise InvalidOption(f"{name}={value} keeps the experts of a mixture-of-experts model in CPU memory, "
                                "but this model has no expert tensors; drop it", option=name, value=value)
        if self.n_cpu_moe is not None and self.n_cpu_moe > n_layer:
            raise InvalidOption(f"n_cpu_moe={self.n_cpu_moe} is beyond this model's {n_layer} layers; use "
                                f"n_cpu_moe={n_layer} or cpu_moe=True for all of them", option="n_cpu_moe",
                                value=self.n_cpu_moe, limit=n_layer)
        if self.cpu_moe:
            return list(expert_layers)
        return [il for il in expert_layers if il < self.n_cpu_moe]

    def context_settings(self) -> dict:
        """llama_context_params' n_seq_max / kv_unified / n_outputs_max for these options: a parallel plan
        shares one pool of n_ctx cells (kv_unified; without it each sequence gets n_ctx / n_seq_max) and
        reserves one row of logits per sequence, all a decode step reads; no `parallel`: llama.cpp's defaults."""
        if self.parallel is None:
            return dict(n_seq_max=1, kv_unified=False, n_outputs_max=0)
        return dict(n_seq_max=self.parallel, kv_unified=True, n_outputs_max=self.parallel)

    def kv_fixed(self) -> tuple[str, str] | None:
        """The (type_k, type_v) pair these options fix, or None when the plan searches (kv="auto")."""
        pair = parse_kv(self.kv)
        if self.type_k or self.type_v or pair:
            tk, tv = pair or ("f16", "f16")
            return self.type_k or tk, self.type_v or tv
        if self.flash_attn is False:  # a quantized V cache needs flash attention
            return "f16", "f16"
        return None
