"""What ctxq keeps of Hub repos: listings by commit, and header-only copies of their files.

    <ctxq home>/hub/OWNER--NAME/refs/REVISION            the commit a branch or tag resolved to
    <ctxq home>/hub/OWNER--NAME/COMMIT/listing.json      the repo's files and sizes at that commit
    <ctxq home>/hub/OWNER--NAME/COMMIT/files/PATH        a file's header, the rest a sparse hole

A header-only copy has the remote file's exact size and header bytes, so every local reader (the
GGUF reader, the planner's derived models, llama.cpp's dry run) takes it as the file itself; the
weights are zeros that are never read. Keyed by commit, a copy never goes stale.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .. import tempfiles
from ..errors import HubError
from .http import Listing, list_repo, offline
from .local import cached_note, hf_repo, repo_dir

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def header_path(listing: Listing, path: str) -> Path:
    return repo_dir(listing.repo) / listing.commit / "files" / path


_asked: dict[tuple[str, str | None], Listing] = {}  # what this process asked the Hub


def listing(repo: str, revision: str | None) -> Listing:
    """The repo's files at `revision`: asked of the Hub (once per process), or from what is cached when
    HF_HUB_OFFLINE is set (ctxq's own listing, else the Hugging Face cache's snapshot) or the revision
    is a known commit."""
    if (repo, revision) in _asked:
        return _asked[(repo, revision)]
    rev = revision or "main"
    base = repo_dir(repo)
    ref = base / "refs" / rev.replace("/", "%2F")
    commit = rev if _COMMIT.match(rev) else (ref.read_text().strip() if ref.is_file() else None)
    saved = base / str(commit) / "listing.json"
    if commit and (offline() or _COMMIT.match(rev)) and saved.is_file():
        return Listing(repo, commit, json.loads(saved.read_text()))
    if offline():
        snap = _hf_snapshot(repo, rev)
        if snap is None:

            raise HubError(f"{repo}@{rev} is not cached and HF_HUB_OFFLINE is set; {cached_note(repo)}")
        files = {str(p.relative_to(snap)): p.stat().st_size for p in snap.rglob("*") if p.is_file()}
        return Listing(repo, snap.name, files)
    got = _asked[(repo, revision)] = list_repo(repo, revision)
    _write(base / got.commit / "listing.json", json.dumps(got.files, indent=0, sort_keys=True))
    _write(ref, got.commit)
    return got


def write_header_copy(out: Path, header: bytes, size: int) -> Path:
    """A file of `size` bytes that starts with `header` and is a hole after it; atomic: written to a temporary that
    is renamed, so a process stopped midway leaves no copy, and its temporary is swept by the next one written here."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tempfiles.sweep(out.parent)
    tmp = tempfiles.create(out, "header")
    try:
        with open(tmp, "r+b") as f:
            f.write(header)
            f.truncate(size)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def hf_cached(listing: Listing, paths: list[str]) -> list[Path] | None:
    """The downloaded files of `paths` in the Hugging Face cache, or None unless all are there."""
    from huggingface_hub import try_to_load_from_cache

    found = [try_to_load_from_cache(listing.repo, p, revision=listing.commit) for p in paths]
    return [Path(f) for f in found] if all(isinstance(f, str) for f in found) else None


def _hf_snapshot(repo: str, rev: str) -> Path | None:
    base = hf_repo(repo)
    ref = base / "refs" / rev
    commit = rev if _COMMIT.match(rev) else (ref.read_text().strip() if ref.is_file() else None)
    snap = base / "snapshots" / str(commit)
    return snap if commit and snap.is_dir() else None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfiles.create(path, "write")
    tmp.write_text(text)
    os.replace(tmp, path)
