"""The layout rules of docs/architecture.md that import-linter cannot state (its contracts, the floors and no circle
inside a folder, are checked by tests/test_layers.py): modules of at most 400 lines, a row of the stage table for
every folder of the package, and serving in serve/ alone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"toolkit": "ctxq", "converters": "ctxq.converters", "profiles": "ctxq.profiles"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, prefix in PACKAGES.items():
        for p in (ROOT / folder).rglob("*.py"):
            parts = list(p.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = p
    return out


def test_modules_are_at_most_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def _stage_folders(doc: str) -> set[str]:
    """The folders the stage table of docs/architecture.md names (`name/` in its folder column)."""
    lines = doc.splitlines()
    start = lines.index("| stage | folder | what it holds |")
    folders = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        folders.update(re.findall(r"`([a-z_]+)/`", line.split("|")[2]))
    return folders


def test_every_folder_of_toolkit_has_its_row_in_the_stage_table():
    packages = {p.parent.name for p in (ROOT / "toolkit").glob("*/__init__.py")}
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert {"serve", "runtime", "planning", "llama"} <= packages  # the glob sees the package's folders
    assert packages - _stage_folders(doc) == set()
    # a row taken out is missed
    without_serve = "\n".join(ln for ln in doc.splitlines() if not ln.startswith("| serve |"))
    assert packages - _stage_folders(without_serve) == {"serve"}


def test_serving_lives_in_serve_not_runtime():
    assert sorted(p.name for p in (ROOT / "toolkit" / "runtime").glob("serve*.py")) == []
