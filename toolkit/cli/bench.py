"""`ctxq bench`: layer and tensor mode measured on the devices, llama-bench's way (runtime/bench.py)."""

from __future__ import annotations

import click

from .common import echo_json, table
from .group import cli
from .options import hf_file_option, load_options, plan_options


@cli.command("bench")
@click.argument("model", required=False)
@plan_options(ubatch_list=True)
@hf_file_option
@click.option("-p", "--n-prompt", "n_prompt", type=int, default=512, show_default=True,
              help="Prompt tokens processed in one timed batch (pp).")
@click.option("-n", "--n-gen", "n_gen", type=int, default=32, show_default=True,
              help="Tokens generated one at a time, timed (tg).")
@click.option("-d", "--n-depth", "depth", type=int, default=0, show_default=True,
              help="Tokens already in the cache before each test (untimed).")
@click.option("-r", "--repetitions", "reps", type=int, default=3, show_default=True,
              help="Timed repetitions after one warm-up.")
@click.option("--spec", "spec", is_flag=True,
              help="Measure instead what a draft's verification costs (a batch of n tokens against one, at -d), "
                   "kept for `ctxq run --spec auto`.")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as JSON.")
@load_options
def bench_cmd(model, options, hf_file, n_ubatches, n_prompt, n_gen, depth, reps, spec, as_json, n_threads, seed):
    """Measure MODEL's plan in each split mode on these devices (-sm layer or tensor: that one; else both).

    Each mode's plan (as `ctxq plan -sm MODE` makes it; with -ub 256,512,… one plan per micro-batch) is loaded in a
    child process and timed as llama-bench times it: -p prompt tokens in one batch (pp) and -n tokens generated one
    by one (tg), at depth -d, -r times, tokens/s mean ± sd. The results are kept per model file, device set,
    llama.cpp version and plan: `ctxq plan -sm auto` then chooses the faster mode by them.
    """
    from ..hub import with_file
    from ..runtime import bench

    model = with_file(model, hf_file) if hf_file else model
    if spec:
        p, cost = bench.bench_spec(model, options, depth=depth, reps=reps, n_threads=n_threads)
        if as_json:
            echo_json({"plan": p.llama_flags(), "depth": depth, "cost": cost})
            return
        click.echo(table([[n, f"{c:.2f}", f"{n / c:.2f}"] for n, c in cost.items()],
                         ["draft batch (tokens)", "cost (1 token = 1)", "tokens per cost if all accepted"]))
        click.echo(f"(at depth {depth}; kept for `ctxq run --spec auto` with this plan on these devices)", err=True)
        return
    mode = options.split_mode
    modes = bench.MODES if mode in (None, "auto") else (mode,)
    rows = bench.bench(model, options.updated(split_mode=None), modes=modes, n_prompt=n_prompt, n_gen=n_gen,
                       depth=depth, reps=reps, n_threads=n_threads, ubatches=n_ubatches or (None,),
                       on_progress=None if as_json else (lambda s: click.echo(f"ctxq: {s}", err=True)))
    if as_json:
        echo_json([{"mode": m, "plan": p.llama_flags() if p else None, "n_ubatch": p.n_ubatch if p else None,
                    "left_out": p.left_out if p else None,
                    **(r.to_dict() if not isinstance(r, str) else {"not_measured": r})} for m, p, r in rows])
        return
    out = []
    for m, p, r in rows:
        if isinstance(r, str):
            out.append([m, "-", "-", "-", f"not measured: {r}"])
            continue
        ts = ",".join(map(str, p.tensor_split)) if p.gpus else "-"
        if p.llama_devices:  # tensor mode over some of the cards
            ts += " -dev " + ",".join(p.llama_devices)
        if p.cpu_ffn_layers or p.cpu_layers:  # which placement (planning/spill/placement.py): both are measured
            ts += f" (FFN of {len(p.cpu_ffn_layers)} on host)" if p.cpu_ffn_layers else f" ({p.cpu_layers} on CPU)"
        if n_prompt:
            out.append([m, ts, p.n_ubatch, f"pp{n_prompt} @ d{depth}", bench.mean_sd(r.pp_tps)])
        if n_gen:
            out.append([m, ts, p.n_ubatch, f"tg{n_gen} @ d{depth}", bench.mean_sd(r.tg_tps)])
    click.echo(table(out, ["mode", "-ts", "-ub", "test", "t/s"]))
    click.echo(f"(measured on {', '.join(next((r.devices for _, _, r in rows if not isinstance(r, str)), []))}; "
               "kept for `ctxq plan -sm auto` on these devices)", err=True)
