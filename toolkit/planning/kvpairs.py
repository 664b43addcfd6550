"""Which K/V cache pairs a plan considers, in which order, and which one it keeps.

Candidates are the pairs the plan's backends run at speed, K at least as precise as V (K is the more sensitive:
llama.cpp PR 7412's table, and ctxq's own below). The CPU's flash attention takes every type llama.cpp offers for
a cache (ggml-cpu/ops.cpp: a vec_dot for K, a to_float for V); CUDA's only the pairs compiled into the build
(`GGML_CUDA_FA_QUANTS`, default q4_0-q4_0;q8_0-q8_0;f16-f16;bf16-bf16): another pair converts K and V to f16 at
every step ("slow", ggml-cuda/fattn.cu), so it is taken only when asked for.

The order is the measured loss (mean KL against an f16 cache, `ctxq quality`) of this model where it was measured,
else `DEFAULT_KL`, ctxq's measurement of SmolLM2; the plan keeps the first pair that holds every layer on the
GPUs, or, when none does, what the policy prefers (`choose`).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import DoesNotFit, InvalidOption
from ..gguf.info import KV_TYPES

# bf16 takes the bytes of f16 (no saving) and is slower on CPUs without native bf16: chosen only when asked for.
AUTO_TYPES = tuple(t for t in KV_TYPES if t != "bf16")
CUDA_DEFAULT_PAIRS = "q4_0-q4_0;q8_0-q8_0;f16-f16;bf16-bf16"  # ggml/CMakeLists.txt GGML_CUDA_FA_QUANTS

# Mean KL (nats) against an f16 cache: SmolLM2-135M-Instruct Q4_1, the built-in text, 2,048 tokens, positions
# 1,024-2,046 scored, CPU, flash attention (`ctxq quality --ctx 2048`, 2026-12-04; the table in docs/quality.md). The
# order without a measurement of the model itself. K's precision matters most: every pair with an 8-bit or f16 K
# stays under 0.011, K at 5 bits 0.018-0.030, K at 4 bits 0.059-0.071.
DEFAULT_KL = {
    ("f16", "f16"): 0.0, ("f16", "q8_0"): 0.00416, ("f16", "q5_1"): 0.00537, ("f16", "q5_0"): 0.00575,
    ("f16", "q4_1"): 0.00967, ("f16", "iq4_nl"): 0.00932, ("f16", "q4_0"): 0.01034, ("q8_0", "q8_0"): 0.00449,
    ("q8_0", "q5_1"): 0.00564, ("q8_0", "q5_0"): 0.0063, ("q8_0", "q4_1"): 0.00993, ("q8_0", "iq4_nl"): 0.01029,
    ("q8_0", "q4_0"): 0.0106, ("q5_1", "q5_1"): 0.01789, ("q5_1", "q5_0"): 0.01943, ("q5_1", "q4_1"): 0.0206,
    ("q5_1", "iq4_nl"): 0.02033, ("q5_1", "q4_0"): 0.02037, ("q5_0", "q5_0"): 0.02299, ("q5_0", "q4_1"): 0.0295,
    ("q5_0", "iq4_nl"): 0.02632, ("q5_0", "q4_0"): 0.02882, ("q4_1", "q4_1"): 0.06107, ("q4_1", "iq4_nl"): 0.07067,
    ("q4_1", "q4_0"): 0.06926, ("iq4_nl", "iq4_nl"): 0.05859, ("iq4_nl", "q4_0"): 0.06387, ("q4_0", "q4_0"): 0.07059,
}
QUALITY_FLOOR = ("q8_0", "q8_0")  # prefer="quality" moves layers to the CPU rather than lose more than this


def parse_kv(spec: str) -> tuple[str, str] | None:
    """"auto" -> None; "q8_0" -> (q8_0, q8_0); "q8_0/q4_0" -> (q8_0, q4_0); InvalidOption otherwise."""
    if spec in (None, "auto"):
        return None
    k, _, v = str(spec).partition("/")
    v = v or k
    for t in (k, v):
        if t not in KV_TYPES:
            raise InvalidOption(f"`kv` must be auto, a type ({', '.join(KV_TYPES)}) or K/V such as q8_0/q4_0, "
                                f"not {spec!r}", option="kv", value=spec)
    return k, v


def usable_types(info) -> list[str]:
    """KV types whose blocks divide each K and V head, not only a row (llama_init_from_model: "does not divide")."""
    from ..gguf.reader import GGML_BLOCKS, GGML_TYPES

    return [t for t in info.kv_bytes_per_token if not (info.head_dim_k % (b := GGML_BLOCKS[GGML_TYPES[t.upper()]][0])
                                                        or info.head_dim_v % b)]


def cuda_compiled_pairs() -> set[tuple[str, str]]:
    """The K-V pairs CUDA's flash attention runs at speed: CTXQ_CUDA_FA_QUANTS, else the loaded CUDA backend's
    FA_QUANTS feature (ggml_backend_cuda_get_features), else llama.cpp's default list."""
    spec = os.environ.get("CTXQ_CUDA_FA_QUANTS") or _build_fa_quants() or CUDA_DEFAULT_PAIRS
    if spec.strip() == "all":
        return {(k, v) for k in KV_TYPES for v in KV_TYPES}
    return {tuple(p.split("-", 1)) for p in spec.split(";") if "-" in p}


