"""What llama.cpp itself allocates for a model, from a metadata-only load of its header on the CPU.

`accounting(path, ...)` loads the model with `no_alloc` (llama.cpp "only load metadata and simulate memory
allocations"), creates a context at the given settings and reads llama.cpp's log: the hparams it derived
(`print_info`: per-layer `n_embd_k_gqa` / `n_embd_v_gqa`, `n_swa`), each KV cache it created (an iSWA model
has a non-SWA and a SWA cache; `llama_kv_cache: layer N: dev = ...` names the layers a cache holds,
`- layer N: reuse layer M` the layers that share another's KV), the recurrent state (`llama_memory_recurrent`),
the output buffer and `llama_model_size`. That covers sliding, chunked, MLA (no V cache), KV-shared and
recurrent layers of any architecture without a rule per architecture.

The dry runs run in a process of their own (`dry.py`: a llama.cpp abort is an error, not the end of ctxq). Answers,
aborts included, are cached per model file (path, size, mtime and a hash of the header's first bytes) and settings
under ctxq's cache, as JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from ..paths import ctxq_home
from ..units import MiB

log = logging.getLogger(__name__)

_VERSION = "1"  # bump when the parsed facts change shape
PRINT_ROUNDING = -(-MiB // 200)  # llama.cpp prints MiB with two decimals: each printed size is within 0.005 MiB

_INFO_RE = re.compile(r"^print_info: (n_swa|n_embd_k_gqa|n_embd_v_gqa|n_layer_all|n_layer)\s+= (.+)$")
_CACHE_RE = re.compile(r"^llama_kv_cache_iswa: creating\s+(non-SWA|SWA) KV cache")
_KV_LAYER_RE = re.compile(r"^llama_kv_cache: layer\s+(\d+): dev = ")
_REUSE_RE = re.compile(r"^llama_kv_cache: - layer\s+(\d+): reuse layer (\d+)")
_KV_SIZE_RE = re.compile(r"^llama_kv_cache: size = .*\(\s*(\d+) cells,\s*(\d+) layers,.*K \((\w+)\):\s+([\d.]+) MiB, "
                         r"V \((\w+)\):\s+([\d.]+) MiB")
_RS_LAYER_RE = re.compile(r"^llama_memory_recurrent, layer\s+(\d+): dev = ")
_RS_SIZE_RE = re.compile(r"^llama_memory_recurrent: size = .*R \(\w+\):\s+([\d.]+) MiB, S \(\w+\):\s+([\d.]+) MiB"
                         r"(?:, P \(\w+\):\s+([\d.]+) MiB)?")
_OUT_RE = re.compile(r"^llama_context:\s+\S+\s+output buffer size =\s+([\d.]+) MiB")


@dataclass
class KVCache:
    """One KV cache llama.cpp created: its cells, the layers holding their own K/V, the printed sizes."""

    swa: bool
    cells: int
    layers: list[int]
    k_bytes: int  # as printed (within PRINT_ROUNDING)
    v_bytes: int


@dataclass
class Accounting:
    """llama.cpp's own accounting of a model at one set of context settings; sizes in bytes."""

    n_ctx: int
    n_ubatch: int
    type_k: str
    type_v: str
    flash_attn: bool
    n_layer: int  # llama.cpp's n_layer_all (NextN blocks included)
    n_swa: int
    n_embd_k_gqa: list[int]  # per layer, as llama_hparams computes them
    n_embd_v_gqa: list[int]
    caches: list[KVCache] = field(default_factory=list)
    reused: dict[int, int] = field(default_factory=dict)  # layer -> the layer whose KV it reads
    recurrent: list[int] = field(default_factory=list)  # layers with a recurrent state
    state_bytes: int = 0  # R + S (+ P) as printed, for n_seq_max sequences
    state_printed: int = 0  # how many state sizes were printed (each within PRINT_ROUNDING)
    output_bytes: int = 0  # the host's output (logits) buffer
    model_bytes: int = 0  # llama_model_size
    n_seq_max: int = 1  # the context's sequences: the RS buffer holds max(1, n_seq_max) states
    kv_unified: bool = False
    n_outputs_max: int = 0  # 0: llama.cpp's default (n_batch)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention: llama.cpp keeps no V cache (llama_kv_cache: has_v = !is_mla())."""
        held = [c for c in self.caches if c.layers]
        return bool(held) and all(c.v_bytes == 0 < c.k_bytes for c in held)

    def cache_of(self, il: int) -> KVCache | None:
        return next((c for c in self.caches if il in c.layers), None)

    def sliding(self, il: int) -> bool:
        """In the SWA cache (or reading the KV of a layer that is)."""
        c = self.cache_of(self.reused.get(il, il))
        return bool(c and c.swa)

    def attention(self, il: int) -> bool:
        return self.cache_of(il) is not None or il in self.reused

    def v_width(self, il: int, flash_attn: bool) -> int:
        """V row width of layer il: none with MLA; without flash attention a transposed V cache pads every
        layer to the widest (llama_kv_cache, TAG_V_CACHE_VARIABLE)."""
        if self.mla:
            return 0
        return self.n_embd_v_gqa[il] if flash_attn else max(self.n_embd_v_gqa)

    def layer_kv(self, type_k: str, type_v: str, flash_attn: bool) -> list[int]:
        """Bytes of each layer's own K and V at this accounting's cells, for these types."""
        from ..gguf.info import kv_bytes

        out = [0] * self.n_layer
        for c in self.caches:
            for il in c.layers:
                out[il] = c.cells * (kv_bytes(type_k, self.n_embd_k_gqa[il])
                                     + kv_bytes(type_v, self.v_width(il, flash_attn)))
        return out

    def consistent(self) -> bool:
        """The per-layer widths reproduce every cache's printed K and V sizes."""
        from ..gguf.info import kv_bytes

        for c in self.caches:
            k = sum(c.cells * kv_bytes(self.type_k, self.n_embd_k_gqa[il]) for il in c.layers)
            v = sum(c.cells * kv_bytes(self.type_v, self.v_width(il, self.flash_attn)) for il in c.layers)
            if abs(k - c.k_bytes) > PRINT_ROUNDING or abs(v - c.v_bytes) > PRINT_ROUNDING:
                return False
        return True

    def state_per_layer(self) -> int:
        """One recurrent layer's state for one sequence: the printed total shared out, rounded up to the
        printing's precision so that it is never below llama.cpp's."""
        if not self.recurrent:
            return 0
        return -(-(self.state_bytes + self.state_printed * PRINT_ROUNDING) // (len(self.recurrent) * self.n_seq_max))


def parse(lines: list[str], **settings) -> Accounting:
    """The facts in a dry run's log lines (see the module docstring for the lines read)."""
    info: dict[str, str] = {}
    caches: list[KVCache] = []
    reused: dict[int, int] = {}
    recurrent: list[int] = []
    pending: list[int] = []
    swa = False
    state = printed = output = 0
    for line in lines:
        if m := _INFO_RE.match(line):
            info[m.group(1)] = m.group(2).strip()
        elif m := _CACHE_RE.match(line):
            swa, pending = m.group(1) == "SWA", []
        elif m := _KV_LAYER_RE.match(line):
            pending.append(int(m.group(1)))
        elif m := _REUSE_RE.match(line):
            reused[int(m.group(1))] = int(m.group(2))
        elif m := _KV_SIZE_RE.match(line):
            caches.append(KVCache(swa, int(m.group(1)), pending, round(float(m.group(4)) * MiB),
                                  round(float(m.group(6)) * MiB)))
            pending = []
        elif m := _RS_LAYER_RE.match(line):
            recurrent.append(int(m.group(1)))
        elif m := _RS_SIZE_RE.match(line):
            parts = [g for g in m.groups() if g is not None]
            state += sum(round(float(g) * MiB) for g in parts)
            printed += len(parts)
        elif m := _OUT_RE.match(line):
            output += round(float(m.group(1)) * MiB)
    n_layer = int(info.get("n_layer_all") or info.get("n_layer") or 0)

    def per_layer(key: str) -> list[int]:
        v = info.get(key, "0")
        vals = [int(x) for x in v.strip("[]").split(",")] if v.startswith("[") else [int(v)] * n_layer
        return vals if len(vals) == n_layer else [vals[0]] * n_layer

    return Accounting(n_layer=n_layer, n_swa=int(info.get("n_swa", "0")), n_embd_k_gqa=per_layer("n_embd_k_gqa"),
                      n_embd_v_gqa=per_layer("n_embd_v_gqa"), caches=caches, reused=reused, recurrent=recurrent,
                      state_bytes=state, state_printed=printed, output_bytes=output, **settings)


def _file_key(path: str, read_header: bool = True) -> str:
    """The model file's identity: path, size, mtime and a hash of its first MiB (the header's start; not
    read for ctxq's own derived models, whose names already hash what they hold)."""
    st = os.stat(path)
    h = hashlib.sha256(f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    if read_header:
        with open(path, "rb") as f:
            h.update(f.read(MiB))
    return h.hexdigest()[:24]


def answer_key(path: str, *parts, read_header: bool = True) -> str:
    """The cache key of one of llama.cpp's answers about the model file at `path`: the file's identity,
    `parts` (the question: settings) and the llama-cpp-python version."""
    return hashlib.sha256(json.dumps([_file_key(path, read_header), *parts, _VERSION, _llama_version()],
                                     sort_keys=True).encode()).hexdigest()[:24]


def accounting(path: str | os.PathLike, *, n_ctx: int, n_ubatch: int = 512, n_batch: int = 2048,
               type_k: str = "f16", type_v: str = "f16", flash_attn: bool = True, n_seq_max: int = 1,
               kv_unified: bool = False, n_outputs_max: int = 0) -> Accounting:
    """llama.cpp's accounting of the model file at `path` with these settings (a CPU dry run, cached).
    CtxqError with llama.cpp's reason when llama.cpp cannot load it."""
    path = str(path)
    settings = dict(n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v, flash_attn=flash_attn)
    parallel = dict(n_seq_max=n_seq_max, kv_unified=kv_unified, n_outputs_max=n_outputs_max)
    if parallel != dict(n_seq_max=1, kv_unified=False, n_outputs_max=0):  # the single-sequence keys stay as they were
        settings.update(parallel)
    return _cached(answer_key(path, n_batch, settings), path, n_batch, tuple(sorted(settings.items())))


@lru_cache(maxsize=1)
def _llama_version() -> str:
    """The llama-cpp-python version: another libllama may account differently. Read from the package's
    `__version__` line without importing it (importlib.metadata's search of sys.path: 25 ms a plan)."""
    import importlib.metadata as md
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec and spec.origin:
        m = re.search(r'^__version__ = "([^"]+)"', Path(spec.origin).read_text(), re.M)
        if m:
            return m.group(1)
    try:
        return md.version("llama_cpp_python")
    except md.PackageNotFoundError:
        return "?"


@lru_cache(maxsize=64)
def _cached(key: str, path: str, n_batch: int, settings: tuple) -> Accounting:
    folder = ctxq_home() / "accounting"
    f = folder / f"{key}.json"
    if f.exists():
        try:
            d = json.loads(f.read_text())
            _raise_aborted(d)
            d["caches"] = [KVCache(**c) for c in d["caches"]]
            d["reused"] = {int(k): v for k, v in d["reused"].items()}
            return Accounting(**d)
        except (ValueError, TypeError, KeyError):
            log.info("ignoring an unreadable accounting cache file %s", f)
    s = dict(settings)
    m = _dry(f, path, n_batch=n_batch, **s)
    acc = parse(m.log, **s)
    acc.model_bytes = m.model_bytes
    _write(f, asdict(acc))
    return acc


def _dry(f: Path, path: str, **settings):
    """llama.cpp's dry run in its own process (`dry.dry_measure`); an abort is cached in `f` as the answer would
    be (the same file, settings and llama.cpp abort the same way), so that the next plan does not start a process
    to hear it again."""
    from ..errors import LlamaAborted
    from .dry import dry_measure

    try:
        return dry_measure(path, **settings)
    except LlamaAborted as e:
        _write(f, {"aborted": e.reason, "message": str(e)})
        raise


def _raise_aborted(d: dict) -> None:
    if "aborted" in d:
        from ..errors import LlamaAborted

        raise LlamaAborted(d["message"], reason=d["aborted"])


def _write(f: Path, d: dict) -> None:
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(d))
    os.replace(tmp, f)


def dry_run_compute(path: str, **settings) -> int:
    """The compute buffers llama.cpp sizes for the model at `path` in a CPU dry run, cached on disk as the
    accounting's answers are: a new interpreter's plan then needs neither llama.cpp's import nor a dry run
    (0.10 of 0.16 CPU s of the 70B example's plan; scripts/bench_plan.py). ctxq's own derived models are
    keyed without reading their header: their names hash what they hold."""
    derived = Path(path).parent == ctxq_home() / "derived"
    f = ctxq_home() / "compute" / f"{answer_key(path, 'compute', settings, read_header=not derived)}.json"
    try:
        d = json.loads(f.read_text())
        _raise_aborted(d)
        return int(d["compute"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    total = sum(_dry(f, path, **settings).allocations.compute.values())
    _write(f, {"compute": total})
    return total
