"""The layout rules of docs/architecture.md that import-linter cannot state (its contracts, the floors and no circle
inside a folder, are checked by tests/test_layers.py): modules of at most 400 lines, a row of the stage table for
every folder of the package, serving in serve/ alone, and no import circle among scripts/ (import-linter sees
packages, and scripts/ is a folder of scripts)."""

from __future__ import annotations

import ast
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


def _script_imports(path: Path, scripts: set[str]) -> set[str]:
    """The other scripts/ modules `path` imports (`import NAME`, `from NAME import ...`), lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return (found & scripts) - {path.stem}


def _cycle_path(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as the path that walks it, back to where it starts (a, b, a); None if none."""
    state, path = {}, []  # state: "open" while on the path being walked, "done" once all below it is seen

    def visit(v):
        state[v] = "open"
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = "done"
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_scripts_import_each_other_one_way_only():
    paths = {p.stem: p for p in (ROOT / "scripts").glob("*.py")}
    graph = {name: _script_imports(path, set(paths)) for name, path in paths.items()}
    assert {"gpu_runs", "gpu_stages"} <= graph["gpu_check"]  # the walk sees real imports, lazy ones too
    assert "bench_run" in graph["gpu_runs"]
    cycle = _cycle_path(graph)
    assert cycle is None, f"scripts/ import each other in a circle: {' -> '.join(cycle)}"
    # a circle put back is found, and named as a path
    put_back = _cycle_path({**graph, "gpu_stages": graph["gpu_stages"] | {"gpu_check"}})
    assert put_back[0] == put_back[-1] and {"gpu_check", "gpu_stages"} <= set(put_back)
