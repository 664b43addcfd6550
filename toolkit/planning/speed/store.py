"""Measured speeds (`ctxq bench`), kept per model file, device set and llama.cpp version, for `--split-mode auto`.

One JSON file per measurement under `<ctxq home>/bench/`, named by the hash of what makes it comparable: the model
file (path, size, modification time), the devices (kind, backend and memory of each, in order; not RPC ports, so a
`--simulate` set measured once counts for the same set planned again), llama.cpp's version, and the plan's settings
that change its speed (context, batch sizes, cache types, split mode, tensor_split, layers offloaded). Each file also
names its family (the model file, devices and llama.cpp version alone) and micro-batch, so the planner can list the
micro-batches measured for a model on these devices (`ubatches`) and plan each (planning/ubatch.py). The planner
only reads here; `runtime.bench` measures and writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...paths import ctxq_home
from ... import tempfiles


@dataclass
class Measured:
    """llama-bench's figures for one plan: prompt processing (`-p` tokens at depth `-d`) and generation (`-n`
    tokens at depth `-d`), tokens/s per repetition."""

    mode: str
    tensor_split: list
    n_prompt: int
    n_gen: int
    depth: int
    pp_tps: list[float] = field(default_factory=list)
    tg_tps: list[float] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # names, for the output
    llama_cpp: str = ""
    n_ubatch: int = 0  # the plan's micro-batch (0: a file kept before it was recorded)
    family: str = ""  # `family(plan)`: the model file, devices and llama.cpp version, no plan settings

    @property
    def pp(self) -> float:
        return sum(self.pp_tps) / len(self.pp_tps) if self.pp_tps else 0.0

    @property
    def tg(self) -> float:
        return sum(self.tg_tps) / len(self.tg_tps) if self.tg_tps else 0.0

    def total_s(self, prompt_tokens: int, gen_tokens: int) -> float | None:
        """Seconds for a workload at these measured rates (prefill, then generation)."""
        if self.pp <= 0 or self.tg <= 0:
            return None
        return prompt_tokens / self.pp + gen_tokens / self.tg

    def to_dict(self) -> dict:
        return asdict(self) | {"pp_mean": self.pp, "tg_mean": self.tg, "measured": True}


def _llama_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:  # pragma: no cover - setup installs it
        return "unknown"


def _hash(facts: list) -> str:
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:24]


def _family_facts(plan) -> list | None:
    path = Path(plan.model)
    if not path.is_file():
        return None
    st = path.stat()
    devices = [(g.device.kind, g.device.backend, g.device.total) for g in plan.gpus]
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns, devices, _llama_version()]


def key(plan) -> str | None:
    """What makes a measurement of `plan` comparable (see the module's docstring); None for a model that is not a
    local file (nothing to measure it against yet)."""
    facts = _family_facts(plan)
    if facts is None:
        return None
    return _hash(facts + [plan.n_ctx, plan.n_batch, plan.n_ubatch, plan.type_k, plan.type_v, plan.split_mode,
                          list(plan.tensor_split), plan.n_gpu_layers, plan.n_seq_max]
                 # a placement with weights in host memory is another plan (planning/spill/placement.py)
                 + ([["ffn"] + list(plan.cpu_ffn_layers)] if getattr(plan, "cpu_ffn_layers", None) else []))


def family(plan) -> str | None:
    """The model file, the devices (as in `key`) and llama.cpp's version: measurements of other plans of the same
    model on the same devices share it."""
    facts = _family_facts(plan)
    return None if facts is None else _hash(facts)


def folder() -> Path:
    return ctxq_home() / "bench"


def save(plan, m: Measured) -> Path | None:
    k = key(plan)
    if k is None:
        return None
    out = folder() / f"{k}-{m.n_prompt}-{m.n_gen}-{m.depth}.json"
    m = replace(m, n_ubatch=plan.n_ubatch, family=family(plan))
    tmp = tempfiles.create(out, "bench")  # a stopped write leaves a temporary the next sweep removes, never half a file
    try:
        tmp.write_text(json.dumps(asdict(m)))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def lookup(plan) -> Measured | None:
    """The latest measurement of this plan on these devices (any workload), or None."""
    k = key(plan)
    if k is None or not folder().is_dir():
        return None
    found = sorted(folder().glob(f"{k}-*.json"), key=lambda f: f.stat().st_mtime_ns)
    for f in reversed(found):
        try:
            return Measured(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            continue
    return None


def ubatches(plan) -> list[int]:
    """The micro-batches measured for this plan's model on its devices (any plan settings), smallest first."""
    fam = family(plan)
    if fam is None or not folder().is_dir():
        return []
    found = set()
    for f in folder().glob("*.json"):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and d.get("family") == fam and isinstance(d.get("n_ubatch"), int) and d["n_ubatch"] > 0:
            found.add(d["n_ubatch"])
    return sorted(found)


def _spec_file(plan) -> Path | None:
    k = key(plan)
    return None if k is None else folder() / f"{k}-spec.json"


def save_spec_cost(plan, cost: dict[int, float], depth: int) -> Path | None:
    """`ctxq bench --spec`: the time of a batch of n tokens (logits at each) against one token, at `depth`."""
    out = _spec_file(plan)
    if out is None:
        return None
    tmp = tempfiles.create(out, "bench")
    try:
        tmp.write_text(json.dumps({"cost": {str(n): c for n, c in cost.items()}, "depth": depth,
                                   "family": family(plan)}))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def spec_cost(plan) -> dict[int, float] | None:
    """The cost curve `save_spec_cost` kept for this plan on these devices, or None."""
    f = _spec_file(plan)
    if f is None or not f.is_file():
        return None
    try:
        return {int(n): float(c) for n, c in json.loads(f.read_text())["cost"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
