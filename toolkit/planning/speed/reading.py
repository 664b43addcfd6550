"""The time to read the context: every plan prints it (`reading`, `reading_lines`), measured by `ctxq bench` where it
was (`store`), else estimated (`model`); `timed` is a placement's estimate for the options' workload, by which
`spill.placement` chooses between keeping weights and whole layers on the host."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..options import PlanOptions
from .choice import names
from .model import DEFAULT_GEN_TOKENS


def workload(opts: PlanOptions) -> tuple[int, int]:
    """(prompt tokens, generated tokens) the options time a plan for: the context, then 128 (llama-bench's tg128, as
    `-sm auto` weighs the modes), unless given."""
    return (opts.n_ctx if opts.prompt_tokens is None else opts.prompt_tokens,
            DEFAULT_GEN_TOKENS if opts.gen_tokens is None else opts.gen_tokens)


@dataclass
class Timed:
    """A placement's estimated seconds for the workload and to read the context (None: cannot be estimated)."""

    total_s: float | None
    prefill_s: float | None
    decode_tps: float | None
    missing: list[str]


def timed(p, info, g, opts: PlanOptions, shape=None) -> Timed:
    """Plan `p`'s estimate for the options' workload (`workload`: the context, then 128 tokens)."""
    from . import model as speed

    shape = shape or speed.model_shape(info, p.type_k, p.type_v, g)
    e = speed.estimate(shape, speed.placement_from_plan(p),
                       speed.Workload(*workload(opts), n_ubatch=p.n_ubatch, n_batch=p.n_batch))
    return Timed(e.total_s, e.prefill_s, e.decode_tps, e.missing)


def draft_cost(p, info, g, depth: int) -> dict[int, float] | None:
    """c(n) for the plan's devices at `depth` (speed.verify_cost), rounded; None where they lack the facts."""
    from . import model as speed

    c = speed.verify_cost(speed.model_shape(info, p.type_k, p.type_v, g), speed.placement_from_plan(p), depth)
    return {n: round(v, 3) for n, v in c.items()} if c else None


def seconds(x: float) -> str:
    """Seconds as a plan prints them: 22,309 s, 36 s, 3.2 s, 0.05 s."""
    return f"{x:,.0f} s" if x >= 10 else f"{x:.1f} s" if x >= 0.1 else f"{x:.2f} s"


def reading(p, info, g, opts: PlanOptions) -> dict:
    """The time to read the workload's prompt (`--prompt-tokens`, else the whole context) and the decode rate after
    it, at that depth: measured where `ctxq bench` measured this plan on these devices (`speed_store`), else estimated
    (planning/speed/model.py); with the other placement's estimate where the plan spills weights or layers
    (`chosen`). Kept as `plan.speed["read"]`; the plan's one decode rate."""
    from . import store as speed_store

    prompt, gen = workload(opts)
    out = {"prompt_tokens": prompt, "gen_tokens": gen}
    m = speed_store.lookup(p) if p.gpus else None
    if m is not None and m.pp > 0 and m.tg > 0:
        out.update(prefill_s=prompt / m.pp, decode_tps=m.tg, measured=True,
                   basis=f"measured by ctxq bench (-p {m.n_prompt} -n {m.n_gen} -d {m.depth}, -ub {m.n_ubatch})")
    else:
        t = timed(p, info, g, opts)
        out.update(prefill_s=t.prefill_s, decode_tps=t.decode_tps, measured=False,
                   basis="estimated from each device's throughput, memory bandwidth and link", missing=t.missing)
        if t.prefill_s is None:  # said once for every card that lacks the facts, not once per card
            cards = [g.device.name for g in p.gpus if g.device.flops is None or g.device.link_bandwidth is None]
            out["missing"] = [f"{names(cards)} {'has' if len(cards) == 1 else 'have'} no compute throughput or link "
                              "(sizes only): name the cards (--gpus 3x16=RTX 4060 Ti,2x8=RTX 4060) or give --profile "
                              "with tflops_f16 and link_gbs"] if cards else t.missing
    cost = draft_cost(p, info, g, prompt)
    if cost:  # what verifying a draft of n tokens costs in decode steps at the prompt's end (runtime/drafts)
        out["draft_cost"] = cost
    other = p.speed.get("offload")
    if other:
        out["other"] = {"placement": other["other"], "prefill_s": other["other_prefill_s"],
                        "total_s": other.get("other_total_s")}
    if not out["measured"] and out.get("prefill_s") is not None and (assumed := _host_assumed(p, opts)):
        out["host_assumed"] = assumed
    return out


def _host_assumed(p, opts: PlanOptions) -> str | None:
    """Where a plan for cards only described (--gpus, --profile, --simulate) computes on the host (whole CPU layers,
    weights in host memory) with this machine's CPU for lack of a profile's `[cpu] tflops`: a line saying so."""
    from ..devices import default_cpu_flops

    described = opts.gpus is not None or opts.profile is not None or opts.simulate is not None
    on_host = p.cpu_layers or p.cpu_ffn_layers or p.cpu_expert_layers
    if not (described and on_host and p.host.device.flops == default_cpu_flops()):
        return None
    return (f"the host's compute is this machine's CPU ({p.host.device.flops / 1e12:.2g} TFLOPS), assumed for the "
            "host you plan for: give --profile with a [cpu] section's tflops (and pageable_gbs) to describe it")


def reading_lines(r: dict) -> list[str]:
    """`reading 65,536 tokens: ~N s, then ~R tokens/s for 128 tokens: ~T s in all (whole layers on the CPU: ~M s,
    ~U s in all)`, marked measured or estimated; where the devices lack the facts, one line saying which."""
    if not r:
        return []
    how = "measured" if r.get("measured") else "estimated"
    if r.get("prefill_s") is None:
        missing = sorted({re.sub(r"^(prefill|decode): ", "", m) for m in r.get("missing", [])})
        line = f"reading {r['prompt_tokens']:,} tokens: not estimated ({'; '.join(missing) or 'device facts missing'})"
        if r.get("decode_tps"):  # decoding reads far more bytes than it does FLOPs: bandwidth alone will do
            line += f"; decoding ~{r['decode_tps']:.1f} tokens/s (memory bandwidth alone), {how}"
        return [line]
    line = f"reading {r['prompt_tokens']:,} tokens: ~{seconds(r['prefill_s'])}"
    gen = r.get("gen_tokens")
    if r.get("decode_tps"):
        line += f", then ~{r['decode_tps']:.1f} tokens/s"
        if gen:
            line += f" for {gen:,} tokens: ~{seconds(r['prefill_s'] + gen / r['decode_tps'])} in all"
    line += f", {how}"
    other = r.get("other")
    if other and other.get("prefill_s"):
        name = "whole layers on the CPU" if other["placement"] == "layers" else "FFN weights in host memory"
        total = f", ~{seconds(other['total_s'])} in all" if gen and other.get("total_s") else ""
        line += f" ({name}: ~{seconds(other['prefill_s'])}{total})"
    return [line] + ([f"note: {r['host_assumed']}"] if r.get("host_assumed") else [])
