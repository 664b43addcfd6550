"""The user's tensor placement (`-ot REGEX=BUFFER`, llama.cpp's --override-tensor) as costs, in bytes.

llama.cpp gives each tensor the buffer type of the first pattern that `std::regex_search`es its name
(llama_model_loader::create_tensor, "check overrides"), before its layer's own device is considered. ctxq puts the
user's patterns ahead of its own (`Plan.tensor_overrides`), so a tensor the user places is the user's: it leaves
its slot's default place (a layer's device, the output head's device, the host for the token embeddings) for the
named buffer, and ctxq's own moves (routed experts, dense FFN) move only what is left.

Buffers are named as llama.cpp names buffer types (`ggml_backend_buft_name`: CPU, CUDA0, RPC0[host:port]) or as
the plan names its devices (GPU0, RPC1[host:port]); `device_names` says which a device answers to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from ..errors import InvalidOption
from ..gguf.info import FFN_RE, ModelInfo

CPU = "CPU"
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_EXPERT = re.compile(r"^blk\.\d+\.ffn_\w+_(ch|)exps\b")  # llama.cpp's --n-cpu-moe pattern (overrides.FFN_EXPS_REGEX)
_INPUT = ("token_embd.weight", "token_embd_norm.weight", "token_embd_norm.bias")


def parse_overrides(value) -> tuple[str, ...]:
    """`-ot` values as llama.cpp's parse_tensor_buffer_overrides (common/arg.cpp) reads them: each a comma-separated
    list of PATTERN=BUFFER, split at the first '='; a value may be one string or several. Returns one
    "PATTERN=BUFFER" per entry, in order; InvalidOption for a missing '=', an empty pattern or buffer, or a pattern
    that is not a regex."""
    values = [value] if isinstance(value, str) else list(value or ())
    out = []
    for entry in (e for v in values for e in str(v).split(",")):
        pattern, eq, buffer = entry.partition("=")
        if not eq or not pattern or not buffer:
            raise InvalidOption(f"override_tensor '{entry}': write PATTERN=BUFFER, e.g. 'blk\\.1\\.ffn_.*=CPU'",
                                option="override_tensor", value=entry)
        try:
            re.compile(pattern)
        except re.error as e:
            raise InvalidOption(f"override_tensor '{entry}': '{pattern}' is not a regex ({e})",
                                option="override_tensor", value=entry) from None
        out.append(f"{pattern}={buffer}")
    return tuple(out)


def split_entry(entry: str) -> tuple[str, str]:
    pattern, _, buffer = entry.partition("=")
    return pattern, buffer


def device_names(dev) -> set[str]:
    """The buffer names a plan's device answers to: its own name, llama.cpp's buffer-type name (an RPC worker's is
    RPC<index on that worker>[endpoint], ggml-rpc.cpp ggml_backend_rpc_buffer_type; one device per ctxq worker, so
    0), ggml's device name for an RPC device (RPCn, its place among RPC devices) and CUDAn for a described GPUn (a
    card's name as the CUDA backend gives it)."""
    names = {dev.name, re.sub(r"\[.*", "", dev.name)}  # RPC1[host:port] answers to ggml's device name RPC1 too
    if getattr(dev, "endpoint", None):
        names.add(f"RPC0[{dev.endpoint}]")
    m = re.fullmatch(r"(GPU|CUDA)(\d+)", dev.name)
    if m:
        names |= {f"GPU{m.group(2)}", f"CUDA{m.group(2)}"}
    return names


def llama_buffer(dev) -> str:
    """The name llama.cpp's -ot takes for this device (`ggml_backend_buft_name`)."""
    if getattr(dev, "endpoint", None):
        return f"RPC0[{dev.endpoint}]"
    m = re.fullmatch(r"GPU(\d+)", dev.name)
    return f"CUDA{m.group(1)}" if m else dev.name


@dataclass(frozen=True)
class UserTensors:
    """Where the user's patterns put each tensor, summed by slot: slots 0..n_layer-1 are the layers, n_layer the
    output head (output.weight, output_norm; a tied model's token_embd copy), n_layer + 1 the input (token_embd,
    kept on the host by llama.cpp). Bytes."""

    overrides: tuple[str, ...]  # "PATTERN=BUFFER", in the user's order
    moved: tuple[int, ...]  # per slot, the bytes the user's patterns take from it (to any buffer)
    moved_ffn: tuple[int, ...]  # per layer, of `moved`, the dense FFN's (ctxq's FFN pattern's, FFN_RE)
    moved_experts: tuple[int, ...]  # per layer, of `moved`, the routed experts'
    to: dict = field(default_factory=dict)  # buffer name -> per slot, the bytes it receives

    def buffers(self) -> list[str]:
        return list(self.to)

    def bytes_to(self, names: Iterable[str]) -> int:
        """What the buffers named `names` (one device's, `device_names`) receive in all."""
        return sum(sum(per) for b, per in self.to.items() if b in set(names))

    def from_slots(self, slots: Iterable[int]) -> int:
        return sum(self.moved[s] for s in slots)

    def host_layers(self, layers: Iterable[int]) -> set[int]:
        """Of `layers`, those with tensors the user put in host memory: their FFN-like split runs on the host."""
        cpu = self.to.get(CPU)
        return {il for il in layers if cpu and cpu[il]} if cpu else set()


def user_tensors(tensors, info: ModelInfo, overrides: tuple[str, ...]) -> UserTensors | None:
    """The placement `overrides` ("PATTERN=BUFFER", first match wins) make of a model's `tensors` (name, nbytes);
    None without overrides. A pattern that matches no tensor: InvalidOption (llama.cpp would silently ignore it)."""
    if not overrides:
        return None
    n = info.n_layer
    rules = [(re.compile(p), p, b) for p, b in map(split_entry, overrides)]
    moved, to = [0] * (n + 2), {b: [0] * (n + 2) for _, _, b in rules}
    ffn, experts, used = [0] * n, [0] * n, set()
    for t in tensors:
        hit = next(((p, b) for rx, p, b in rules if rx.search(t.name)), None)
        if hit is None:
            continue
        used.add(hit[0])
        slots = _slots(t.name, info)
        for s in slots:
            moved[s] += t.nbytes
            to[hit[1]][s] += t.nbytes
            if s < n:
                ffn[s] += t.nbytes if FFN_RE.match(t.name) else 0
                experts[s] += t.nbytes if _EXPERT.match(t.name) else 0
    unused = [p for _, p, _ in rules if p not in used]
    if unused:
        raise InvalidOption(f"override_tensor '{unused[0]}' matches no tensor of this model (names look like "
                            "blk.0.ffn_up.weight); fix the pattern or drop it", option="override_tensor",
                            value=unused[0])
    return UserTensors(tuple(overrides), tuple(moved), tuple(ffn), tuple(experts), to)


def _slots(name: str, info: ModelInfo) -> list[int]:
    """The slots a tensor occupies: its layer; the output head; the input (token_embd, and for tied embeddings its
    copy at the head: TENSOR_DUPLICATED in load_tensors, the same name, so the same pattern places both)."""
    n = info.n_layer
    m = _BLOCK.match(name)
    if m:
        il = int(m.group(1))
        return [il] if il < n and not info.layers[il].mtp else []
    if name in _INPUT:
        return [n + 1, n] if name == "token_embd.weight" and info.output_tied else [n + 1]
    if name.startswith("output"):
        return [n]
    return [n + 1]  # other non-layer tensors sit with the inputs on the host (ModelInfo.other_bytes)
