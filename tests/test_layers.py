"""The floors of the package (pyproject.toml's import-linter contracts, docs/architecture.md "Floors"): kept by
this tree, and broken by a copy of it with one import the wrong way, a folder without a floor, or a circle inside a
folder. scripts/lint_imports.py runs lint-imports on the package as it installs (toolkit/, converters/ and
profiles/ put together as `ctxq`)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from lint_imports import lint  # noqa: E402


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    for folder in ("toolkit", "converters", "profiles"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_this_tree_keeps_every_contract():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 3 kept, 0 broken." in r.stdout
    # the package as installed: converters/ and profiles/ are in the graph
    assert int(r.stdout.split("Analyzed ")[1].split(" files")[0]) > len(list((ROOT / "toolkit").rglob("*.py")))


@pytest.mark.parametrize("module, line, expected", [
    # a low floor reaching up
    ("toolkit/gguf/info.py", "from ..cli import group", "ctxq.gguf is not allowed to import ctxq.cli"),
    # the planner reaching for the quality measurement (it reads the store below it instead)
    ("toolkit/planning/kvpairs.py", "from ..quality import measurement",
     "ctxq.planning is not allowed to import ctxq.quality"),
    # two folders of one floor
    ("toolkit/serve/limits.py", "from ..conversion import output", "ctxq.serve is not allowed to import ctxq.conversion"),
    # converters/ is a folder of the package too
    ("converters/base.py", "from ..planning import options", "ctxq.converters is not allowed to import ctxq.planning"),
])
def test_one_import_the_wrong_way_breaks_the_floors(tmp_path, module, line, expected):
    root = _copy(tmp_path)
    _append(root / module, line)
    r = lint(root)
    assert r.returncode != 0
    assert "floors: each imports only the floors below it BROKEN" in r.stdout
    assert expected in r.stdout, r.stdout


@pytest.mark.parametrize("module, line, expected", [
    # what a placement costs reaching up to a placement
    ("toolkit/planning/memory/costs.py", "from ..spill import placement",
     "ctxq.planning.memory is not allowed to import ctxq.planning.spill"),
    # one placement reaching up to the one built on it
    ("toolkit/planning/layers/search.py", "from ..spill import placement",
     "ctxq.planning.layers is not allowed to import ctxq.planning.spill"),
    # the memory terms and the speed model are independent
    ("toolkit/planning/speed/model.py", "from ..memory import costs",
     "ctxq.planning.speed is not allowed to import ctxq.planning.memory"),
])
def test_the_planning_folders_keep_their_order(tmp_path, module, line, expected):
    root = _copy(tmp_path)
    _append(root / module, line)
    r = lint(root)
    assert r.returncode != 0
    assert "planning: the planner, each placement, then memory and speed BROKEN" in r.stdout, r.stdout
    assert expected in r.stdout, r.stdout


def test_a_folder_without_a_floor_is_refused(tmp_path):
    root = _copy(tmp_path)
    (root / "toolkit" / "extras").mkdir()
    (root / "toolkit" / "extras" / "__init__.py").write_text('"""a folder nobody placed"""\n')
    r = lint(root)
    assert r.returncode != 0
    assert "ctxq.extras" in r.stdout, r.stdout


def test_a_circle_inside_a_folder_is_refused(tmp_path):
    root = _copy(tmp_path)
    _append(root / "toolkit" / "planning" / "memory" / "costs.py", "from .. import checks")  # checks imports memory
    r = lint(root)
    assert r.returncode != 0
    assert "No cycles are allowed in ctxq.planning" in r.stdout, r.stdout
    assert "floors: each imports only the floors below it KEPT" in r.stdout
