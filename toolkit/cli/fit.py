"""`ctxq convert MODEL fit`: the per-tensor mix under a size, or the largest that holds a context on the devices."""

from __future__ import annotations

from pathlib import Path

import click

from .common import Bars, echo_json, human


def _source(model: str, revision: str | None, progress) -> Path:
    """The GGUF the mix is made from: the file given, or a Hugging Face model's f16 conversion (cached)."""
    p = Path(model).expanduser()
    if p.is_file():
        return p
    from ..conversion.convert import convert

    return convert(model, "f16", revision=revision, progress=progress).path


def fit_command(model: str, output: str | None, *, target_size: str | None, n_ctx: int | None, method: str,
                as_json: bool, force: bool, check: bool, revision: str | None, gpus: str | None,
                profile: str | None, rpc: str | None) -> None:
    from ..conversion import fit as fitting
    from ..errors import CtxqError

    if bool(target_size) == bool(n_ctx):
        raise CtxqError("convert MODEL fit needs --target-size SIZE (such as 80MiB or 40GB) or --ctx N with the "
                        "devices (--gpus, --profile, --rpc, or the GPUs present), not both")
    target = fitting.parse_size(target_size) if target_size else None
    bars = Bars()
    budget = None
    try:
        src = _source(model, revision, bars)
        if n_ctx:  # the plan's header-only copies carry the source's vocabulary: its full header, read first, is
            from ..gguf.reader import read_gguf  # the one parse every later reading of it is served from

            read_gguf(src)
        table = fitting.table_for(src, method, progress=bars)
        if n_ctx:
            from ..conversion.fit_budget import fit_to_plan

            budget = fit_to_plan(src, table, n_ctx, gpus=gpus, profile=profile, rpc=rpc)
            target, table = budget.mix.size, budget.mix.table  # (the embeddings at their best: host memory)
        result = fitting.fit(src, target, output, table=table, progress=bars, check=check, force=force)
    finally:
        bars.close()
    if budget is not None:
        import ctxq

        result.plan = ctxq.plan(str(result.path), n_ctx, kv=budget.kv, gpus=gpus, profile=profile, rpc=rpc)
    if as_json:
        d = result.to_dict()
        if budget is not None:
            d["budget"] = {"leaves": budget.leaves, "gpu_weights": budget.gpu_weights, "fill": budget.fill,
                           "kv": budget.kv, "reference": budget.reference}
        echo_json(d)
        return
    click.echo(f"{result.path}  fit  {human(result.size)} (target {human(result.target)}) in {result.seconds:.1f} s")
    for line in result.mix.summary():
        click.echo(f"  {line}")
    t = result.mix.table
    click.echo(f"chosen by {t.method}: " + (f"sensitivity measured on {t.measured_on} (KL of each group at "
                                             "Q3_K against Q8_0)" if t.method == "kl" else
                                             "the weights' squared error at each type"))
    if result.quality:
        q = result.quality
        click.echo(f"quality on held-out text ({q['text']}, {q['n_ctx']:,} tokens) vs {q['reference']}: "
                   f"mean KL {q['mean_kl']:.4g}, top-1 {100 * q['top1_agreement']:.1f} %")
    if budget is not None:
        for line in budget.lines():
            click.echo(line)
        p = result.plan
        click.echo(f"plan of {result.path.name} at {n_ctx:,} tokens: KV {p.type_k}/{p.type_v}, "
                   f"{p.cpu_layers} layers on the CPU; see `ctxq plan {result.path} --ctx {n_ctx} --kv {budget.kv}`")
