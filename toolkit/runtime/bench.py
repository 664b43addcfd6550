"""`ctxq bench`: each split mode's plan measured on the devices present, as llama-bench measures (issue 44).

For each candidate (layer mode, tensor mode: the plans `ctxq plan -sm layer|tensor` makes for these options) a child
process loads the plan (llama.cpp aborts instead of returning errors: never in ctxq's own process) and, `-r` times
after one warm-up, fills `-d` tokens of cache untimed, then times a prompt of `-p` random tokens (prompt processing,
pp) and, at the same depth, `-n` tokens decoded one at a time (token generation, tg): tokens/s, mean ± sd over the
repetitions, llama-bench's figures. Each result is kept (`planning.speed.store`) per model file, device set and
llama.cpp version, and `ctxq plan --split-mode auto` then chooses the mode by these measurements.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from typing import Callable

from ..errors import CtxqError, InvalidOption
from ..planning.speed import store as speed_store
from ..planning.options import DEFAULT_N_UBATCH, PlanOptions
from ..planning.speed.store import Measured
from .runner import load_plan, local_workers, make_plan

MODES = ("layer", "tensor")


def _tokens(n: int, n_vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(n_vocab) for _ in range(n)]


def measure_plan(plan, rpc, n_prompt: int, n_gen: int, depth: int, reps: int, n_threads: int | None) -> dict:
    """In a child process: load the plan, time pp and tg as llama-bench does; tokens/s per repetition."""
    from ..rpc.supervise import report

    llm, _, _ = load_plan(plan, rpc=rpc, n_threads=n_threads)
    try:
        n_vocab = llm.n_vocab()
        pp, tg = [], []
        for r in range(reps + 1):  # the first is a warm-up, as llama-bench's
            head = _tokens(depth, n_vocab, 1000 + r)
            llm.reset()
            if head:
                llm.eval(head)
            prompt = _tokens(n_prompt, n_vocab, r)
            t0 = time.perf_counter()
            if prompt:
                llm.eval(prompt)
            t_pp = time.perf_counter() - t0
            llm.reset()
            if head:
                llm.eval(head)
            gen = _tokens(n_gen, n_vocab, 2000 + r)
            t0 = time.perf_counter()
            for tok in gen:
                llm.eval([tok])
            t_tg = time.perf_counter() - t0
            if r:
                pp.append(n_prompt / t_pp if n_prompt and t_pp > 0 else 0.0)
                tg.append(n_gen / t_tg if n_gen and t_tg > 0 else 0.0)
            report({"rep": r, "of": reps})
        return {"pp": pp, "tg": tg}
    finally:
        llm.close()


SPEC_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # batch sizes a draft's verification takes (speculative.MAX_DRAFT + 1 at most)


def spec_cost(llm, depth: int, reps: int, sizes: tuple[int, ...] = SPEC_SIZES) -> dict[int, float]:
    """The time of one llama_decode of n tokens with logits at each (a draft's verification) against one token, at
    `depth` tokens of cache: the fastest of `reps` rounds (on a shared machine the minimum is the time the work
    takes, the rest is waiting), each round timing every size once in turn."""
    n_vocab = llm.n_vocab()
    llm.reset()
    if depth:
        llm.eval(_tokens(depth, n_vocab, 1000))
    base = llm.n_tokens
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(reps + 1):  # the first round warms up
        for n in sizes:
            llm._ctx.kv_cache_seq_rm(-1, base, -1)
            llm._batch.set_batch(batch=_tokens(n, n_vocab, 3000 + r), n_past=base, logits_all=True)
            t0 = time.perf_counter()
            llm._ctx.decode(llm._batch)
            if r:
                times[n].append(time.perf_counter() - t0)
    one = min(times[sizes[0]]) / sizes[0]
    # a batch never costs less than one token: a ratio below 1 is a slow moment of the single-token rounds
    return {n: max(min(times[n]) / one, 1.0) for n in sizes}


def measure_spec(plan, rpc, depth: int, reps: int, n_threads: int | None) -> dict:
    """In a child process: `spec_cost` of the plan."""
    llm, _, _ = load_plan(plan, rpc=rpc, n_threads=n_threads)
    try:
        return {str(n): c for n, c in spec_cost(llm, depth, reps).items()}
    finally:
        llm.close()


def bench_spec(model, options: PlanOptions, *, depth: int = 0, reps: int = 3, n_threads: int | None = None,
               timeout: float = 1800) -> tuple[object, dict[int, float]]:
    """`ctxq bench --spec`: the plan's cost of a draft's batch against one token (`spec_cost`, in a child process),
    kept (`speed_store.save_spec_cost`) for `--spec auto` on these devices: (plan, {n: cost})."""
    from ..rpc.supervise import run_supervised

    if reps < 1 or depth < 0:
        raise InvalidOption("`reps` must be 1 or more and `depth` 0 or more", option="reps", value=reps)
    with local_workers(options) as opts:
        p = make_plan(model, options=opts)
        if depth + max(SPEC_SIZES) > p.n_ctx:
            raise InvalidOption(f"`depth` {depth} + {max(SPEC_SIZES)} tokens is beyond the context ({p.n_ctx})",
                                option="n_ctx", value=p.n_ctx)
        got = run_supervised(measure_spec, p, opts.rpc, depth, reps, n_threads, rpc=opts.rpc, timeout=timeout)
    cost = {int(n): c for n, c in got.items()}
    speed_store.save_spec_cost(p, cost, depth)
    return p, cost


def candidates(model, options: PlanOptions, modes: tuple[str, ...],
               ubatches: tuple[int | None, ...] = (None,)) -> list[tuple[str, object]]:
    """(mode, plan) for each mode, each tensor-mode candidate (every card and each subset the planner considers:
    planning/tensor/candidates.py) and each micro-batch (None: the options' own) that can be planned here, modes
    first; one that cannot gives (mode, its one-line reason). A micro-batch sizes the compute buffers: a larger one
    may not fit where a smaller one does."""
    out = []
    for mode in modes:
        sets = _card_sets(options) if mode == "tensor" else []
        for keep, why in sets if len(sets) > 1 else [(None, None)]:
            for ub in ubatches:
                # a micro-batch always given: the planner would otherwise take the one measured fastest (ubatch.py)
                opts = replace(options, split_mode=mode, n_ubatch=ub or options.n_ubatch or DEFAULT_N_UBATCH,
                               tensor_cards=tuple(keep) if keep is not None else None)
                try:
                    p = make_plan(model, options=opts)
                    out.append((mode, p))
                except CtxqError as e:
                    where = f"cards {','.join(map(str, keep))}: " if keep is not None else ""
                    out.append((mode, f"{where}-ub {ub}: {e}" if ub is not None else f"{where}{e}"))
                    continue
                if mode == "layer" and options.offload is None and (p.cpu_ffn_layers or p.cpu_layers):
                    out += _other_placement(model, opts, p)
    return out


def _other_placement(model, opts: PlanOptions, p) -> list[tuple[str, object]]:
    """Where the plan keeps FFN weights or whole layers on the host, the other placement too (planning/spill/placement.py), so
    that `ctxq plan --offload auto` takes the measured faster; nothing where it cannot be planned."""
    try:
        q = make_plan(model, options=replace(opts, offload="layers" if p.cpu_ffn_layers else "weights"))
    except CtxqError:
        return []
    return [("layer", q)] if q.cpu_ffn_layers != p.cpu_ffn_layers or q.cpu_layers != p.cpu_layers else []


def _card_sets(options: PlanOptions) -> list:
    from ..planning.devices import resolve_devices
    from ..planning.tensor.candidates import card_sets

    try:
        devices, _ = resolve_devices(options.updated(split_mode="tensor").resolved())
    except CtxqError:  # the plan itself says why, once
        return []
    return card_sets(devices)


def bench(model, options: PlanOptions, *, modes: tuple[str, ...] = MODES, n_prompt: int = 512, n_gen: int = 32,
          depth: int = 0, reps: int = 3, n_threads: int | None = None, timeout: float = 1800,
          ubatches: tuple[int | None, ...] = (None,),
          on_progress: Callable[[str], None] | None = None) -> list[tuple[str, object, Measured | str]]:
    """Measure each mode's plan, at each micro-batch of `ubatches` (None: the options' own): [(mode, plan or None,
    Measured or the reason it was not measured)]."""
    from ..rpc.supervise import run_supervised

    for name, v in (("n_prompt", n_prompt), ("n_gen", n_gen), ("depth", depth)):
        if v < 0:
            raise InvalidOption(f"`{name}` must be 0 or more tokens, got {v}", option=name, value=v)
    if reps < 1:
        raise InvalidOption(f"`reps` must be 1 or more, got {reps}", option="reps", value=reps)
    if n_prompt == 0 and n_gen == 0:
        raise InvalidOption("nothing to measure: give n_prompt or n_gen above 0", option="n_prompt", value=0)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise InvalidOption(f"split mode {bad[0]!r}: choose layer or tensor", option="split_mode", value=bad[0])
    if any(ub is not None and ub < 1 for ub in ubatches):
        raise InvalidOption(f"micro-batches {ubatches}: give sizes of 1 token or more", option="n_ubatch", value=ubatches)
    results = []
    with local_workers(options) as opts:
        for mode, p in candidates(model, opts, modes, ubatches):
            if isinstance(p, str):
                results.append((mode, None, p))
                continue
            need = depth + max(n_prompt, 1)
            if need > p.n_ctx or depth + n_gen > p.n_ctx:
                raise InvalidOption(f"`depth` {depth} + {max(n_prompt, n_gen)} tokens is beyond the context "
                                    f"({p.n_ctx}); give a larger n_ctx or fewer tokens", option="n_ctx", value=p.n_ctx)
            if on_progress:
                on_progress(f"measuring {mode} mode ({p.llama_flags()})")
            got = run_supervised(measure_plan, p, opts.rpc, n_prompt, n_gen, depth, reps, n_threads, rpc=opts.rpc,
                                 timeout=timeout)
            m = Measured(mode, list(p.tensor_split), n_prompt, n_gen, depth, got["pp"], got["tg"],
                         [g.device.name for g in p.gpus], speed_store._llama_version(), p.n_ubatch,
                         speed_store.family(p) or "")
            speed_store.save(p, m)
            results.append((mode, p, m))
    return results


def mean_sd(values: list[float]) -> str:
    """llama-bench's "t/s": mean ± standard deviation."""
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {sd:.2f}"
