"""`ctxq quality`: what each KV-cache pair (or a weight type) costs the answers, measured on your text."""

from __future__ import annotations

from pathlib import Path

import click

from .. import interrupts
from .common import Bars, echo_json, table
from .group import cli


class _Bars:
    """One tqdm bar per configuration measured, with its time left."""

    def __init__(self):
        self.bar, self.label = None, None

    def __call__(self, label: str, done: int, total: int) -> None:
        from tqdm import tqdm

        with interrupts.held():  # a stop signal waits for the bar to be whole (cli/common.py, Bars)
            if label != self.label:
                self.close()
                self.label = label
                self.bar = tqdm(total=total, desc=label, unit=" tok", leave=False, dynamic_ncols=True)
            self.bar.update(done - self.bar.n)

    close = Bars.close  # the same bar, closed under the same stop-signal guard


def render(results, mode: str, base: int) -> str:
    """The table `ctxq quality` prints; `base`: the reference's bytes (an f16 cache per token, or the more precise
    file), which the bytes column is a share of."""
    rows = []
    for r in results:
        what = r.pair if mode == "kv" else f"{Path(r.model).name} {r.pair}"
        size = f"{r.bytes / 1024:.1f} KiB" if mode == "kv" else f"{r.bytes / 2**20:.1f} MiB"
        rows.append([what, size, f"{r.bytes / base * 100:.0f}%", f"{r.mean_kl:.5f}", f"{r.p99_kl:.4f}",
                     f"{r.top1_agreement * 100:.1f}%", f"{r.ppl:.3f}", "cached" if r.cached else f"{r.seconds:.0f} s"])
    head = ["KV K/V" if mode == "kv" else "weights", "per token" if mode == "kv" else "file",
            "of f16" if mode == "kv" else "of ref.", "mean KL",
            "p99 KL", "top-1", "PPL", "time"]
    r0 = results[0]
    return "\n".join([
        table(rows, head),
        f"text: {r0.text}{' (built in)' if r0.text == 'licences' else ''}, {r0.n_ctx:,} tokens, positions "
        f"{r0.n_ctx // 2:,}-{r0.n_ctx - 2:,} scored ({r0.n_scored:,}) against {r0.reference}; KL in nats, "
        "KL(reference || this); top-1: the same most likely token"
        + ("" if mode != "whole" else "; each row: the file's weights with that cache pair")])


@cli.command("quality")
@click.argument("model", required=False)
@click.option("-c", "--ctx", "n_ctx", type=int, required=True, help="The context to measure at, in tokens.")
@click.option("-f", "--file", "text", type=click.Path(dir_okay=False), default=None,
              help="The text to measure on, at least --ctx tokens (default: a built-in English text).")
@click.option("--kv", default=None, metavar="PAIRS",
              help="KV pairs to measure against an f16 cache: f16,q8_0,q8_0/q4_0,... (K/V; a type alone for both), "
                   "or all: every pair the devices run at speed.  [default: those the plan could choose: the pairs "
                   "no other pair beats in both loss and bytes]")
@click.option("--against", default=None, metavar="REF",
              help="Measure MODEL's weights against REF, a more precise GGUF of the same model (same cache types).")
@click.option("--whole", is_flag=True,
              help="With --against: MODEL at each --kv pair against REF with an f16 cache (weights and cache "
                   "together, as `ctxq plan` states the whole plan's loss).")
@click.option("--rpc", default=None, metavar="HOST:PORT[=GiB],…",
              help="ggml RPC workers to run on besides the devices present (described GPUs cannot run a measurement).")
@click.option("--no-cache", is_flag=True, help="Measure again even when a result is cached.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def quality_cmd(model, n_ctx, text, kv, against, whole, rpc, no_cache, as_json):
    """Measure what precision costs on MODEL (a GGUF; default: the embedded SmolLM2).

    Every configuration reads the same --ctx tokens of the text once, as the plan for the devices runs it
    (what does not fit goes to the CPU); the second half of the positions is scored against the reference:
    mean and 99th-percentile KL divergence, top-1 agreement and perplexity. `ctxq plan` then chooses the KV
    pair with the least measured loss that fits (and --max-kl holds it).
    """
    from ..errors import InvalidOption
    from ..quality import Measurement, measure, parse_pairs

    if whole and not against:
        raise InvalidOption("--whole measures against a more precise file: give it with --against REF",
                            option="whole", value=True)
    options = {"rpc": rpc} if rpc else {}
    pairs = None if kv in (None, "all") else parse_pairs(kv)
    if pairs is None and (not against or whole):
        pairs = _default_pairs(model, options, n_ctx, every=kv == "all")
    bars = None if as_json else _Bars()
    m = Measurement(n_ctx=n_ctx, text=text, plan_options=options, progress=bars, use_cache=not no_cache)
    if against is not None and Path(against).is_dir():  # a Hugging Face folder: its f16 GGUF (cached by convert)
        from ..conversion.convert import convert

        against = convert(against, "f16").path
    try:
        results = measure(model, m, pairs, against=against, whole=whole)
    finally:
        if bars:
            bars.close()
    mode = ("whole" if whole else "weights") if against else "kv"
    if as_json:
        echo_json({"model": results[0].model, "n_ctx": n_ctx, "text": results[0].text, "mode": mode,
                   "reference": results[0].reference, "results": [r.public() for r in results]})
    else:
        click.echo(render(results, mode, _reference_bytes(results[0].model, mode, against)))


def _reference_bytes(model: str, mode: str, against) -> int:
    import os

    from ..quality.measurement import kv_bytes_per_token

    return kv_bytes_per_token(model, "f16", "f16") if mode == "kv" else os.path.getsize(against)


def _default_pairs(model, options: dict, n_ctx: int, every: bool) -> list[tuple[str, str]]:
    """The pairs the plan's devices run at speed that this model's heads can hold; unless `every`, only those on
    the loss-for-bytes front (this model's measurements where made, else ctxq's default table): a pair that another
    beats in both loss and bytes is never the plan's choice."""
    from ..gguf.info import model_info
    from ..models import resolve_model
    from ..planning import kvpairs
    from ..planning.devices import resolve_devices
    from ..planning.options import PlanOptions
    from ..quality.front import front
    from ..quality.measurement import kv_bytes_per_token

    path = str(resolve_model(model))
    devices, _ = resolve_devices(PlanOptions(**options).resolved())
    usable = kvpairs.usable_types(model_info(path))
    pairs = [(k, v) for k, v in kvpairs.at_speed(any(d.backend == "cuda" for d in devices))
             if k in usable and v in usable]
    if every:
        return pairs
    losses = {c.pair: c.loss for c in kvpairs.ranked(pairs, kvpairs.measurements(path, n_ctx))}
    return front([(p, kv_bytes_per_token(path, *p), losses[p]) for p in pairs])
