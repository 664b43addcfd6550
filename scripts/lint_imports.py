"""import-linter's contracts (pyproject.toml, [tool.importlinter]) checked on ctxq as the wheel lays it out.

The import name `ctxq` spans three folders (toolkit/, converters/ and profiles/, mapped by setup.py), and
import-linter finds a package's modules by walking one folder, so the check runs on a copy of the three put
together the way they install (`ctxq/`, `ctxq/converters/`, `ctxq/profiles/`), in a temporary folder.

    .venv/bin/python scripts/lint_imports.py                 # this checkout; `make test` runs it first
    .venv/bin/python scripts/lint_imports.py --root OTHER    # another tree (tests/test_layers.py breaks a copy)

Exit status: lint-imports' own (0: every contract kept).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the folders of the import name, as setup.py's PACKAGE_DIRS maps them
FOLDERS = {"toolkit": "ctxq", "converters": "ctxq/converters", "profiles": "ctxq/profiles"}


def assemble(root: Path, dest: Path) -> Path:
    """Copy the Python files of `root`'s three folders into `dest` as the installed package; `dest`."""
    for folder, target in FOLDERS.items():
        for src in (root / folder).rglob("*.py"):
            out = dest / target / src.relative_to(root / folder)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)
    return dest


def lint(root: Path = ROOT) -> subprocess.CompletedProcess:
    """lint-imports with `root`'s pyproject.toml on `root`'s package; output captured."""
    with tempfile.TemporaryDirectory(prefix="ctxq-lint-") as tmp:
        tree = assemble(root, Path(tmp))
        # the copy first on the path: the editable install's finder only answers what the path does not
        env = {**os.environ, "PYTHONPATH": str(tree)}
        code = ("import sys; from importlinter.cli import lint_imports; "
                "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")
        return subprocess.run([sys.executable, "-c", code, str(root / "pyproject.toml")], cwd=tree, env=env,
                              capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the source tree (default: this checkout)")
    r = lint(ap.parse_args(argv).root.resolve())
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
