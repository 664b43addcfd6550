"""Execute a plan: `ctxq.load()` returns a ready `llama_cpp.Llama`, `run()` prefills and generates.

The plan a user sees (`ctxq plan`) is the object loaded here: `Llama(model, **plan.llama_kwargs())`.
Long inputs are the point, so `run()` tokenizes the input *before* anything loads (a vocabulary-only
model takes milliseconds) and refuses an input that does not fit with both numbers; the context is
never shrunk. The prompt is evaluated in `n_batch` chunks so a progress callback can report, then
tokens are sampled and streamed through a text callback. The library prints nothing: llama.cpp's log
goes to the `ctxq.llama_cpp` logger and what it allocated is read from that log.
"""

from __future__ import annotations

import codecs
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..llama import backend
from ..errors import ContextTooLong, CtxqError, DoesNotFit, ReorderNeeded
from ..planning.planner import Plan
from ..units import default_threads

log = logging.getLogger(__name__)

DEFAULT_CTX = 4096  # llama.cpp's own default context (common_params.n_ctx)


@dataclass
class Progress:
    """Prompt processing so far: tokens done of total, seconds since prefill began."""

    done: int
    total: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class DeviceMemory:
    """Bytes on one device: what the plan expected (without its safety margin) and what llama.cpp
    reported allocating (model + KV + compute + output buffers, from its log)."""

    name: str
    planned: int
    reported: int


@dataclass
class RunResult:
    text: str
    tokens: list[int]  # generated token ids
    n_prompt: int
    load_s: float
    prefill_s: float  # evaluating the prompt
    decode_s: float  # from the first generated token to the last
    ttft_s: float  # prefill start to the first generated token
    stop: str  # "eos" (an end-of-generation token) or "length" (n_predict reached)
    plan: Plan
    memory: list[DeviceMemory] = field(default_factory=list)

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second; the first token comes from the prefill's logits, so
        n_generated - 1 evaluations happen in decode_s (llama.cpp's n_eval counts the same way)."""
        return (self.n_generated - 1) / self.decode_s if self.n_generated > 1 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"text": self.text, "n_prompt": self.n_prompt, "n_generated": self.n_generated, "stop": self.stop,
                "load_s": self.load_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "ttft_s": self.ttft_s, "prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps,
                "memory": [vars(m) for m in self.memory], "plan": self.plan.to_dict()}


# --- planning and loading ---------------------------------------------------------------------

def make_plan(model=None, n_ctx: int = DEFAULT_CTX, *, split: str | None = "auto", gpus=None, profile=None,
              rpc=None, kv: str = "auto", type_k=None, type_v=None, flash_attn=None, prefer: str = "quality",
              n_ubatch: int = 512, n_batch: int = 2048, reorder: bool = True) -> Plan:
    """`planner.plan` with `split="auto"` meaning: let the planner choose."""
    from ..planning.planner import plan

    return plan(model, n_ctx, gpus=gpus, profile=profile, rpc=rpc, kv=kv, type_k=type_k, type_v=type_v,
                flash_attn=flash_attn, split=None if split in (None, "auto") else split, prefer=prefer,
                n_ubatch=n_ubatch, n_batch=n_batch, reorder=reorder)


def llama_params(p: Plan, *, n_threads: int | None = None, seed: int | None = None) -> dict:
    """The `Llama(...)` keyword arguments for a plan (ctxq never renames llama.cpp's words)."""
    kw = p.llama_kwargs()
    threads = n_threads or default_threads()
    kw.update(n_threads=threads, n_threads_batch=threads, verbose=False, logits_all=False)
    if seed is not None:
        kw["seed"] = seed
    return kw


