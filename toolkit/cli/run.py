"""`ctxq run`: execute the plan on one input (`ctxq.runtime.runner`)."""

from __future__ import annotations

import contextlib
import os
import sys

import click

from . import cli
from .common import echo_json, human, table
from .plan import device_options, kv_options, render_plan


def plan_options(f):
    """The options that make a plan, shared by run and serve (the same words as `ctxq plan`).
    click lists options in the reverse order of application, so the last applied shows first."""
    f = click.option("--seed", type=int, default=None, help="Sampling seed (default: random).")(f)
    f = click.option("-t", "--threads", "n_threads", type=int, default=None,
                     help="CPU threads (default: every CPU this process may use).")(f)
    f = click.option("-b", "--batch", "n_batch", type=int, default=2048, show_default=True)(f)
    f = click.option("-ub", "--ubatch", "n_ubatch", type=int, default=512, show_default=True)(f)
    f = click.option("--prefer", type=click.Choice(["quality", "speed"]), default="quality",
                     help="quality: keep KV at q8_0 or better, offload layers instead; speed: the reverse.")(f)
    f = kv_options(f)
    f = click.option("--simulate", default=None, metavar="GiB,…",
                     help="Run on local RPC worker processes standing for GPUs of these sizes.")(f)
    f = device_options(f)
    f = click.option("-ts", "--split", default="auto", show_default=True,
                     help="auto (plan for the devices), ratios 16:16:16:8:8, or layer counts 19,19,19,10,14.")(f)
    f = click.option("-c", "--ctx", "n_ctx", type=int, default=4096, show_default=True,
                     help="Context in tokens; never shrunk to fit.")(f)
    return f


@contextlib.contextmanager
def _devices(simulate, rpc):
    """The --rpc endpoints to use: given ones, or local workers started for --simulate."""
    if simulate and rpc:
        raise click.UsageError("give --simulate or --rpc, not both")
    if not simulate:
        yield rpc
        return
    from ..rpc import start_workers

    with start_workers(simulate) as workers:
        yield workers.rpc


def _plan(model, n_ctx, split, gpus, profile, rpc, kv, type_k, type_v, flash_attn, prefer, n_ubatch, n_batch):
    from ..runtime.runner import make_plan

    # The device order the plan chooses is applied through CUDA_VISIBLE_DEVICES in a fresh process
    # (_reexec); that process plans again for the GPUs in their new order, without reordering.
    reorder = os.environ.get("CTXQ_DEVICE_ORDER_APPLIED") is None
    return make_plan(model, n_ctx, split=split, gpus=gpus, profile=profile, rpc=rpc, kv=kv, type_k=type_k,
                     type_v=type_v, flash_attn={"on": True, "off": False, "auto": None}[flash_attn],
                     prefer=prefer, n_ubatch=n_ubatch, n_batch=n_batch, reorder=reorder)


def _reexec(value: str) -> None:
    """Start this command again with the GPUs reordered: CUDA reads CUDA_VISIBLE_DEVICES only once."""
    click.echo(f"ctxq: reordering the GPUs: CUDA_VISIBLE_DEVICES={value}", err=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": value, "CTXQ_DEVICE_ORDER_APPLIED": value}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-c", "from ctxq.cli import main; main()", *sys.argv[1:]], env)


