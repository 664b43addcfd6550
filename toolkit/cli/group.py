"""The `ctxq` click group that every command module adds itself to (`cli/__init__` imports them all)."""

from __future__ import annotations

import logging
import os

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ctxq")
@click.option("-v", "--verbose", is_flag=True, help="Log what ctxq and llama.cpp do to stderr.")
def cli(verbose: bool):
    """ctxq: run long-context LLMs on the GPUs you own (llama.cpp underneath)."""
    if verbose or os.environ.get("CTXQ_DEBUG"):
        logging.basicConfig(level=logging.DEBUG if os.environ.get("CTXQ_DEBUG") else logging.INFO,
                            format="%(name)s: %(message)s")
