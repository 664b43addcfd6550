"""Package discovery for ctxq (everything else is in pyproject.toml).

The import name `ctxq` maps to three folders (toolkit/, converters/, profiles/), which
pyproject.toml's `packages.find` cannot express: it names packages after their folders. Here
every package under each folder is found, so a new subpackage ships without a hand-kept list
(tests/test_package.py checks the built wheel against the source tree).
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {"ctxq": "toolkit", "ctxq.converters": "converters", "ctxq.profiles": "profiles"}


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIRS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(found)


setup(package_dir=PACKAGE_DIRS, packages=packages())