@functools.lru_cache(maxsize=1)
def _build_fa_quants() -> str | None:
    """The loaded llama.cpp's list, when this process has loaded it: GPUs that were detected were found through it;
    described ones (--gpus) are planned for llama.cpp's default build, and a plan need not load llama.cpp."""
    if "llama_cpp" not in sys.modules:
        return None
    try:
        info = sys.modules["llama_cpp"].llama_print_system_info().decode("utf-8", "replace")
    except Exception:  # an older or partial binding: the default list
        return None
    m = re.search(r"FA_QUANTS = ([^|]+)", info)
    return m.group(1).strip() if m else None


def at_speed(cuda: bool) -> list[tuple[str, str]]:
    """The pairs, K at least as precise as V, that these backends run at speed."""
    pairs = [(k, v) for i, k in enumerate(AUTO_TYPES) for v in AUTO_TYPES[i:]]
    if cuda:
        compiled = cuda_compiled_pairs()
        pairs = [p for p in pairs if p in compiled]
    return pairs


@dataclass
class Candidate:
    type_k: str
    type_v: str
    loss: float  # mean KL against f16: measured, else DEFAULT_KL's
    measured: object = None  # the ctxq.quality.Result it comes from, if measured

    @property
    def pair(self) -> tuple[str, str]:
        return self.type_k, self.type_v

    @property
    def name(self) -> str:
        return f"{self.type_k}/{self.type_v}"


def measurements(model: str, n_ctx: int) -> dict[tuple[str, str], object]:
    """This model file's KV measurements (`ctxq quality`) of one text and context: the context planned if
    measured, else the longest measured (the loss grows with the context)."""
    if not model or not Path(model).is_file():
        return {}
    from .quality_store import results

    groups: dict[tuple, dict] = {}
    for r in results(model):
        groups.setdefault((r.text_sha256, r.n_ctx), {})[(r.type_k, r.type_v)] = r
    if not groups:
        return {}
    best = max(groups, key=lambda g: (g[1] == n_ctx, g[1], len(groups[g])))
    return groups[best]


def ranked(pairs: list[tuple[str, str]], measured: dict) -> list[Candidate]:
    """`pairs` as candidates, least loss first: the measured ones by their measurement (f16/f16 loses nothing),
    then the rest by DEFAULT_KL."""
    out = []
    for k, v in pairs:
        r = measured.get((k, v))
        if r is not None or (measured and (k, v) == ("f16", "f16")):
            out.append(Candidate(k, v, r.mean_kl if r is not None else 0.0, r))
    known = {c.pair for c in out}
    rest = [Candidate(k, v, DEFAULT_KL.get((k, v), float("inf"))) for k, v in pairs if (k, v) not in known]
    return sorted(out, key=lambda c: c.loss) + sorted(rest, key=lambda c: c.loss)


def limited(cands: list[Candidate], max_kl: float | None, model: str, n_ctx: int, fixed: bool = False) -> list[Candidate]:
    """The candidates within `max_kl`; InvalidOption when this model has no measurement to hold it to, or the pair
    the caller fixed loses more."""
    if max_kl is None:
        return cands
    if not any(c.measured for c in cands):
        raise InvalidOption(f"max_kl needs a measurement of this model's KV cache: run `ctxq quality "
                            f"{Path(model).name} --ctx {n_ctx}` first", option="max_kl", value=max_kl)
    within = [c for c in cands if (c.measured is not None or c.pair == ("f16", "f16")) and c.loss <= max_kl]
    if fixed and not within:
        c = cands[0]
        said = f"mean KL {c.loss:.4g} (measured)" if c.measured else "a loss not measured on this model"
        raise InvalidOption(f"KV {c.name} loses {said}, more than max_kl={max_kl:g}: drop `kv` to let the plan "
                            "choose, or allow more loss", option="max_kl", value=max_kl)
    return within


