"""The `ctxq` command: a small assembler over one module per command group.

Errors meant for users (`CtxqError`) print as one line, `Error: ...`, and exit 1;
`CTXQ_DEBUG=1` shows the traceback instead. SIGTERM or SIGHUP stops a one-shot command as Ctrl-C does, then one
line and exit status 128 + the signal's number (`cli/stops.py`).
"""

from __future__ import annotations

import os
import sys

import click

from ..errors import CtxqError
from .errors import cli_message
from .group import cli
from .stops import Stopped, StoppedExit


def _register() -> None:
    # each module adds its commands to `cli`; a module that fails to import is an error, not a
    # command that silently vanishes from --help
    from . import bench, cache, convert, imatrix, info, plan, quality, run, serve, worker  # noqa: F401


_register()


def main(argv: list[str] | None = None) -> None:
    from ..gguf.once import opened

    try:
        with opened():  # a model's header is parsed once per command
            cli.main(args=argv, prog_name="ctxq", standalone_mode=False)
    except StoppedExit as e:
        click.echo(e.line, err=True)
        sys.exit(e.code)
    except click.exceptions.Abort as e:
        if isinstance(e.__cause__, Stopped):  # a signal outside the command (while click closed its context)
            click.echo(StoppedExit(e.__cause__.signum).line, err=True)
            sys.exit(128 + e.__cause__.signum)
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except CtxqError as e:
        if os.environ.get("CTXQ_DEBUG"):
            raise
        click.echo(f"Error: {cli_message(e)}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except Exception as e:  # an unexpected failure still gets one line, with the way to see more
        if os.environ.get("CTXQ_DEBUG"):
            raise
        click.echo(f"Error: {type(e).__name__}: {e} (set CTXQ_DEBUG=1 for the traceback)", err=True)
        sys.exit(1)
