"""Execute a plan: `ctxq.load()` returns a ready `llama_cpp.Llama`; `run()` = `prepare()` + `execute()`.

The plan a user sees (`ctxq plan`) is the object loaded here: `Llama(model, **plan.llama_kwargs())`,
with the plan's expert placement (`plan.expert_overrides()`) as llama.cpp tensor buffer overrides
(`ctxq.llama.overrides.create_llama`, the one place that sets them).
`prepare()` tokenizes and checks the input before anything loads, then plans (all a dry run needs);
`execute()` loads the plan, prefills with a progress callback and generates with a text callback,
returning one `RunResult`. The library prints nothing: llama.cpp's log goes to the
`ctxq.llama_cpp` logger and what it allocated is read from that log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from ..errors import CtxqError, DoesNotFit, InvalidOption, ReorderNeeded
from ..gguf.once import one_parse
from ..gguf.reader import read_gguf
from ..gguf.vocab import check_tokenizer
from ..llama import backend, overrides
from ..planning.options import PlanOptions
from ..planning.plan import Plan
from ..units import default_threads
from ..models import model_header, resolve_model
from . import speculative
from .session import restore_session, save_for_run, session_path
from .generate import (DeviceMemory, Progress, RunResult, chat_prompt, check_context, check_n_predict,  # noqa: F401
                       document_text, generate, input_tokens, tokenize)

log = logging.getLogger(__name__)

# The device-order handshake: `ctxq run` restarts itself with CUDA_VISIBLE_DEVICES in the plan's GPU
# order and this variable set to the same value; that process plans for the GPUs as they now are.
ORDER_APPLIED = "CTXQ_DEVICE_ORDER_APPLIED"


def reorder_env(value: str) -> dict[str, str]:
    """The environment that applies a plan's GPU order (`ReorderNeeded.value`) to a new process."""
    return {"CUDA_VISIBLE_DEVICES": value, ORDER_APPLIED: value}


# --- planning and loading ---------------------------------------------------------------------

def check_vocabulary(model) -> None:
    """Refuse, from its header, a model llama.cpp cannot tokenize text with (`ctxq.gguf.vocab`: it would abort
    ctxq's process): `NoTokenizer`. `ctxq.load()`, a run's input and `ctxq serve` ask before llama.cpp does."""
    local = resolve_model(model) if model is None or Path(model).expanduser().is_file() else None
    # a local file's vocabulary is read whole (its first shard holds it); a Hub model's header as the plan read it
    check_tokenizer(read_gguf(local) if local is not None else model_header(model))


def make_plan(model=None, n_ctx: int | None = None, *, options: PlanOptions | None = None, **settings) -> Plan:
    """`planner.plan` for a run: in a process that a reordering restarted, the GPUs are already in
    the plan's order, so the plan keeps them as they are."""
    from ..planning.planner import plan

    opts = (options or PlanOptions()).updated(n_ctx=n_ctx, **settings)
    if opts.reorder is None and os.environ.get(ORDER_APPLIED) is not None:
        opts = replace(opts, reorder=False)
    return plan(model, options=opts)