def _read_input(prompt, file):
    if prompt is not None and file is not None:
        raise click.UsageError("give -p TEXT or -f FILE, not both")
    if file is not None:
        try:
            with open(file, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError as e:
            from ..errors import CtxqError

            raise CtxqError(f"cannot read {file}: {e.strerror}") from None
    if prompt is not None:
        return prompt
    if not sys.stdin.isatty():
        return sys.stdin.read() or None  # nothing piped (e.g. /dev/null) is no input
    return None


def _memory_table(memory) -> str:
    rows = [[m.name, human(m.planned), human(m.reported),
             f"{(m.reported - m.planned) / m.planned * 100:+.0f}%" if m.planned else "-"] for m in memory]
    return table(rows, ["device", "planned", "llama.cpp", "diff"])


@cli.command("run")
@click.argument("model", required=False)
@plan_options
@click.option("-p", "--prompt", default=None, help="The input text.")
@click.option("-f", "--file", "file", type=click.Path(dir_okay=False), default=None, help="Read the input from FILE.")
@click.option("--chat", is_flag=True, help="Wrap the input as a user turn in the model's chat template.")
@click.option("--system", default=None, help="A system message (with --chat).")
@click.option("-n", "--n-predict", "n_predict", type=int, default=256, show_default=True, help="Tokens to generate.")
@click.option("--temp", type=float, default=0.8, show_default=True, help="Sampling temperature; 0 is greedy.")
@click.option("--dry-run", is_flag=True, help="Print the plan (and the input's size) and stop.")
@click.option("--json", "as_json", is_flag=True, help="Print the result (text, timings, memory) as JSON.")
def run_cmd(model, n_ctx, split, gpus, profile, rpc, simulate, kv, type_k, type_v, flash_attn, prefer, n_ubatch,
            n_batch, n_threads, seed, prompt, file, chat, system, n_predict, temp, dry_run, as_json):
    """Run MODEL (a GGUF; default: the embedded SmolLM2) on a long input with --ctx tokens of context.

    The input (-p, -f or stdin) is tokenized and checked against the context first; then the plan
    is made for the devices present, the model loads as planned, the prompt is processed with a
    progress bar and the answer streams to stdout. Statistics go to stderr.
    """
    from ..runtime.runner import ReorderNeeded, check_context, load_plan, generate, tokenize

    text = _read_input(prompt, file)
    if text is None and not dry_run:
        raise click.UsageError("give the input: -p TEXT, -f FILE, or pipe it on stdin")
    tokens = tokenize(model, text, chat=chat, system=system) if text is not None else None
    if tokens is not None:
        check_context(len(tokens), n_predict, n_ctx)
    with _devices(simulate, rpc) as rpc_eps:
        p = _plan(model, n_ctx, split, gpus, profile, rpc_eps, kv, type_k, type_v, flash_attn, prefer,
                  n_ubatch, n_batch)
        if dry_run:
            if as_json:
                echo_json({"n_prompt": len(tokens) if tokens else None, "plan": p.to_dict()})
            else:
                click.echo(render_plan(p))
                if tokens is not None:
                    click.echo(f"input: {len(tokens):,} tokens + {n_predict:,} to generate, "
                               f"context {n_ctx:,}")
            return
        if rpc_eps:
            _one_line_on_worker_loss()
        try:
            llm, memory, load_s = load_plan(p, rpc=rpc_eps, n_threads=n_threads, seed=seed)
        except ReorderNeeded as e:
            _reexec(e.value)
            raise
        click.echo(f"ctxq: {p.llama_flags()} ({p.reason}); loaded in {load_s:.1f} s", err=True)
        bar = _ProgressBar(len(tokens)) if not as_json else None
        on_text = None if as_json else (lambda s: click.echo(s, nl=False))
        try:
            g = generate(llm, tokens, n_predict=n_predict, temp=temp, on_progress=bar, on_text=on_text)
        finally:
            llm.close()
            if bar:
                bar.close()
    from ..runtime.runner import RunResult

    r = RunResult(text=g["text"], tokens=g["tokens"], n_prompt=len(tokens), load_s=load_s, prefill_s=g["prefill_s"],
                  decode_s=g["decode_s"], ttft_s=g["ttft_s"], stop=g["stop"], plan=p, memory=memory)
    if as_json:
        echo_json(r.to_dict())
        return
    click.echo("")
    click.echo(f"prompt {r.n_prompt:,} tokens: prefill {r.prefill_s:.2f} s ({r.prefill_tps:.1f} tok/s), "
               f"time to first token {r.ttft_s:.2f} s; generated {r.n_generated} tokens "
               f"({r.decode_tps:.2f} tok/s, stop: {r.stop})", err=True)
    click.echo(_memory_table(r.memory), err=True)


class _ProgressBar:
    """tqdm on stderr: tokens done / total and tokens/s."""

    def __init__(self, total: int):
        from tqdm import tqdm

        # The rate shown is ctxq's (tokens done / seconds since prefill began), not tqdm's smoothed one.
        self.bar = tqdm(total=total, desc="prefill", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tokens "
                                   "[{elapsed}<{remaining}{postfix}]")
        self.closed = False

    def __call__(self, prog) -> None:
        if self.closed:
            return
        self.bar.n = prog.done
        self.bar.set_postfix_str(f"{prog.tokens_per_s:.0f} tok/s", refresh=False)
        self.bar.refresh()
        if prog.done >= prog.total:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.bar.close()


def _one_line_on_worker_loss() -> None:
    """llama.cpp aborts the process when an RPC worker goes away; say which one in one line instead."""
    import os
    import sys

    from ..rpc import describe_abort, on_ggml_abort

    def on_abort(message: str) -> None:
        sys.stderr.write(f"\nError: {describe_abort(message)}\n")
        sys.stderr.flush()
        os._exit(1)

    on_ggml_abort(on_abort)
