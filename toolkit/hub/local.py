"""What this machine holds of a Hub repo: the Hugging Face cache's downloads and ctxq's header copies
(paths only; nothing here talks to the Hub)."""

from __future__ import annotations

from pathlib import Path

from .. import tempfiles
from ..paths import ctxq_home


def repo_dir(repo: str) -> Path:
    return ctxq_home() / "hub" / repo.replace("/", "--")


def hf_repo(repo: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"


def cached_files(repo: str) -> list[str]:
    """The files of `repo` on this machine: downloaded ones (the Hugging Face cache) by name, and
    ctxq's header-only copies marked '(header)'."""
    names = []
    snaps = hf_repo(repo) / "snapshots"
    if snaps.is_dir():
        names += sorted({str(p.relative_to(s)) for s in snaps.iterdir() for p in s.rglob("*") if p.is_file()})
    for commit in sorted(repo_dir(repo).glob("*/files")):
        names += sorted(f"{p.relative_to(commit)} (header)" for p in commit.rglob("*")
                        if p.is_file() and not tempfiles.parse(p.name))
    return names


def cached_note(repo: str) -> str:
    """What this machine holds of `repo` (downloaded files, GGUF headers), in a few words."""
    names = cached_files(repo)
    if not names:
        return f"nothing of {repo} is cached"
    return f"cached of {repo}: {', '.join(names[:6])}" + (f" and {len(names) - 6} more" if len(names) > 6 else "")
