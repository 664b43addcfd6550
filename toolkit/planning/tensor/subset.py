"""Tensor mode over some of the cards (issue 44): which subsets `tensor.search` tries beside every card, and how
llama.cpp is told to use only those.

A card given proportion 0 in `tensor_split` stays in llama.cpp's meta device (llama_prepare_model_devices puts
every device it is given into it; llama_meta_device_get_split_state gives it 0 rows of each split tensor), and
still holds the mirrored tensors, a whole compute buffer (ggml_backend_meta_buffer_type_alloc_buffer allocates
the same size on every card) and its all-reduce scratch, and takes part in every all-reduce. Measured over three
RPC workers (SmolLM2 Q4_1, 4,096 tokens, q8_0, split 1:1:0): the third worker held 28.8 MiB of tensors and a
97.1 MiB compute buffer. A card left out is therefore not given to llama.cpp at all: `-dev` on its command line
(llama_model_params.devices), for ctxq's runner the RPC workers it registers and CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import re

from ..devices import Device
from ..plan import Plan


def subsets(devices: list[Device]) -> list[tuple[list[int], str]]:
    """The subsets of at least 2 cards tensor mode also tries, as indices into `devices` with why the others are
    left out: the card slowest by memory bandwidth dropped one at a time while it is slower than the rest, then
    the same by memory (ik_llama.cpp's users leave a weaker card out: a tensor-mode layer waits for its slowest
    card)."""
    out, seen = [], {tuple(range(len(devices)))}
    for key, word, unit in ((lambda d: d.bandwidth or 0, "the slowest by memory bandwidth", 1e9),
                            (lambda d: d.usable, "the smallest by memory", 2**30)):
        keep = list(range(len(devices)))
        while len(keep) > 2 and all(key(devices[i]) for i in keep) and len({key(devices[i]) for i in keep}) > 1:
            worst = min(reversed(keep), key=lambda i: key(devices[i]))
            keep = [i for i in keep if i != worst]
            left = [i for i in range(len(devices)) if i not in keep]
            if tuple(keep) not in seen:
                seen.add(tuple(keep))
                hi = max(key(devices[i]) for i in keep)
                out.append((keep, f"{word}: {', '.join(f'{key(devices[i]) / unit:.0f}' for i in left)} "
                                  f"against {hi / unit:.0f} {'GB/s' if unit == 1e9 else 'GiB'}"))
    return out


def llama_name(devices: list[Device], i: int) -> str:
    """Device i as llama.cpp's -dev names it: an RPC worker's device RPC<n>, n counting the devices of the
    workers in `--rpc`'s order (ggml_backend_rpc_add_server; one device a worker, as ctxq's), a present GPU by
    ggml's name, a described one as the CUDA device at its place among the GPUs."""
    d = devices[i]
    if d.kind == "rpc":
        return f"RPC{sum(1 for x in devices[:i] if x.kind == 'rpc')}"
    if re.fullmatch(r"[A-Za-z]+\d+", d.name):
        return d.name
    return f"CUDA{sum(1 for x in devices[:i] if x.kind != 'rpc')}"


def mark_left_out(p: Plan, devices: list[Device], keep: list[int], why: str, than: str | None = None) -> None:
    """A plan over `keep` of `devices`: llama.cpp is given only those (-dev); the reason and a note say which were
    left out, why, and (`than`) against what."""
    p.device_order = keep
    p.llama_devices = [llama_name(devices, i) for i in keep]
    p.left_out = [{"device": devices[i].name, "why": why} for i in range(len(devices)) if i not in keep]
    p.reason += f"; {len(devices) - len(keep)} card(s) left out ({why})" + (f": {than}" if than else "")
    p.notes.append("left out of tensor mode: " + ", ".join(x["device"] for x in p.left_out)
                   + f" ({why}); llama.cpp is given only " + ", ".join(p.llama_devices)
                   + " (-dev; a card with proportion 0 would still hold a whole compute buffer)")