@contextlib.contextmanager
def local_workers(options: PlanOptions) -> Iterator[PlanOptions]:
    """`options` with `simulate` replaced by local RPC workers of those sizes (`rpc`), for the block."""
    if options.simulate is None:
        yield options
        return
    options.resolved()  # refuses a simulate given with other devices before anything starts
    from ..rpc import start_workers

    with start_workers(options.simulate) as workers:
        yield replace(options, simulate=None, rpc=workers.rpc)


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
    """Refuse to run a plan for devices llama.cpp does not have (a what-if plan from `gpus`)."""
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
    if order and getattr(p, "left_out", None):  # tensor mode over some of the cards: llama.cpp gets only those
        n_rpc = len(eps)  # the given devices: RPC workers first (planning/devices.py)
        eps = [eps[i] for i in order if i < n_rpc]
        order = [i - n_rpc for i in order if i >= n_rpc]
        if eps:
            add_servers(eps)
        local = [d for d in backend.ggml_devices() if d.type not in ("cpu", "accel") and not d.name.startswith("RPC")]
        if os.environ.get(ORDER_APPLIED) is None and order != list(range(len(local))):
            if not order:
                raise CtxqError("the plan leaves this process's GPUs out of tensor mode; set CUDA_VISIBLE_DEVICES= "
                                "(none) before starting Python")
            value = cuda_visible_devices(order, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if os.environ.get(ORDER_APPLIED) != value:
                raise ReorderNeeded(value)
        return
    if order and eps:
        if sorted(order[:len(eps)]) != list(range(len(eps))):
            raise CtxqError("the plan mixes the order of RPC workers and local GPUs, which llama.cpp cannot do "
                            "(RPC devices always come first); plan with reorder=False")
        eps = [eps[i] for i in order[:len(eps)]]  # RPC devices take llama.cpp's order from registration
        order = [i - len(eps) for i in order[len(eps):]] or None
    if eps:
        add_servers(eps)
    if order and order != sorted(order):
        value = cuda_visible_devices(order, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if os.environ.get(ORDER_APPLIED) != value:
            raise ReorderNeeded(value)


def prepare_devices(p: Plan, rpc=None) -> None:
    """Before loading: register RPC workers in the plan's order, check GPU order and presence."""
    _apply_order(p, rpc)
    _check_devices(p)


def _refuse_replanning(p: Plan, llama_kwargs: dict) -> None:
    """Memory was sized for the plan's values: a keyword that would change one after the fact is refused."""
    planned = p.llama_kwargs()
    for key, value in llama_kwargs.items():
        if key not in planned:
            continue
        if key in PlanOptions.names():
            raise InvalidOption(f"{key} is set by the plan ({getattr(p, key)!r}, memory was sized for it); "
                                f"plan with {key}={value!r} instead", option=key, value=value)
        raise InvalidOption(f"`{key}` is set by the plan (memory was sized for it); change the plan's "
                            "settings instead", option=key, value=value)


def load_plan(p: Plan, *, rpc=None, n_threads: int | None = None, seed: int | None = None, **llama_kwargs):
    """`(Llama, memory, seconds)` for a plan: load it as planned and compare memory with llama.cpp's log.
    `llama_kwargs` go to `Llama` (e.g. embedding=True); the planned ones (n_ctx, type_k, ...) are refused.
    Experts the plan keeps in CPU memory are put there by tensor overrides (`llm.ctxq_overrides`)."""
    _refuse_replanning(p, llama_kwargs)
    prepare_devices(p, rpc)
    kw = llama_params(p, n_threads=n_threads, seed=seed)
    kw.update(llama_kwargs)
    t0 = time.perf_counter()
    with backend.capture_log() as lines:
        try:
            # a Hub model downloads here, once
            llm = overrides.create_llama(str(resolve_model(p.model)), kw, p.tensor_overrides())
        except ValueError as e:  # llama-cpp-python's words for a failed model or context
            tail = _load_failure(lines)
            raise CtxqError(f"llama.cpp could not load {Path(p.model).name} as planned ({e}"
                            f"{': ' + tail if tail else ''}); its log is on the ctxq.llama_cpp logger") from None
    load_s = time.perf_counter() - t0
    if llm.n_ctx() < p.n_ctx:  # llama.cpp must never hold less than the plan promised
        llm.close()
        raise CtxqError(f"llama.cpp made a context of {llm.n_ctx()} tokens, not the {p.n_ctx} planned")
    llm.ctxq_allocations = alloc = backend.parse_allocations(lines)
    return llm, memory_report(p, alloc), load_s


def engine_memory(p: Plan, llm, engine) -> list[DeviceMemory]:
    """Planned against reported bytes for an engine on `llm` (load_plan's): the model's buffers from the load,
    the context's (KV, state, compute, output) from the engine's own context, which replaced the Llama's."""
    from dataclasses import replace as with_

    a = engine.allocations
    return memory_report(p, with_(llm.ctxq_allocations, kv=a.kv, state=a.state, compute=a.compute, output=a.output))


def _load_failure(lines: list[str]) -> str | None:
    """llama.cpp's own reason for a failed load (llama_model_load: "error loading model: check_tensor_dims:
    tensor 'blk.2.ffn_up_exps.weight' not found"), else the last line it logged."""
    marker = "error loading model: "
    why = [l.split(marker, 1)[1].strip() for l in lines if marker in l] or [l.strip() for l in lines if l.strip()]
    return why[-1] if why else None


def memory_report(p: Plan, alloc: backend.Allocations) -> list[DeviceMemory]:
    """Planned against reported bytes per device. Host buffers ("CPU", "CPU_Mapped", "CPU_REPACK",
    "CUDA_Host" pinned memory) count for the host; a device buffer matches by name, else by position.
    With experts in host memory the host's row says how much of its figure is llama.cpp's mapped range
    (`DeviceMemory.mapped`), which counts more than the host's tensors."""
    names = sorted({n for d in (alloc.model, alloc.kv, alloc.compute, alloc.output) for n in d})
    host_names = [n for n in names if n.startswith("CPU") or n.endswith("_Host")]
    dev_names = [n for n in names if n not in host_names]
    out = []
    if getattr(p, "split_mode", "layer") == "tensor" and p.gpus:
        # llama.cpp logs one Meta() device whose buffers are each the largest card's (ggml-backend-meta.cpp):
        # compared with the largest card's planned buffers, term by term
        planned = sum(max(getattr(dp, t) for dp in p.gpus) for t in ("weights", "kv", "state", "compute", "cuda_copies"))
        out.append(DeviceMemory("+".join(dp.device.name for dp in p.gpus) + " (largest card)", planned,
                                sum(alloc.total(n) for n in dev_names)))
    for i, dp in enumerate(p.gpus if not out else []):
        # RPC buffers are named "RPC<device on that worker>[host:port]": match the endpoint first
        by_ep = [n for n in dev_names if dp.device.endpoint and n.endswith(f"[{dp.device.endpoint}]")]
        name = by_ep[0] if by_ep else dp.device.name if dp.device.name in dev_names else (
            dev_names[i] if i < len(dev_names) else None)
        out.append(DeviceMemory(dp.device.name, dp.buffers, alloc.total(name) if name else 0))
    # experts in host memory between layers on devices: the mapped range spans those layers' tensors
    spans = bool(p.cpu_expert_layers or p.cpu_ffn_layers or p.override_tensor) and any(dp.layers for dp in p.gpus)
    out.append(DeviceMemory(p.host.device.name, p.host.buffers, sum(alloc.total(n) for n in host_names),
                            mapped=alloc.model.get("CPU_Mapped", 0) if spans else 0,
                            tensors=p.host.weights if spans else 0))
    return out


@one_parse  # the model's header parsed once in the call
def load(model=None, n_ctx: int | None = None, split=None, gpus=None, *, plan: Plan | None = None,
         options: PlanOptions | None = None, n_threads: int | None = None, seed: int | None = None,
         session=None, spec: str | None = None, **kwargs):
    """A ready `llama_cpp.Llama` for `model` (default: the embedded SmolLM2) holding `n_ctx` tokens,
    configured from the plan for the devices present (or `gpus`/`profile`/`rpc`).

    Keywords that are `PlanOptions` fields (kv, type_k, flash_attn, n_batch, profile, rpc, ...) make
    the plan; the rest go to `Llama` unchanged. The plan is `llm.ctxq_plan`, planned-vs-reported
    memory `llm.ctxq_memory`. Raises `DoesNotFit` when the context fits nowhere. A plan that
    reorders the GPUs needs CUDA_VISIBLE_DEVICES set before CUDA starts; in a process where it has
    started, load() falls back to the best plan for the present order (and says so in the log).
    `session`: a file `ctxq.runtime.session.save_session` wrote; its state is restored when it
    matches (`llm.ctxq_session` tokens), so a prompt that starts with its tokens evaluates only the rest.
    `spec`: drafts from the context verified in one batch, "ngram", "off" or "auto" (None; `runtime.speculative`);
    `llm.ctxq_spec` says what it does.
    """
    opts = PlanOptions.take(kwargs, options).updated(n_ctx=n_ctx, split=split, gpus=gpus)
    if opts.parallel is not None or (plan is not None and plan.parallel):  # Llama makes a one-sequence context
        raise InvalidOption("a Llama decodes one sequence; `parallel` plans ctxq's engine: use ctxq.ask(document, "
                            "questions, parallel=P) or `ctxq serve --parallel P`", option="parallel",
                            value=opts.parallel or plan.n_seq_max)
    if opts.simulate is not None:
        raise InvalidOption("`simulate` starts workers for one run; start them with ctxq.rpc.start_workers() "
                            "and pass rpc=workers.rpc", option="simulate", value=opts.simulate)
    given = plan is not None
    if plan is None:
        plan = make_plan(model, options=opts)
    check_vocabulary(plan.model)  # the Llama tokenizes whatever it is asked: refused before it loads
    try:
        llm, memory, _ = load_plan(plan, rpc=opts.rpc, n_threads=n_threads, seed=seed, **kwargs)
    except ReorderNeeded as e:
        # CUDA is initialised in this process (planning asked it for its devices), so the better order
        # cannot be applied here; the plan for llama.cpp's own order is next best, if it fits.
        if given:
            raise
        try:
            plan = make_plan(model, options=replace(opts, reorder=False))
        except DoesNotFit:
            raise e from None
        log.warning("%s; using the plan for the present order instead", e)
        llm, memory, _ = load_plan(plan, rpc=opts.rpc, n_threads=n_threads, seed=seed, **kwargs)
    llm.ctxq_plan, llm.ctxq_memory = plan, memory
    llm.ctxq_session = restore_session(llm, session, plan) if session is not None else 0
    speculative.for_plan(llm, plan, spec)
    return llm


# --- a run: prepare, then execute ---------------------------------------------------------------

@dataclass
class Prepared:
    """What `execute()` runs: the plan and the input's tokens, checked against its context.
    `tokens` is None when no input was given (a dry run of the plan alone)."""

    plan: Plan
    tokens: list[int] | None
    n_predict: int
    rpc: object = None  # the RPC workers the plan uses, registered at load
    keep: int | None = None  # the tokens up to the document's end: evaluated first, and saved by `session`
    session: str | Path | None = None  # a session file, or "auto" (ctxq's session cache)


def prepare(model=None, prompt: str | list[dict] | None = None, *, document: str | None = None,
            tokens: list[int] | None = None, chat: bool = False, system: str | None = None, n_predict: int = 256,
            session=None, plan: Plan | None = None, options: PlanOptions | None = None, **settings) -> Prepared:
    """Plan (or take `plan`), then tokenize the input (`document`, then `prompt` after a blank line; or
    take `tokens`) and check it fits with `n_predict` more: nothing loads. `settings` are `PlanOptions`
    fields (n_ctx, kv, gpus, ...). `session`: a file (or "auto") that holds, or will hold, the state
    of the input up to the end of the document (`generate.input_tokens`). `document` may be a
    `ctxq.textfile.TextFile`: it is read only as far as the plan's context can use."""
    check_n_predict(n_predict)
    opts = (options or PlanOptions()).updated(**settings)
    if plan is None:  # a Hub model is planned from its headers: one that does not fit is never downloaded
        plan = make_plan(model, options=opts)
    keep = None
    if prompt is not None or document is not None or (tokens is not None and n_predict > 0):
        # before llama.cpp tokenizes the input or detokenizes the answer; token ids evaluated without generating
        # (a model without text: scripts/gpu_runs.py's workers stage) need neither
        check_vocabulary(plan.model)
    document = document_text(document, plan.model, plan.n_ctx)
    if tokens is None and (prompt is not None or document is not None):
        # the vocabulary needs the file: a Hub model is downloaded here, after its plan
        tokens, keep = input_tokens(resolve_model(plan.model), prompt, document=document, chat=chat, system=system)
    if tokens is not None:
        check_context(len(tokens), n_predict, plan.n_ctx)
    if tokens is not None and (session is not None or document is not None):
        # The document is evaluated first whether or not a session is saved, so runs with and without
        # one evaluate the same batches; the last token is always evaluated (its logits start the answer).
        keep = min(len(tokens) if keep is None else keep, len(tokens) - 1)
    else:
        keep = None
    return Prepared(plan, tokens, n_predict, opts.rpc, keep, session)


def execute(prepared: Prepared, *, temp: float = 0.8, seed: int | None = None, n_threads: int | None = None,
            spec: str | None = None, on_loaded: Callable[[Plan, float], None] | None = None,
            on_progress: Callable[[Progress], None] | None = None,
            on_text: Callable[[str], None] | None = None) -> RunResult:
    """Load the prepared plan, prefill (reporting `on_progress`) and generate (streaming `on_text`).
    `on_loaded(plan, seconds)` is called once the model has loaded. `spec`: as `load`'s."""
    speculative.check_mode(spec)
    if prepared.tokens is None:
        raise CtxqError("give the text to read (prompt=TEXT)", option="prompt")
    p, tokens, keep = prepared.plan, prepared.tokens, prepared.keep
    llm, memory, load_s = load_plan(p, rpc=prepared.rpc, n_threads=n_threads, seed=seed)
    try:
        speculative.for_plan(llm, p, spec)
        if on_loaded:
            on_loaded(p, load_s)
        t0 = time.perf_counter()
        n_cached = 0
        if prepared.session is not None:
            n_cached = restore_session(llm, session_path(prepared.session, p, tokens[:keep]), p, tokens)
        restore_s = time.perf_counter() - t0
        r = generate(llm, tokens, n_predict=prepared.n_predict, temp=temp, n_cached=n_cached, keep=keep,
                     on_keep=None if prepared.session is None else
                     lambda head: save_for_run(llm, prepared.session, head, p),
                     on_progress=on_progress, on_text=on_text)
    finally:
        llm.close()
    # time to first token counts the restore: it replaces (part of) the prefill
    return replace(r, load_s=load_s, plan=p, memory=memory, ttft_s=r.ttft_s + restore_s)


def run(model=None, prompt: str | list[dict] | None = None, *, document: str | None = None,
        tokens: list[int] | None = None, chat: bool = False, system: str | None = None, n_predict: int = 256,
        temp: float = 0.8, seed: int | None = None, n_threads: int | None = None, session=None,
        spec: str | None = None, plan: Plan | None = None, options: PlanOptions | None = None,
        on_plan: Callable[[Plan, int], None] | None = None, on_progress: Callable[[Progress], None] | None = None,
        on_text: Callable[[str], None] | None = None, **settings) -> RunResult:
    """Tokenize and check the input, plan, load, prefill and generate; the result holds the text,
    timings and per-device memory. `settings` are `PlanOptions` fields (n_ctx, split, gpus, kv, ...);
    `simulate` runs on local RPC workers for the call. `on_plan(plan, n_prompt)` is called before
    the model loads. `document` comes first, `prompt` after it; `session` (a file or "auto") saves the
    state up to the document's end, and a later run with the same document restores it instead of
    evaluating it again. `spec`: as `load`'s."""
    if tokens is None and prompt is None and document is None:
        raise CtxqError("give the text to read (prompt=TEXT)", option="prompt")
    with local_workers((options or PlanOptions()).updated(**settings)) as opts:
        prepared = prepare(model, prompt, document=document, tokens=tokens, chat=chat, system=system,
                           n_predict=n_predict, session=session, plan=plan, options=opts)
        if on_plan:
            on_plan(prepared.plan, len(prepared.tokens))
        return execute(prepared, temp=temp, seed=seed, n_threads=n_threads, spec=spec, on_progress=on_progress,
                       on_text=on_text)
