"""`ctxq convert MODEL fit`: the per-tensor mix under a size, or the mix and the K/V cache pair that hold a context
on the devices with the least predicted loss."""

from __future__ import annotations

from pathlib import Path

import click

from .common import Bars, echo_json, human, table


def _source(model: str, revision: str | None, progress) -> Path:
    """The GGUF the mix is made from: the file given, or a Hugging Face model's f16 conversion (cached)."""
    p = Path(model).expanduser()
    if p.is_file():
        return p
    from ..conversion.convert import convert

    return convert(model, "f16", revision=revision, progress=progress).path


def fit_command(model: str, output: str | None, *, target_size: str | None, n_ctx: int | None, method: str,
                as_json: bool, force: bool, check: bool, revision: str | None, gpus: str | None,
                profile: str | None, rpc: str | None, simulate: str | None = None, kv: str | None = None) -> None:
    from ..conversion import fit as fitting
    from ..errors import CtxqError

    if bool(target_size) == bool(n_ctx):
        raise CtxqError("convert MODEL fit needs --target-size SIZE (such as 80MiB or 40GB) or --ctx N with the "
                        "devices (--gpus, --profile, --rpc, --simulate, or the GPUs present), not both")
    if kv and not n_ctx:
        raise CtxqError("--kv goes with convert MODEL fit --ctx N (the cache the context needs)")
    target = fitting.parse_size(target_size) if target_size else None
    devices = dict(gpus=gpus, profile=profile, rpc=rpc, simulate=simulate)
    bars = Bars()
    joint = None
    try:
        src = _source(model, revision, bars)
        if n_ctx:  # the plan's header-only copies carry the source's vocabulary: its full header, read first, is
            from ..gguf.reader import read_gguf  # the one parse every later reading of it is served from

            read_gguf(src)
            from ..conversion.joint import check_before_measuring

            check_before_measuring(src, n_ctx, kv, **devices)  # a pair the devices cannot run, a context no mix holds
        else:
            fitting.check_target(src, target)  # a target below the smallest mix
        table_ = fitting.table_for(src, method, progress=bars)
        if n_ctx:
            from ..conversion.joint import joint_fit

            joint = joint_fit(src, table_, n_ctx, kv=kv, **devices,
                              progress=lambda label, done, total: bars(done, total, f"measure:anchor {label}"))
            target, table_ = joint.chosen.mix.size, joint.chosen.mix.table  # (the embeddings at their best: host)
        result = fitting.fit(src, target, output, table=table_, progress=bars, check=check, force=force,
                             held_out=joint is None, mix=joint.chosen.mix if joint else None)
        if joint is not None:
            from ..conversion.joint_measure import measure_combined

            result.joint = joint
            c = joint.chosen
            result.quality = measure_combined(result.path, src, c.type_k, c.type_v, n_ctx,
                                              progress=lambda label, done, total: bars(done, total, f"measure:{label}"))
    finally:
        bars.close()
    if joint is not None:
        import ctxq

        result.plan = ctxq.plan(str(result.path), n_ctx, kv=joint.chosen.pair, **devices)
    if as_json:
        echo_json(result.to_dict())
        return
    click.echo(f"{result.path}  fit  {human(result.size)} (target {human(result.target)}) in {result.seconds:.1f} s")
    for line in result.mix.summary():
        click.echo(f"  {line}")
    t = result.mix.table
    click.echo(f"chosen by {t.method}: " + (f"sensitivity measured on {t.measured_on} (KL of each group at "
                                             "Q3_K against Q8_0)" if t.method == "kl" else
                                             "the weights' squared error at each type"))
    if joint is not None:
        _joint_lines(joint, result, n_ctx)
    elif result.quality:
        q = result.quality
        click.echo(f"quality on held-out text ({q['text']}, {q['n_ctx']:,} tokens) vs {q['reference']}: "
                   f"mean KL {q['mean_kl']:.4g}, top-1 {100 * q['top1_agreement']:.1f} %")


def _joint_lines(joint, result, n_ctx: int) -> None:
    c, q, p = joint.chosen, result.quality, result.plan
    kl = result.mix.table.method == "kl"
    how = ("given (--kv)" if joint.fixed else "the least predicted total of the pairs the devices run at speed"
           if kl else "the planner's (see the note)")
    click.echo(f"KV {c.pair} with this mix: {how}; mean KL in nats, KV at {n_ctx:,} tokens:")
    click.echo(table(joint.table(), ["K/V", "KV MiB", "mix MiB", "weights KL", "KV KL", "total", "KV loss from"]))
    if joint.scale is not None:
        click.echo(joint.scale.line())
    click.echo(f"predicted: weights {c.weights_loss:.5f} (table {c.table_loss:.5f}) + KV {c.kv_loss:.5f} = "
               f"{c.total:.5f}" if kl else
               f"predicted: the weights' error {c.weights_loss:.5g} (the {result.mix.table.method} method's unit, "
               f"not KL); KV {c.kv_loss:.5f}")
    click.echo(f"measured: mean KL {q['mean_kl']:.5f}, p99 {q['p99_kl']:.4f}, top-1 {100 * q['top1_agreement']:.1f} % "
               f"(this file with a {c.pair} cache vs {q['reference']}; {q['text']}, {q['n_ctx']:,} tokens)")
    if q.get("reference_why") and q["reference_why"] != "the source":
        click.echo(f"reference: {q['reference']} ({q['reference_why']})")
    for n in joint.notes:
        click.echo(f"note: {n}")
    gpu = sum(d.weights for d in p.gpus)
    click.echo(f"plan of {result.path.name} at {n_ctx:,} tokens: KV {p.type_k}/{p.type_v}, {human(gpu)} of weights "
               f"on the GPUs, {p.cpu_layers} layers on the CPU; see `ctxq plan {result.path} --ctx {n_ctx} "
               f"--kv {c.pair}`")
