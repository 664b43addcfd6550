"""`ctxq run`: execute the plan on one input (`ctxq.runtime.runner`: prepare, then execute)."""

from __future__ import annotations

import sys

import click

from .. import interrupts
from .group import cli
from .common import echo_json, memory_table, one_line_on_abort, reexec
from .options import echo_session_log, hf_file_option, load_options, plan_options, session_option
from .plan import render_plan


def _read_input(prompt, file):
    """(document, prompt): -f FILE is the document and -p TEXT follows it; stdin when neither is given. The file is
    checked from its first block and read later, only as far as the plan's context can use (`ctxq.textfile`)."""
    if file is not None:
        from ..textfile import TextFile

        return TextFile(file), prompt
    if prompt is not None:
        return None, prompt
    if not sys.stdin.isatty():
        return None, sys.stdin.read() or None  # nothing piped (e.g. /dev/null) is no input
    return None, None


@cli.command("run")
@click.argument("model", required=False)
@hf_file_option
@plan_options()
@load_options
@click.option("-p", "--prompt", "prompts", multiple=True,
              help="The input text; repeated, several questions about the -f document, answered together.")
@click.option("--questions", "questions_file", type=click.Path(dir_okay=False), default=None,
              help="Questions about the -f document, one per line, answered together (the document read once).")
@click.option("-f", "--file", "file", type=click.Path(dir_okay=False), default=None,
              help="Read the input from FILE; with -p, FILE comes first and the prompt after it.")
@session_option
@click.option("--chat", is_flag=True, help="Wrap the input as a user turn in the model's chat template.")
@click.option("--system", default=None, help="A system message (with --chat).")
@click.option("-n", "--n-predict", "n_predict", type=int, default=256, show_default=True,
              help="Tokens to generate (-1: until the model stops or the context is full, as llama.cpp's -n).")
@click.option("--temp", type=float, default=0.8, show_default=True, help="Sampling temperature; 0 is greedy.")
@click.option("--spec", type=click.Choice(["ngram", "off", "auto"]), default=None,
              help="Drafts taken from the context, verified in one batch: ngram always, auto (the default) where "
                   "`ctxq bench --spec` measured that they pay on these devices, and while they are accepted.")
@click.option("--dry-run", is_flag=True, help="Print the plan (and the input's size) and stop.")
@click.option("--json", "as_json", is_flag=True, help="Print the result (text, timings, memory) as JSON.")
def run_cmd(model, hf_file, options, n_threads, seed, prompts, questions_file, file, session, chat, system, n_predict,
            temp, spec, dry_run, as_json):
    """Run MODEL (a GGUF; default: the embedded SmolLM2) on a long input with --ctx tokens of context.

    The input (-p, -f or stdin) is tokenized and checked against the context first; then the plan
    is made for the devices present, the model loads as planned, the prompt is processed with a
    progress bar and the answer streams to stdout. Statistics go to stderr.

    With -f FILE -p TEXT the file is read first and the prompt follows after a blank line (with
    --chat, both are one user turn, the file at its start). --session saves the state of the input
    up to the file's end; a later run with the same file, model and settings restores it and
    processes only the prompt.

    With several -p (or --questions FILE, one per line) the file is read once and every question
    forks from it; the answers are decoded together and printed in order, labelled (--json: a list).
    """
    from ..errors import ReorderNeeded
    from ..llama import backend
    from ..runtime import runner

    if hf_file:
        from ..hub import with_file

        model = with_file(model, hf_file)
    questions = list(prompts)
    if questions_file is not None:
        from ..runtime.many import read_questions

        questions += read_questions(questions_file)
    if len(questions) > 1:
        document, _ = _read_input(None, file)
        if document is None:
            raise click.UsageError("several questions are about a document: give it with -f FILE (or on stdin)")
        _run_many(model, document, questions, options=options, n_threads=n_threads, seed=seed, session=session,
                 chat=chat, system=system, n_predict=n_predict, temp=temp, dry_run=dry_run, as_json=as_json,
                 spec=spec)
        return
    if options.parallel is not None:  # a single prompt runs on a Llama's one-sequence context
        raise click.UsageError("--parallel is for several questions about a document (-f FILE -p Q1 -p Q2 ...)")
    prompt = questions[0] if questions else None
    document, text = _read_input(prompt, file)
    if text is None and document is None and not dry_run:
        raise click.UsageError("give the input: -p TEXT, -f FILE, or pipe it on stdin")
    if session is not None:
        echo_session_log()
    with runner.local_workers(options) as opts:
        prepared = runner.prepare(model, text, document=document, chat=chat, system=system, n_predict=n_predict,
                                  session=session, options=opts)
        if dry_run:
            _print_dry_run(prepared, as_json)
            return
        tensor = getattr(prepared.plan, "split_mode", "layer") == "tensor"
        if prepared.rpc or tensor:
            one_line_on_abort(tensor)
        if (no_cuda := backend.cuda_unavailable()) is not None:
            click.echo(f"ctxq: {no_cuda}; running on the CPU", err=True)
        bar = None if as_json else _ProgressBar()
        try:
            r = runner.execute(prepared, temp=temp, seed=seed, n_threads=n_threads, spec=spec,
                               on_loaded=_loaded,
                               on_progress=bar, on_text=None if as_json else (lambda s: click.echo(s, nl=False)))
        except ReorderNeeded as e:
            reexec(e.value)
            raise
        finally:
            if bar:
                bar.close()
    if as_json:
        echo_json(r.to_dict())
        return
    click.echo("")
    note = (r.spec or {}).get("note")
    if note and (spec not in (None, "off") or "recurrent" in note):  # auto unmeasured, by default: nothing to say
        click.echo(f"ctxq: spec {r.spec['mode']}: {note}", err=True)
    cached = f" ({r.n_cached:,} restored from the session)" if r.n_cached else ""
    click.echo(f"prompt {r.n_prompt:,} tokens{cached}: prefill {r.prefill_s:.2f} s ({r.prefill_tps:.1f} tok/s), "
               f"time to first token {r.ttft_s:.2f} s; generated {r.n_generated} tokens "
               f"({r.decode_tps:.2f} tok/s, stop: {r.stop}){_spec_line(r)}", err=True)
    click.echo(memory_table(r.memory), err=True)


