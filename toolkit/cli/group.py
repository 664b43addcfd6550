"""The `ctxq` click group that every command module adds itself to (`cli/__init__` imports them all)."""

from __future__ import annotations

import logging
import os

import click

from . import stops


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except stops.Stopped as e:  # the command's cleanup has run on the way here
            raise stops.StoppedExit(e.signum) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ctxq")
@click.option("-v", "--verbose", is_flag=True, help="Log what ctxq and llama.cpp do to stderr.")
def cli(verbose: bool):
    """ctxq: run long-context LLMs on the GPUs you own (llama.cpp underneath)."""
    if verbose or os.environ.get("CTXQ_DEBUG"):
        logging.basicConfig(level=logging.DEBUG if os.environ.get("CTXQ_DEBUG") else logging.INFO,
                            format="%(name)s: %(message)s")
    ctx = click.get_current_context()
    if ctx.invoked_subcommand not in stops.OWN_STOP:  # SIGTERM and SIGHUP as Ctrl-C (cli/stops.py)
        stops.install()
        ctx.call_on_close(stops.restore)
