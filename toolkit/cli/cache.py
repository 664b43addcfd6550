"""`ctxq cache`: what ctxq keeps on disk, and clearing it (as `huggingface-cli delete-cache`, `ollama rm`)."""

from __future__ import annotations

import click

from ..models import CLEARABLE
from .group import cli
from .common import human, table


@cli.group("cache", invoke_without_command=True)
@click.pass_context
def cache_cmd(ctx: click.Context):
    """List what ctxq's cache holds (CTXQ_HOME, default ~/.cache/ctxq): each part, its files and size.

    Temporaries that killed runs left behind (`.NAME.ctxq-PID-HOST.WHAT.part`) are counted apart;
    `ctxq cache clean` removes them.
    """
    if ctx.invoked_subcommand is not None:
        return
    from .. import tempfiles
    from ..models import cache_parts, ctxq_home, models_dir

    home = ctxq_home()
    parts = cache_parts()
    click.echo(f"ctxq cache: {home}")
    rows = [[p.name, human(p.size), str(p.files), p.description] for p in parts if p.files or "other" not in p.name]
    click.echo(table(rows, ["part", "size", "files", "holds"]))
    models = sorted(f for f in models_dir().glob("*") if f.is_file() and not tempfiles.parse(f.name)) \
        if models_dir().is_dir() else []
    if models:
        click.echo("\nmodels (remove one with `ctxq cache rm NAME`):")
        width = max(len(f.name) for f in models)
        for f in models:
            click.echo(f"  {f.name:<{width}}  {human(tempfiles.size_of(f)):>10}")
    temps = tempfiles.temporaries(home, recursive=True)
    stale = [t for t in temps if tempfiles.is_stale(t)]
    if temps:
        click.echo(f"\ntemporaries: {len(stale)} stale ({human(sum(tempfiles.size_of(t) for t in stale))}), "
                   f"{len(temps) - len(stale)} of running (or other machines') processes"
                   + ("; `ctxq cache clean` removes the stale ones" if stale else ""))


@cache_cmd.command("clean")
@click.argument("parts", nargs=-1, type=click.Choice(CLEARABLE))
@click.option("--all", "everything", is_flag=True, help="Clear every part except models.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
def clean_cmd(parts: tuple[str, ...], everything: bool, dry_run: bool):
    """Remove stale temporaries everywhere in the cache, and the named PARTS.

    PARTS: derived, hfplan (planning headers), quantize (quantization records: reruns convert again),
    logits (the quality gate's reference logits), digests (remembered source digests), hf (rebuilt
    checkpoints). Every one is made again when needed. Models are removed one by one with
    `ctxq cache rm NAME`. A running process's temporaries are never removed.
    """
    from ..models import clean_cache

    removed = clean_cache(CLEARABLE if everything else parts, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for path, size in removed:
        click.echo(f"{verb} {path}  {human(size)}")
    click.echo(f"{verb} {len(removed)} files, {human(sum(s for _, s in removed))}")


@cache_cmd.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
def rm_cmd(names: tuple[str, ...], dry_run: bool):
    """Remove models from the models folder by file name (as `ctxq cache` lists them)."""
    from ..models import remove_model

    for name in names:
        remove_model(name, dry_run=True)  # every name is checked before any file goes
    for name in names:
        path, size = remove_model(name, dry_run=dry_run)
        click.echo(f"{'would remove' if dry_run else 'removed'} {path}  {human(size)}")