def _spec_line(r) -> str:
    """Run's timing line: tokens per pass and acceptance, when drafts were verified."""
    s = r.spec or {}
    if not s.get("active"):
        return ""
    return (f"; spec {s['mode']}: {r.tokens_per_pass:.2f} tokens per pass, {s['accepted']:,} of {s['drafted']:,} "
            f"drafted accepted ({100 * s['acceptance']:.0f} %)")


def _run_many(model, document, questions, *, options, n_threads, seed, session, chat, system, n_predict, temp,
              dry_run, as_json, spec=None) -> None:
    """Several questions about one document: the document evaluated once, the answers decoded together."""
    from ..errors import ReorderNeeded
    from ..runtime import many

    if session is not None:
        echo_session_log()
    if dry_run:
        from ..runtime import runner
        from ..models import resolve_model

        with runner.local_workers(options) as opts:
            document = runner.document_text(document, model, opts.n_ctx)
            tokens, keep = many.question_tokens(resolve_model(model), document, questions, chat=chat, system=system)
            need = many.cells_needed(tokens, keep, max(n_predict, 0))
            p = runner.make_plan(model, options=opts if opts.n_ctx is not None else opts.updated(
                n_ctx=-(-need // many.CELL_ROUND) * many.CELL_ROUND))
        if as_json:
            echo_json({"n_document": keep, "n_prompts": [len(t) for t in tokens], "cells_needed": need,
                       "plan": p.to_dict()})
            return
        click.echo(render_plan(p))
        click.echo(f"input: a document of {keep:,} tokens held once, {len(questions)} questions "
                   f"({sum(len(t) - keep for t in tokens):,} tokens) and {n_predict:,} tokens to generate each: "
                   f"{need:,} KV cells of {p.n_ctx:,}")
        return

    def on_answer(i, a):
        if not as_json:
            click.echo(f"[{i + 1}] {a.question}\n{a.text}\n")

    try:
        r = many.ask_many(model, document, questions, max_tokens=n_predict, temperature=temp, seed=seed, chat=chat,
                          system=system, session=session, n_threads=n_threads, options=options, spec=spec,
                          on_loaded=_loaded, on_answer=on_answer)
    except ReorderNeeded as e:
        reexec(e.value)
        raise
    if as_json:
        echo_json([{**a.to_dict(), "n_document": r.n_document} for a in r.answers])
        return
    if r.spec_note and spec not in (None, "off"):
        click.echo(f"ctxq: spec {spec}: {r.spec_note}", err=True)
    restored = f", {r.n_cached:,} restored from the session" if r.n_cached else ""
    drafts = (f"; drafts: {r.tokens_draft_accepted:,} of {r.tokens_drafted:,} drafted accepted"
              if r.tokens_drafted else "")
    click.echo(f"document {r.n_document:,} tokens held once{restored} (read in {r.prefill_s:.2f} s); "
               f"{len(r.answers)} questions: {r.prompt_tokens_evaluated:,} prompt tokens evaluated, "
               f"{r.tokens_generated:,} generated, {r.cells_used:,} KV cells held; all answered in "
               f"{r.total_s:.2f} s{drafts}", err=True)
    click.echo(memory_table(r.memory), err=True)


def _loaded(p, load_s: float) -> None:
    click.echo(f"ctxq: {p.llama_flags()} ({p.reason}); loaded in {load_s:.1f} s", err=True)


def _print_dry_run(prepared, as_json: bool) -> None:
    p, tokens = prepared.plan, prepared.tokens
    if as_json:
        echo_json({"n_prompt": len(tokens) if tokens else None, "plan": p.to_dict()})
        return
    click.echo(render_plan(p))
    if tokens is not None:
        more = "until the context is full" if prepared.n_predict < 0 else f"{prepared.n_predict:,}"
        click.echo(f"input: {len(tokens):,} tokens + {more} to generate, context {p.n_ctx:,}")


class _ProgressBar:
    """tqdm on stderr: tokens done / total and tokens/s."""

    def __init__(self):
        self.bar = None  # drawn at the first report, after the model has loaded
        self.closed = False

    def __call__(self, prog) -> None:
        if self.closed:
            return
        with interrupts.held():  # a stop signal waits for the bar to be whole (cli/common.py, Bars)
            if self.bar is None:
                from tqdm import tqdm

                # The rate shown is ctxq's (tokens done / seconds since prefill began), not tqdm's smoothed one.
                self.bar = tqdm(total=prog.total, desc="prefill", file=sys.stderr, dynamic_ncols=True,
                                mininterval=0.5, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                                            "tokens [{elapsed}<{remaining}{postfix}]")
            self.bar.n = prog.done
            self.bar.set_postfix_str(f"{prog.tokens_per_s:.0f} tok/s", refresh=False)
            self.bar.refresh()
            if prog.done >= prog.total:
                self.close()

    def close(self) -> None:
        with interrupts.held():
            if not self.closed:
                self.closed = True
                if self.bar is not None:
                    self.bar.close()