def search(cands: list[Candidate], find, kv_bytes, past_full: bool = False) -> list[tuple[Candidate, object]]:
    """Plans for the candidates in order, `find(tk, tv)` -> (plan or None, host); stops at the first that holds
    every layer and expert on the devices, and skips a pair whose cache is no smaller than one already found
    short (it could hold no more, and loses more). past_full (prefer="speed"): goes on past it to the smaller
    caches, which read fewer bytes a token and leave room (`choose` weighs them). [(candidate, plan)], hosts."""
    found, hosts, smallest_short = [], [], None
    for c in cands:
        size = kv_bytes(*c.pair)
        if smallest_short is not None and size >= smallest_short:
            continue
        p, host = find(*c.pair)
        hosts.append((host, c.type_v))
        if p is None:
            smallest_short = size if smallest_short is None else min(smallest_short, size)
            continue
        found.append((c, p))
        if p.cpu_layers == 0 and not p.cpu_expert_layers and not p.cpu_ffn_layers and not past_full:
            break
        smallest_short = size if smallest_short is None else min(smallest_short, size)
    return found, hosts


def choose(found: list[tuple[Candidate, object]], devices: list, prefer: str, max_kl: float | None,
           cands: list[Candidate], timed=None):
    """(candidate, plan) the policy keeps and the reason. Every layer on the GPUs: prefer="quality" (the default)
    keeps the pairs within q8_0/q8_0's loss (or max_kl); where some of them keep weights in host memory, the one the
    estimate times fastest (`by_time`), else the fewest weights in host memory, then the least loss. Otherwise prefer="quality" keeps the loss within q8_0/q8_0's (or max_kl) and moves layers
    to the CPU; "speed" the most layers on the GPUs, then the least loss. prefer="speed" with `timed(plan)` (the
    workload's estimated seconds, or None): the fastest plan where that is faster than the least loss's
    (`fastest`)."""
    if prefer == "speed" and timed is not None and len(found) > 1:
        got = fastest(found, timed)
        if got is not None:
            return got
    rank = {id(c): i for i, (c, _) in enumerate(found)}
    full = [(c, p) for c, p in found if p.cpu_layers == 0 or not devices]
    if full:
        held = lambda p: (len(p.cpu_expert_layers), len(p.cpu_ffn_layers))  # noqa: E731 (weights in host memory)
        if prefer == "quality":  # the floor holds whether the room comes from spilling weights or from moving layers
            floor = max_kl if max_kl is not None else next((x.loss for x in cands if x.pair == QUALITY_FLOOR), 0.0)
            full = [(c, p) for c, p in full if c.loss <= floor] or full
        timed_choice = by_time(full, timed) if devices and any(held(p) != (0, 0) for _, p in full) else None
        if timed_choice is not None:
            return timed_choice
        # untimed: the fewest weights in host memory, then the least loss
        c, p = min(full, key=lambda cp: (*held(cp[1]), rank[id(cp[0])]))
        why = "all layers on the GPUs" if devices else "no GPUs: everything on the CPU"
        if devices and p.cpu_expert_layers:
            why += f", the experts of {len(p.cpu_expert_layers)} in CPU memory"
        if devices and p.cpu_ffn_layers:
            why += f", the FFN weights of {len(p.cpu_ffn_layers)} in host memory"
        return c, p, why
    if prefer == "quality":
        floor = max_kl if max_kl is not None else next((x.loss for x in cands if x.pair == QUALITY_FLOOR), 0.0)
        good = [(c, p) for c, p in found if c.loss <= floor] or found
        c, p = max(good, key=lambda cp: (cp[1].n_gpu_layers, -rank[id(cp[0])]))
        return c, p, f"{p.cpu_layers} layers on the CPU; KV kept at {c.name} for quality"
    c, p = max(found, key=lambda cp: (cp[1].n_gpu_layers, -rank[id(cp[0])]))
    return c, p, f"{p.cpu_layers} layers on the CPU with the KV pair that minimises them"


