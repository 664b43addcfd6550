"""The plan: what each device holds (bytes) and the llama.cpp settings that load it as planned.

`Llama(model, **plan.llama_kwargs())` loads a plan; `plan.llama_flags()` is the same plan as
llama.cpp command-line flags. Made by `ctxq.planning.planner.plan()`. A mixture-of-experts plan that
keeps experts in CPU memory also needs `plan.expert_overrides()` passed to llama.cpp as tensor buffer
overrides, which `Llama` takes no keyword for: `ctxq.load()` and `ctxq run` do it
(`ctxq.llama.overrides.create_llama`).
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Iterable

from ..errors import InvalidOption
from ..llama.overrides import expert_layers, expert_pattern, experts_pattern, ffn_pattern
from .devices import Device
from .user_tensors import CPU, device_names, llama_buffer, split_entry
from .options import PlanOptions


@dataclass
class DevicePlan:
    """What one device holds; sizes in bytes."""

    device: Device
    layers: list[int]  # layer indices; n_layer stands for the output head
    weights: int = 0
    kv: int = 0
    state: int = 0  # recurrent state of its recurrent layers (llama.cpp's RS buffer)
    compute: int = 0  # the compute buffer as the CPU backend sizes it (llama.cpp's own dry run)
    cuda_copies: int = 0  # what CUDA's compute buffer adds (f16 K/V copies, op-offload copies; cuda.py)
    cuda_pool: int = 0  # CUDA's memory pool high-water, outside every buffer (cuda.py)
    margin: int = 0  # kept free: a GPU's reserve, an RPC worker's rounding, the host's process and OS
    experts: int = 0  # of `weights`, the routed-expert bytes held here (MoE; the host: all it keeps)
    cpu_experts: list[int] = field(default_factory=list)  # its layers whose experts are in CPU memory
    cpu_expert_bytes: int = 0  # their expert bytes (in the host's weights, not in this device's)
    # (the host: the layers on devices whose experts it holds)
    cpu_ffn: list[int] = field(default_factory=list)  # its layers whose dense FFN is in host memory (the host: all)
    cpu_ffn_bytes: int = 0  # their FFN bytes (in the host's weights, not in this device's)
    override_bytes: int = 0  # of `weights`, the bytes the user's -ot patterns put here (from any layer)

    @property
    def cuda_extra(self) -> int:
        """CUDA's own bytes beyond what the CPU backend shows: the table's CUDA column."""
        return self.cuda_copies + self.cuda_pool

    @property
    def buffers(self) -> int:
        """What llama.cpp's log should report for this device (model + KV + RS + compute buffers)."""
        return self.weights + self.kv + self.state + self.compute + self.cuda_copies

    @property
    def total(self) -> int:
        return self.buffers + self.cuda_pool + self.margin

    @property
    def free(self) -> int:
        return self.device.usable - self.total

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(cuda_extra=self.cuda_extra, buffers=self.buffers, total=self.total, free=self.free)
        return d


