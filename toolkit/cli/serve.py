"""`ctxq serve`: the plan behind an OpenAI-compatible HTTP API (`ctxq.serve.server`)."""

from __future__ import annotations

import click

from ..serve.limits import ServeLimits
from ..units import MiB
from .group import cli
from .common import memory_table, one_line_on_abort, reexec
from .options import echo_session_log, hf_file_option, load_options, plan_options, session_option

_LIMITS = ServeLimits()  # the defaults


def _parallel(value: str | None) -> int | None:
    """None: one request at a time (llama-cpp-python's server); 0: auto; else P sequences."""
    if value is None:
        return None
    if value == "auto":
        return 0
    if not value.isdigit() or not 1 <= int(value) <= 256:
        raise click.BadParameter(f"{value!r}: a number of sequences, 1 to 256 (llama.cpp's LLAMA_MAX_SEQ), "
                                 "or auto")
    return int(value)


@cli.command("serve")
@click.argument("model", required=False)
@hf_file_option
@plan_options(parallel=False)
@load_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="CTXQ_API_KEY",
              help="Require this bearer token on the API (also CTXQ_API_KEY).")
@click.option("--alias", default=None, help="The model name the API reports (default: the file's name).")
@click.option("--max-body", "max_body", type=float, default=None, metavar="MiB",
              callback=lambda ctx, param, v: None if v is None else int(v * MiB),
              help=f"Largest request body; larger ones get 413.  [default: {_LIMITS.max_body // MiB}]")
@click.option("--max-queue", "max_queue", type=int, default=None,
              help=f"Requests waiting behind the one generating; more get 503 with Retry-After.  "
                   f"[default: {_LIMITS.max_queue}]")
@click.option("--timeout", "timeout", type=float, default=None, metavar="SECONDS",
              help="Time limit of a request, waiting included; its generation then ends (finish_reason "
                   f"length).  [default: {_LIMITS.timeout:g}]")
@click.option("--shutdown-timeout", "shutdown_timeout", type=float, default=None, metavar="SECONDS",
              help=f"On SIGTERM or Ctrl-C, how long running requests may still take.  "
                   f"[default: {_LIMITS.shutdown_timeout:g}]")
@click.option("--chat-format", "chat_format", default=None, metavar="NAME",
              help="llama-cpp-python's chat format for /v1/chat/completions instead of the model's template, "
                   "e.g. chatml-function-calling (tool_choice \"auto\").")
@click.option("--parallel", "-np", "serve_parallel", default=None, metavar="P|auto",
              callback=lambda ctx, param, v: _parallel(v),
              help="Answer P requests together on ctxq's engine: one KV cache of --ctx cells, a document the "
                   "requests share held once (auto: from the plan's free memory).  [default: one at a time]")
@session_option(serve=True)
@click.option("--spec", type=click.Choice(["ngram", "off", "auto"]), default=None,
              help="Drafts taken from the context, verified in one batch (as `ctxq run --spec`); one request at a "
                   "time only.")
def serve_cmd(model, hf_file, options, n_threads, seed, host, port, api_key, alias, max_body, max_queue, timeout,
              shutdown_timeout, chat_format, session, serve_parallel, spec):
    """Serve MODEL over an OpenAI-compatible HTTP API (llama-cpp-python's server), loaded as planned.

    Endpoints: /v1/chat/completions, /v1/completions (streaming too), /v1/models, /health, /metrics.
    Errors come in OpenAI's shape; a request whose prompt or max_tokens does not fit in --ctx gets a
    400 that says the numbers. response_format json_schema gives JSON matching the schema (a keyword
    the grammar cannot honour gets a 400 naming it); tools where the chat handler calls them.
    Limits, structured output and the error table: docs/serve.md.
    --session FILE starts from a state `ctxq run --session` saved: a request that starts with its
    tokens (the same document, first) processes only what follows.
    """
    from ..errors import ReorderNeeded
    from ..runtime import runner
    from ..serve import server

    parallel = serve_parallel  # not PlanOptions' `parallel`: it may be 0 (auto, from the plan; serve/server.py)
    if hf_file:
        from ..hub import with_file

        model = with_file(model, hf_file)
    given = dict(max_body=max_body, max_queue=max_queue, timeout=timeout, shutdown_timeout=shutdown_timeout)
    limits = ServeLimits(**{k: v for k, v in given.items() if v is not None})
    if session is not None:
        echo_session_log()
    with runner.local_workers(options) as opts:
        # --parallel P: the plan is the engine's context (n_seq_max, kv_unified, n_outputs_max); auto: the most
        # sequences (at most 16) whose plan fits as the one-sequence plan does (serve.parallel.auto_plan)
        auto_why = None
        if parallel == 0:
            from ..serve.parallel import auto_plan

            p, parallel, auto_why = auto_plan(lambda n: runner.make_plan(model, options=opts.updated(parallel=n)))
        else:
            p = runner.make_plan(model, options=opts.updated(parallel=parallel))
        app, load = server.create_app(p, api_key=api_key, rpc=opts.rpc, n_threads=n_threads, seed=seed,
                                      alias=alias, limits=limits, session=session,
                                      chat_format=chat_format, parallel=parallel, spec=spec,
                                      options=opts.updated(parallel=parallel or None))
        click.echo(f"ctxq: {p.llama_flags()} ({p.reason})", err=True)
        if parallel is not None and spec not in (None, "off"):
            click.echo("ctxq: --spec: the --parallel engine decodes one token per pass for each sequence (no drafts)",
                       err=True)
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            click.echo(f"ctxq: warning: serving on {host} without --api-key", err=True)

        def ready(loaded):
            memory, n_seq, why = loaded if parallel is not None else (loaded, None, None)
            click.echo(memory_table(memory), err=True)
            if n_seq is not None:
                click.echo(f"ctxq: --parallel {n_seq}: {auto_why or why}", err=True)
            click.echo(f"ctxq: serving on http://{host}:{port}/v1 (context {p.n_ctx:,} tokens); "
                       f"the page: http://{host}:{port}/", err=True)

        if opts.rpc or p.split_mode == "tensor":  # llama.cpp aborts the process: one line instead
            one_line_on_abort(p.split_mode == "tensor")
        click.echo(f"ctxq: loading the model; http://{host}:{port}/health says when it is ready", err=True)
        try:
            server.serve(app, load, host=host, port=port, on_ready=ready)
        except ReorderNeeded as e:
            reexec(e.value)
            raise