def by_time(full: list[tuple[Candidate, object]], timed):
    """(candidate, plan, why) of the pair, among those the quality setting allows that hold every layer on the
    cards, whose plan the estimate times fastest for the workload, where some keep weights in host memory: their
    copies to the card make the time, not the cache's size. None where a plan cannot be timed."""
    if timed is None or len(full) < 2:
        return None
    secs = [timed(p) for _, p in full]
    if any(t is None for t in secs):
        return None
    i = min(range(len(full)), key=lambda j: (secs[j], j))  # a tie keeps the smaller loss
    c, p = full[i]
    p.speed = {**p.speed, "kv": {o.name: secs[j] for j, (o, _) in enumerate(full)}}
    why = "all layers on the GPUs"
    if p.cpu_expert_layers:
        why += f", the experts of {len(p.cpu_expert_layers)} in CPU memory"
    if p.cpu_ffn_layers:
        why += f", the FFN weights of {len(p.cpu_ffn_layers)} in host memory"
    others = "; ".join(f"{o.name} {secs[j]:.0f} s" + (f" (FFN of {len(q.cpu_ffn_layers)} layers in host memory)"
                                                      if q.cpu_ffn_layers else "")
                       for j, (o, q) in enumerate(full) if j != i)
    return c, p, (f"{why}; KV {c.name} estimated fastest for the workload at -ub {p.n_ubatch}: {secs[i]:.0f} s "
                  f"against {others}")


SPEED_MARGIN = 0.05  # prefer="speed" trades quality only for 5 % or more of estimated time: less is within its error


def fastest(found: list[tuple[Candidate, object]], timed):
    """prefer="speed": (candidate, plan, why) of the pair whose plan the estimate times fastest for the workload,
    when it is SPEED_MARGIN faster than the least loss's (found[0]), else None.
    Every plan must be timed (the devices carry speed facts), else the least-loss order stands."""
    secs = [timed(p) for _, p in found]
    if any(t is None for t in secs):
        return None
    i = min(range(len(found)), key=lambda j: (secs[j], j))  # a tie keeps the smaller loss
    if i == 0 or secs[i] > secs[0] * (1 - SPEED_MARGIN):
        return None
    c, p = found[i]
    why = f"KV {c.name} for speed: {secs[i]:.1f} s estimated for the workload against {secs[0]:.1f} s with {found[0][0].name}"
    if p.cpu_layers != found[0][1].cpu_layers:
        why += f" ({p.cpu_layers} layers on the CPU against {found[0][1].cpu_layers})"
    return c, p, why


def too_lossy(max_kl: float, fits: Candidate | None, n_ctx: int) -> DoesNotFit:
    """No pair within max_kl fits: one line naming the least loss that does."""
    if fits is None:
        return DoesNotFit(f"{n_ctx} tokens do not fit with any KV pair within mean KL {max_kl:g}, nor with any "
                          "other measured pair", "use a smaller n_ctx or more GPU memory", option="max_kl",
                          value=max_kl)
    return DoesNotFit(f"no KV pair within mean KL {max_kl:g} holds {n_ctx} tokens on these devices",
                      f"the least measured loss that fits is {fits.name}, mean KL {fits.loss:.4g}: use "
                      f"max_kl={fits.loss:.3g} or more GPU memory", option="max_kl", value=max_kl, limit=fits.loss)


def quality_line(c: Candidate | None, model: str, n_ctx: int) -> dict:
    """What the plan records of its KV pair's cost (`Plan.kv_quality`): the measurement, or that there is none."""
    if c is None:
        return {}
    if c.pair == ("f16", "f16"):
        return {"type_k": "f16", "type_v": "f16", "measured": True, "mean_kl": 0.0}
    r = c.measured
    if r is None:
        return {"type_k": c.type_k, "type_v": c.type_v, "measured": False, "mean_kl": None,
                "default_kl": DEFAULT_KL.get(c.pair)}
    return {"type_k": c.type_k, "type_v": c.type_v, "measured": True, "mean_kl": r.mean_kl, "p99_kl": r.p99_kl,
            "top1_agreement": r.top1_agreement, "text": r.text, "n_ctx": r.n_ctx}


def describe(q: dict, model: str, n_ctx: int) -> str:
    """`Plan.kv_quality` as the one line `ctxq plan` prints."""
    pair = f"{q['type_k']}/{q['type_v']}"
    if pair == "f16/f16":
        return "KV f16/f16: the reference precision, nothing lost"
    if not q["measured"]:
        return (f"KV {pair}: not measured on this model (chosen in ctxq's default order); measure it: "
                f"ctxq quality {model} --ctx {n_ctx}")
    return (f"KV {pair}: mean KL {q['mean_kl']:.4f}, top-1 {q['top1_agreement'] * 100:.1f} % vs f16, measured on "
            f"{q['text']} at {q['n_ctx']:,} tokens")