def cuda_visible_devices(order: list[int], current: str | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES value that presents the GPUs in `order` (indices into the GPUs this
    process sees, which `current` — the variable's present value — may already have narrowed)."""
    visible = [v.strip() for v in current.split(",")] if current else [str(i) for i in range(max(order) + 1)]
    return ",".join(visible[i] for i in order)


def _check_devices(p: Plan) -> None:
    """Refuse to run a plan for devices llama.cpp does not have (a what-if plan from --gpus)."""
    if not p.gpus:
        return
    present = [d for d in backend.ggml_devices() if d.type not in ("cpu", "accel")]
    if len(present) < len(p.gpus):
        raise CtxqError(f"the plan places layers on {len(p.gpus)} devices but llama.cpp sees {len(present)} "
                        f"({', '.join(d.name for d in present) or 'only the CPU'}); "
                        "`ctxq plan` shows what-if plans, `simulate` runs on local RPC workers")


def _apply_order(p: Plan, rpc) -> None:
    """Register RPC workers in the plan's order and check the GPU order can be honoured."""
    from ..rpc import add_servers, parse_rpc

    eps = parse_rpc(rpc) if rpc else []
    order = p.device_order
    if order and eps:
        if sorted(order[:len(eps)]) != list(range(len(eps))):
            raise CtxqError("the plan mixes the order of RPC workers and local GPUs, which llama.cpp cannot do "
                            "(RPC devices always come first); plan with reorder=False")
        eps = [eps[i] for i in order[:len(eps)]]  # RPC devices take llama.cpp's order from registration
        order = [i - len(eps) for i in order[len(eps):]] or None
    if eps:
        add_servers(eps)
    if order and order != sorted(order):
        current = os.environ.get("CUDA_VISIBLE_DEVICES")
        value = cuda_visible_devices(order, current)
        if os.environ.get("CTXQ_DEVICE_ORDER_APPLIED") != value:
            raise ReorderNeeded(value)


def prepare_devices(p: Plan, rpc=None) -> None:
    """Before loading: register RPC workers in the plan's order, check GPU order and presence."""
    _apply_order(p, rpc)
    _check_devices(p)


def load_plan(p: Plan, *, rpc=None, n_threads: int | None = None, seed: int | None = None, **llama_kwargs):
    """`(Llama, memory, seconds)` for a plan: load it as planned and compare memory with llama.cpp's log."""
    prepare_devices(p, rpc)
    lc = backend.llama_cpp()
    kw = llama_params(p, n_threads=n_threads, seed=seed)
    kw.update(llama_kwargs)
    t0 = time.perf_counter()
    with backend.capture_log() as lines:
        try:
            llm = lc.Llama(str(p.model), **kw)
        except ValueError as e:  # llama-cpp-python's words for a failed model or context
            tail = [l.strip() for l in lines if l.strip()][-1:]
            raise CtxqError(f"llama.cpp could not load {Path(p.model).name} as planned ({e}"
                            f"{': ' + tail[0] if tail else ''}); run with -v for its log") from None
    load_s = time.perf_counter() - t0
    if llm.n_ctx() < p.n_ctx:  # llama.cpp must never hold less than the plan promised
        llm.close()
        raise CtxqError(f"llama.cpp made a context of {llm.n_ctx()} tokens, not the {p.n_ctx} planned")
    return llm, memory_report(p, backend.parse_allocations(lines)), load_s


def memory_report(p: Plan, alloc: backend.Allocations) -> list[DeviceMemory]:
    """Planned against reported bytes per device. Host buffers ("CPU", "CPU_Mapped", "CPU_REPACK",
    "CUDA_Host" pinned memory) count for the host; a device buffer matches by name, else by position."""
    names = sorted({n for d in (alloc.model, alloc.kv, alloc.compute, alloc.output) for n in d})
    host_names = [n for n in names if n.startswith("CPU") or n.endswith("_Host")]
    dev_names = [n for n in names if n not in host_names]
    out = []
    for i, dp in enumerate(p.gpus):
        # RPC buffers are named "RPC<device on that worker>[host:port]": match the endpoint first
        by_ep = [n for n in dev_names if dp.device.endpoint and n.endswith(f"[{dp.device.endpoint}]")]
        name = by_ep[0] if by_ep else dp.device.name if dp.device.name in dev_names else (
            dev_names[i] if i < len(dev_names) else None)
        out.append(DeviceMemory(dp.device.name, dp.total - dp.margin, alloc.total(name) if name else 0))
    out.append(DeviceMemory(p.host.device.name, p.host.total - p.host.margin,
                            sum(alloc.total(n) for n in host_names)))
    return out


def load(model=None, n_ctx: int = DEFAULT_CTX, split: str | None = "auto", gpus=None, *, profile=None, rpc=None,
         kv: str = "auto", type_k=None, type_v=None, flash_attn=None, prefer: str = "quality",
         n_threads: int | None = None, seed: int | None = None, plan: Plan | None = None, **llama_kwargs):
    """A ready `llama_cpp.Llama` for `model` (default: the embedded SmolLM2) holding `n_ctx` tokens,
    configured from the plan for the devices present (or `gpus`/`profile`/`rpc`).

    The plan is `llm.ctxq_plan`, planned-vs-reported memory `llm.ctxq_memory`. Extra keyword arguments
    go to `Llama` unchanged. Raises `DoesNotFit` when the context fits nowhere. A plan that reorders
    the GPUs needs CUDA_VISIBLE_DEVICES set before CUDA starts; in a process where it has started,
    load() falls back to the best plan for the present order (and says so in the log).
    """
    opts = dict(split=split, gpus=gpus, profile=profile, rpc=rpc, kv=kv, type_k=type_k, type_v=type_v,
                flash_attn=flash_attn, prefer=prefer)
    given = plan is not None
    if plan is None:
        plan = make_plan(model, n_ctx, **opts)
    try:
        llm, memory, _ = load_plan(plan, rpc=rpc, n_threads=n_threads, seed=seed, **llama_kwargs)
    except ReorderNeeded as e:
        # CUDA is initialised in this process (planning asked it for its devices), so the better order
        # cannot be applied here; the plan for llama.cpp's own order is next best, if it fits.
        if given:
            raise
        try:
            plan = make_plan(model, n_ctx, reorder=False, **opts)
        except DoesNotFit:
            raise e from None
        log.warning("%s; using the plan for the present order instead", e)
        llm, memory, _ = load_plan(plan, rpc=rpc, n_threads=n_threads, seed=seed, **llama_kwargs)
    llm.ctxq_plan, llm.ctxq_memory = plan, memory
    return llm


# --- input: tokens before anything loads -------------------------------------------------------

def chat_prompt(model_or_llm, text: str | list[dict], system: str | None = None) -> tuple[str, bool]:
    """`text` as one user turn (or a list of OpenAI-style messages) in the GGUF's chat template:
    (prompt, whether the prompt holds BOS itself)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    m = model_or_llm._model if hasattr(model_or_llm, "_model") else model_or_llm
    template = m.metadata().get("tokenizer.chat_template")
    if not template:
        raise CtxqError("this model has no chat template (tokenizer.chat_template); use chat=False")
    eos, bos = m.token_eos(), m.token_bos()
    fmt = Jinja2ChatFormatter(template=template, eos_token=m.token_get_text(eos) if eos != -1 else "",
                              bos_token=m.token_get_text(bos) if bos != -1 else "", stop_token_ids=[eos])
    messages = text if isinstance(text, list) else \
        ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    r = fmt(messages=messages)
    return r.prompt, bool(r.added_special)


def tokenize(model, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
    """Tokens of `text` (as llama-cpp-python's completion does: BOS if the vocabulary wants it, special
    tokens parsed), from a vocabulary-only load that allocates no weights."""
    from llama_cpp import _internals

    from ..models import resolve_model

    lc = backend.llama_cpp()
    path = resolve_model(model)
    params = lc.llama_model_default_params()
    params.vocab_only = True
    with backend.capture_log():
        try:
            m = _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
        except ValueError:
            raise CtxqError(f"llama.cpp cannot read the vocabulary of {path}; check it with `ctxq inspect`") from None
    try:
        add_bos = True
        if chat:
            text, has_bos = chat_prompt(m, text, system)
            add_bos = not has_bos
        return m.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
    finally:
        m.close()


def check_context(n_prompt: int, n_predict: int, n_ctx: int) -> None:
    if n_prompt == 0:
        raise CtxqError("the input is empty; give the text to read (prompt=TEXT)", option="prompt")
    if n_prompt + n_predict > n_ctx:
        raise ContextTooLong(n_prompt, n_predict, n_ctx)


# --- prefill and generation ---------------------------------------------------------------------

def generate(llm, tokens: list[int], *, n_predict: int = 256, temp: float = 0.8, top_k: int = 40,
             top_p: float = 0.95, min_p: float = 0.05,
             on_progress: Callable[[Progress], None] | None = None,
             on_text: Callable[[str], None] | None = None) -> dict:
    """Evaluate `tokens` in n_batch chunks (reporting progress), then sample up to `n_predict` tokens.
    temp 0 is greedy. Returns texts and timings (seconds)."""
    lc = backend.llama_cpp()
    total = len(tokens)
    llm.reset()
    t0 = time.perf_counter()
    if on_progress:
        on_progress(Progress(0, total, 0.0))
    for i in range(0, total, llm.n_batch):  # Llama.eval would cut the same n_batch chunks itself
        llm.eval(tokens[i:i + llm.n_batch])
        if on_progress:
            on_progress(Progress(min(i + llm.n_batch, total), total, time.perf_counter() - t0))
    t1 = time.perf_counter()
    out: list[int] = []
    parts: list[str] = []
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
    t_first = t_last = t1
    stop = "length"
    vocab = llm._model.vocab
    if n_predict > 0:
        # The whole prompt is cached, so generate() samples from the prefill's logits at once.
        for tok in llm.generate(tokens, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=1.0):
            t_last = time.perf_counter()
            if not out:
                t_first = t_last
            if lc.llama_vocab_is_eog(vocab, tok):
                stop = "eos"
                break
            out.append(tok)
            piece = dec.decode(llm.detokenize([tok]))
            if piece:
                parts.append(piece)
                if on_text:
                    on_text(piece)
            if len(out) >= n_predict:
                break
    tail = dec.decode(b"", final=True)
    if tail:
        parts.append(tail)
        if on_text:
            on_text(tail)
    return {"tokens": out, "text": "".join(parts), "prefill_s": t1 - t0, "ttft_s": t_first - t0,
            "decode_s": t_last - t_first, "stop": stop}


def run(model=None, prompt: str | None = None, *, tokens: list[int] | None = None, n_ctx: int = DEFAULT_CTX,
        chat: bool = False, system: str | None = None, n_predict: int = 256, temp: float = 0.8,
        seed: int | None = None, n_threads: int | None = None, plan: Plan | None = None, rpc=None,
        on_plan: Callable[[Plan, int], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None, on_text: Callable[[str], None] | None = None,
        **plan_options) -> RunResult:
    """Tokenize and check the input, plan, load, prefill and generate; the result holds the text,
    timings and per-device memory. `plan_options` go to `make_plan` (split, gpus, profile, kv, ...).
    `on_plan(plan, n_prompt)` is called before the model loads."""
    from ..models import resolve_model

    path = resolve_model(model if plan is None else plan.model)
    if tokens is None:
        if prompt is None:
            raise CtxqError("give the text to read (prompt=TEXT)", option="prompt")
        tokens = tokenize(path, prompt, chat=chat, system=system)
    n_ctx = plan.n_ctx if plan is not None else n_ctx
    check_context(len(tokens), n_predict, n_ctx)
    if plan is None:
        plan = make_plan(path, n_ctx, rpc=rpc, **plan_options)
    if on_plan:
        on_plan(plan, len(tokens))
    llm, memory, load_s = load_plan(plan, rpc=rpc, n_threads=n_threads, seed=seed)
    try:
        g = generate(llm, tokens, n_predict=n_predict, temp=temp, on_progress=on_progress, on_text=on_text)
    finally:
        llm.close()
    return RunResult(text=g["text"], tokens=g["tokens"], n_prompt=len(tokens), load_s=load_s,
                     prefill_s=g["prefill_s"], decode_s=g["decode_s"], ttft_s=g["ttft_s"], stop=g["stop"],
                     plan=plan, memory=memory)