@dataclass
class Plan:
    """A runnable plan: `Llama(model, **plan.llama_kwargs())` loads it as planned."""

    model: str
    n_ctx: int
    n_batch: int
    n_ubatch: int
    type_k: str
    type_v: str
    flash_attn: bool
    n_gpu_layers: int
    # as llama.cpp receives it: layer counts per GPU device in layer mode, proportions in tensor mode
    tensor_split: list
    gpus: list[DevicePlan]  # in llama.cpp's order (after any reordering)
    host: DevicePlan
    n_layer: int
    swa_full: bool = False  # sliding-window layers keep only their window (llama.cpp defaults to full)
    use_mmap: bool = True  # False: --no-mmap (whole host layers in the GPU backend's pinned host buffer)
    device_order: list[int] | None = None  # indices into the given devices when reordered
    reason: str = ""
    est_decode_tps: float | None = None  # an estimate from memory bandwidth, not a measurement
    notes: list[str] = field(default_factory=list)
    # what the KV pair costs the answers (planning/kvpairs.quality_line): mean_kl etc. when `ctxq quality`
    # measured it on this model, else measured False; kvpairs.describe makes the line `ctxq plan` prints
    kv_quality: dict = field(default_factory=dict)
    expert_layers: list[int] = field(default_factory=list)  # layers holding expert tensors (MoE); [] when dense
    cpu_expert_layers: list[int] = field(default_factory=list)  # of those, the layers whose experts are in CPU memory
    # sequences in one context (PlanOptions.parallel): llama_context_params' own fields. n_outputs_max 0 is
    # llama.cpp's default (n_batch rows of logits); a parallel plan reserves one row per sequence.
    n_seq_max: int = 1
    kv_unified: bool = False
    n_outputs_max: int = 0
    # "layer" (-sm layer: whole layers per device) or "tensor" (-sm tensor: every offloaded layer cut across the
    # cards in tensor_split's proportions; planning/tensor/mode.py)
    split_mode: str = "layer"
    speed: dict = field(default_factory=dict)  # estimates by mode (planning/speed/), where the devices say enough
    # tensor mode over some of the cards (planning/tensor/subset.py): the cards left out, each {"device", "why"},
    # and the devices llama.cpp is given, as its -dev names them (device_order: their indices); None: every card
    left_out: list[dict] | None = None
    llama_devices: list[str] | None = None
    # layers whose dense FFN weights sit in host memory, their attention, norms and KV cache on their card (a plan
    # that spills weights, never the cache: planning/spill/); passed as tensor_buft_overrides (`tensor_overrides`)
    cpu_ffn_layers: list[int] = field(default_factory=list)
    # the user's -ot entries ("PATTERN=BUFFER", PlanOptions.override_tensor), handed to llama.cpp before ctxq's own
    # patterns so that they win (llama.cpp takes a tensor's first matching pattern)
    override_tensor: list[str] = field(default_factory=list)

    @property
    def devices(self) -> list[DevicePlan]:
        return [*self.gpus, self.host]

    @property
    def cpu_layers(self) -> int:
        return self.n_layer + 1 - self.n_gpu_layers

    @property
    def on_cards(self) -> bool:
        """Every layer and every dense weight on the devices: no whole layer, no FFN weights in host memory."""
        return self.cpu_layers == 0 and not self.cpu_ffn_layers

    def expert_overrides(self) -> list[str]:
        """llama.cpp regexes matching the expert tensors of `cpu_expert_layers`, one per layer (as
        `--n-cpu-moe` builds them): the `tensor_buft_overrides` that keep those tensors in CPU memory."""
        return [expert_pattern(il) for il in self.cpu_expert_layers]

    def tensor_overrides(self) -> list[str]:
        """Every `tensor_buft_overrides` entry of the plan, in llama.cpp's order of precedence: the user's
        "PATTERN=BUFFER" (`override_tensor`), then ctxq's own patterns, each to the CPU: the experts of
        `cpu_expert_layers` (`expert_overrides`), then one pattern for the dense FFN of `cpu_ffn_layers`
        (`ctxq.llama.overrides.TensorOverrides.build` reads both forms)."""
        return [*self.override_tensor, *self.expert_overrides()] + ([self.ffn_override()] if self.cpu_ffn_layers else [])

    def user_flags(self) -> str:
        """The user's -ot entries with llama.cpp's buffer names (`ggml_backend_buft_name`) for the plan's devices."""
        out = ""
        for entry in self.override_tensor:
            pattern, buffer = split_entry(entry)
            dev = next((g.device for g in self.gpus if buffer in device_names(g.device)), None)
            out += " -ot " + shlex.quote(f"{pattern}={llama_buffer(dev) if dev else buffer}")
        return out

    def ffn_override(self) -> str:
        """The one pattern for the FFN of `cpu_ffn_layers`: a MoE's shared experts' with its dense layers'."""
        return ffn_pattern(self.cpu_ffn_layers, shared=bool(self.expert_layers))

    @property
    def parallel(self) -> bool:
        return self.kv_unified or self.n_seq_max > 1

    def context_settings(self) -> dict:
        """The context fields `Llama` takes no keyword for (n_seq_max, kv_unified, n_outputs_max): set on
        the context params by the engine (`ctxq.runtime.context`) and the referee's dry run."""
        return dict(n_seq_max=self.n_seq_max, kv_unified=self.kv_unified, n_outputs_max=self.n_outputs_max)

    def llama_kwargs(self) -> dict:
        """Keyword arguments for `llama_cpp.Llama`; `expert_overrides()` are not among them (no keyword)."""
        import llama_cpp
        from gguf.constants import GGMLQuantizationType as T

        kw = dict(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                  n_gpu_layers=self.n_gpu_layers,
                  split_mode=llama_cpp.LLAMA_SPLIT_MODE_TENSOR if self.split_mode == "tensor"
                  else llama_cpp.LLAMA_SPLIT_MODE_LAYER,
                  type_k=int(T[self.type_k.upper()]), type_v=int(T[self.type_v.upper()]),
                  flash_attn=self.flash_attn, offload_kqv=True, swa_full=self.swa_full, use_mmap=self.use_mmap)
        if self.gpus:
            kw["tensor_split"] = [float(c) for c in self.tensor_split]
            kw["main_gpu"] = 0
        return kw

    def llama_flags(self) -> str:
        """The same plan as llama.cpp command-line flags."""
        flags = f"-c {self.n_ctx} -b {self.n_batch} -ub {self.n_ubatch} -ngl {self.n_gpu_layers}"
        if self.gpus:
            flags += f" -sm {self.split_mode} -ts " + ",".join(str(c) for c in self.tensor_split)
        if self.llama_devices:  # tensor mode over some of the cards: llama.cpp is given only those
            flags += " -dev " + ",".join(self.llama_devices)
        flags += f" -ctk {self.type_k} -ctv {self.type_v} -fa {'on' if self.flash_attn else 'off'}"
        if not self.use_mmap:
            flags += " --no-mmap"
        if self.swa_full:  # llama.cpp's tools default to the window; its C API to the full size
            flags += " --swa-full"
        if self.parallel:  # llama-server's -np; -kvu: one pool of n_ctx cells (common/arg.cpp)
            flags += f" -np {self.n_seq_max}" + (" -kvu" if self.kv_unified else "")
        flags += self.user_flags() + self._expert_flags()
        if self.cpu_ffn_layers:
            flags += " -ot " + shlex.quote(f"{self.ffn_override()}=CPU")
        return flags

    def _expert_flags(self) -> str:
        """The expert placement as a llama.cpp user types it: --cpu-moe (all), --n-cpu-moe N (the expert
        layers below N), else one -ot pattern naming the layers."""
        cpu = self.cpu_expert_layers
        if not cpu:
            return ""
        if cpu == self.expert_layers:
            return " --cpu-moe"
        n = cpu[-1] + 1
        if cpu == [il for il in self.expert_layers if il < n]:
            return f" --n-cpu-moe {n}"
        return " -ot " + shlex.quote(f"{experts_pattern(cpu)}=CPU")

    def placement(self) -> list[dict]:
        """Per layer (and the output head, layer n_layer): the device holding it and where its experts are."""
        out = []
        cpu, ffn = set(self.cpu_expert_layers), set(self.cpu_ffn_layers)
        has = set(self.expert_layers)
        if self.split_mode == "tensor" and self.gpus:  # every card holds its cut of each offloaded layer
            cards = "+".join(g.device.name for g in self.gpus)
            return [{"layer": il, "device": cards if il in self.gpus[0].layers else self.host.device.name}
                    for il in range(self.n_layer + 1)]
        for dp in self.devices:
            for il in dp.layers:
                row = {"layer": il, "device": dp.device.name}
                if il in has:
                    row["experts"] = self.host.device.name if il in cpu else dp.device.name
                if il in ffn:
                    row["ffn"] = self.host.device.name
                out.append(row)
        return sorted(out, key=lambda r: r["layer"])

    def whole_quality(self) -> dict:
        """What weights and cache cost together, as far as `ctxq quality` measured them (`quality_store.whole_cost`)."""
        from .quality_store import whole_cost

        return whole_cost(self.model, self.n_ctx, self.kv_quality)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("gpus", "host")}
        d["quality"] = self.whole_quality()
        d["gpus"] = [g.to_dict() for g in self.gpus]
        d["host"] = self.host.to_dict()
        d["placement"] = self.placement()
        d["llama_flags"] = self.llama_flags()
        d["cpu_layers"] = self.cpu_layers
        d["expert_overrides"] = self.expert_overrides()
        d["tensor_overrides"] = self.tensor_overrides()
        return d


