"""`ctxq serve`: the plan behind an OpenAI-compatible HTTP API (`ctxq.runtime.server`)."""

from __future__ import annotations

import click

from .group import cli
from .common import memory_table, reexec
from .options import echo_session_log, load_options, plan_options, session_option


@cli.command("serve")
@click.argument("model", required=False)
@plan_options()
@load_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="CTXQ_API_KEY",
              help="Require this bearer token on the API (also CTXQ_API_KEY).")
@click.option("--alias", default=None, help="The model name the API reports (default: the file path).")
@session_option(serve=True)
def serve_cmd(model, options, n_threads, seed, host, port, api_key, alias, session):
    """Serve MODEL over an OpenAI-compatible HTTP API (llama-cpp-python's server), loaded as planned.

    Endpoints: /v1/chat/completions, /v1/completions (streaming too), /v1/models, /health.
    A request whose prompt does not fit in --ctx gets a 400 that says both numbers.
    --session FILE starts from a state `ctxq run --session` saved: a request that starts with its
    tokens (the same document, first) processes only what follows.
    """
    import uvicorn

    from ..errors import ReorderNeeded
    from ..runtime import runner, server

    if session is not None:
        echo_session_log()
    with runner.local_workers(options) as opts:
        p = runner.make_plan(model, options=opts)
        try:
            app, memory = server.create_app(p, api_key=api_key, rpc=opts.rpc, n_threads=n_threads, seed=seed,
                                            alias=alias, session=session)
        except ReorderNeeded as e:
            reexec(e.value)
            raise
        click.echo(f"ctxq: {p.llama_flags()} ({p.reason})", err=True)
        click.echo(memory_table(memory), err=True)
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            click.echo(f"ctxq: warning: serving on {host} without --api-key", err=True)
        click.echo(f"ctxq: serving on http://{host}:{port}/v1 (context {p.n_ctx:,} tokens)", err=True)
        uvicorn.run(app, host=host, port=port, log_level="warning")
