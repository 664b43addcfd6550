"""What the speed model (planning/speed/model.py) is asked about: a placement of a model's layers on the devices, a
workload, and the estimate it answers with; `placement_from_plan` reads a `Plan` as a placement."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..devices import Device
from ..options import DEFAULT_N_BATCH, DEFAULT_N_UBATCH

DEFAULT_GEN_TOKENS = 128  # llama-bench's tg128: the generation figure the published rows use


@dataclass(frozen=True)
class Share:
    """What one device computes: `fraction` of each of `layers` (layer mode: 1; tensor mode: its proportion),
    the routed experts of `expert_layers` and the dense FFN of `ffn_layers` (None: those of `layers`) and the
    output head if `output`."""

    device: Device
    layers: tuple[int, ...] = ()
    fraction: float = 1.0
    expert_layers: tuple[int, ...] | None = None
    output: bool = False
    ffn_layers: tuple[int, ...] | None = None

    experts = property(lambda self: self.layers if self.expert_layers is None else self.expert_layers)
    ffns = property(lambda self: self.layers if self.ffn_layers is None else self.ffn_layers)

    @property
    def busy(self) -> bool:
        return bool(self.layers or self.experts or self.ffns or self.output)


@dataclass(frozen=True)
class Placement:
    mode: str  # "layer" or "tensor"
    cards: tuple[Share, ...]  # GPUs and RPC workers in llama.cpp's order (layer mode: the order a token passes)
    host: Share | None = None  # layers, experts or the head left in CPU memory
    # whole host layers' weights in the first GPU's pinned host buffer (`--no-mmap`: llama_model_loader puts them in
    # ggml_backend_dev_host_buffer_type unless mmap'd); `-ot ...=CPU` names the CPU's own, pageable buffer type
    host_pinned: bool = False


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    gen_tokens: int = DEFAULT_GEN_TOKENS
    depth: int | None = None  # tokens in the cache while decoding; None: prompt_depth + prompt_tokens
    prompt_depth: int = 0  # tokens already cached before the prompt (llama-bench -d for a pp test)
    n_ubatch: int = DEFAULT_N_UBATCH
    n_batch: int = DEFAULT_N_BATCH

    @property
    def decode_depth(self) -> int:
        return self.prompt_depth + self.prompt_tokens if self.depth is None else self.depth


@dataclass
class SpeedEstimate:
    """An estimate, not a measurement. A figure is None where a device fact is missing (`missing` says which)."""

    mode: str
    prefill_s: float | None
    decode_tps: float | None
    total_s: float | None  # prefill_s + gen_tokens / decode_tps
    basis: str
    workload: Workload
    prefill_links_s: float | None = None  # of prefill_s: copies and all-reduces between the cards
    decode_links_s: float | None = None  # of one decoded token's time: the same
    pipeline: bool = False  # layer mode with llama.cpp's pipeline parallelism
    missing: list[str] = field(default_factory=list)

    @property
    def prefill_tps(self) -> float | None:
        return self.workload.prompt_tokens / self.prefill_s if self.prefill_s else None

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tps": self.prefill_tps, "estimate": True}


def placement_from_plan(plan) -> Placement:
    """The placement a `Plan` makes: in layer mode each device's layers; in tensor mode (`plan.split_mode`)
    each card's `tensor_split` proportion of every layer the host does not keep."""
    n, cpu_exp, cpu_ffn = plan.n_layer, set(plan.cpu_expert_layers), set(getattr(plan, "cpu_ffn_layers", ()))
    host_layers = tuple(il for il in plan.host.layers if il < n)
    host = Share(plan.host.device, host_layers, expert_layers=tuple(sorted(set(host_layers) | cpu_exp)),
                 output=n in plan.host.layers, ffn_layers=tuple(sorted(set(host_layers) | cpu_ffn)))
    pinned = not getattr(plan, "use_mmap", True)  # --no-mmap: llama_model_loader keeps the GPU's host buffer type
    if getattr(plan, "split_mode", "layer") == "tensor":
        on_cards = tuple(il for il in range(n) if il not in host_layers)
        total = sum(plan.tensor_split)
        cards = tuple(Share(dp.device, on_cards, plan.tensor_split[i] / total if total else 1 / len(plan.gpus),
                            tuple(il for il in on_cards if il not in cpu_exp), output=not host.output)
                      for i, dp in enumerate(plan.gpus))
        return Placement("tensor", cards, host, host_pinned=pinned)
    cards = tuple(Share(dp.device, tuple(il for il in dp.layers if il < n),
                        expert_layers=tuple(il for il in dp.layers if il < n and il not in cpu_exp),
                        output=n in dp.layers, ffn_layers=tuple(il for il in dp.layers if il < n and il not in cpu_ffn))
                  for dp in plan.gpus)
    return Placement("layer", cards, host, host_pinned=pinned)