@dataclass(frozen=True)
class ExpertPlacement:
    """Which layers hold experts and, when the user chose (`cpu_moe`, `n_cpu_moe`), which of them keep the
    experts in CPU memory; the planner costs that choice as given, else it chooses (`fixed` False). It also carries
    the user's own tensor placement (`override_tensor`, costed in memory.costs) onto the plan (`apply`)."""

    expert_layers: list[int]
    cpu_layers: list[int]
    fixed: bool = True  # False: the planner chooses (neither cpu_moe nor n_cpu_moe given)
    override_tensor: tuple[str, ...] = ()  # the user's "PATTERN=BUFFER" entries (PlanOptions.override_tensor)

    @classmethod
    def chosen(cls, tensor_names: Iterable[str], n_layer: int, opts: PlanOptions) -> ExpertPlacement:
        """The placement `opts` asks for on a model with these tensors; InvalidOption when it cannot be."""
        layers = expert_layers(tensor_names)
        return cls(layers, opts.cpu_expert_layers(layers, n_layer), bool(opts.cpu_moe or opts.n_cpu_moe),
                   tuple(opts.override_tensor or ()))

    def apply(self, p: Plan) -> Plan:
        """`p` with the experts' placement and the user's overrides; InvalidOption for a buffer no device of the plan
        answers to (the costs gave it nothing: memory.user_tensors.device_names)."""
        if self.override_tensor:
            names = {CPU} | {n for g in p.gpus for n in device_names(g.device)}
            for entry in self.override_tensor:
                buffer = split_entry(entry)[1]
                if buffer not in names:
                    have = ", ".join([CPU] + [llama_buffer(g.device) for g in p.gpus])
                    raise InvalidOption(f"override_tensor '{entry}': no buffer {buffer!r} among this plan's devices; "
                                        f"use one of {have}", option="override_tensor", value=entry)
                idle = next((g for g in p.gpus if buffer in device_names(g.device) and not g.layers), None)
                if idle is not None:  # llama.cpp would still allocate them there; the costs of an idle card are none
                    raise InvalidOption(f"override_tensor '{entry}': the plan puts no layers on {idle.device.name}, "
                                        "so its memory is not planned; send the tensors to CPU or a device in use",
                                        option="override_tensor", value=entry)
            p.override_tensor = list(self.override_tensor)
            p.notes.append(f"{len(self.override_tensor)} tensor override(s) as asked (-ot), ahead of ctxq's own; "
                           "no pipeline parallelism with tensor overrides")
        p.expert_layers = list(self.expert_layers)
        if self.fixed:
            p.cpu_expert_layers = list(self.cpu_layers)
        if p.cpu_expert_layers:
            p.notes.append(f"the experts of {len(p.cpu_expert_layers)} of {len(self.expert_layers)} layers are kept in "
                           "CPU memory" + (" as asked" if self.fixed else "")
                           + " (attention, KV and the rest of each layer stay on its device)")
        return p
