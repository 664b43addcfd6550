"""llama.cpp's own tools (llama-server, llama-batched-bench, llama-imatrix), built once from the vendored sources.

The sources are those llama-cpp-python 0.3.36 vendors (`ctxq.conversion.upstream.source_dir()`), so
the tools run the same llama.cpp as ctxq. The build goes to `<ctxq home>/build/llama-tools-<key>/`
(key: version, CMake flags, this CPU's flags) and is reused; the binaries are static, each copied into `bin/`
under a temporary name and renamed when the build has finished, so a killed build leaves none half-made.
Nothing here is committed.

    .venv/bin/python scripts/llama_tools.py          # build (or find) them, print their folder
    .venv/bin/python scripts/llama_tools.py -j 1     # the same with one compile job (a shared machine)
    .venv/bin/python scripts/llama_tools.py -j 2 llama-imatrix   # only the tools named
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from ctxq.conversion.upstream import llama_cpp_python_version, source_dir
from ctxq.paths import ctxq_home

TARGETS = ("llama-server", "llama-batched-bench")  # the default set
KNOWN = (*TARGETS, "llama-imatrix")
# As scripts/setup.sh builds llama-cpp-python: native, without AMX code (its kernels crash here).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_args(cuda: bool) -> list[str]:
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
            # No network in the build: no web UI download (tools/ui), no HTTPS client.
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]
    if platform.machine() == "x86_64":
        args += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    if cuda:
        args += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native"]
    return args


def _home(cuda: bool) -> Path:
    args = cmake_args(cuda)
    cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "") \
        if Path("/proc/cpuinfo").exists() else platform.machine()
    key = hashlib.sha256("\n".join([llama_cpp_python_version(), *args, cpu]).encode()).hexdigest()[:16]
    return ctxq_home() / "build" / f"llama-tools-{key}"


def built(cuda: bool = False, targets: tuple[str, ...] = TARGETS) -> Path | None:
    """The folder holding the tools `targets` when they are built, else None."""
    bin_dir = _home(cuda) / "bin"
    return bin_dir if all((bin_dir / t).exists() for t in targets) else None


def build(cuda: bool = False, log=sys.stderr, jobs: int | None = None, targets: tuple[str, ...] = TARGETS) -> Path:
    """The folder holding the tools `targets` (default llama-server and llama-batched-bench); builds them on first
    use."""
    if built(cuda, targets) is not None:
        return built(cuda, targets)
    args, home = cmake_args(cuda), _home(cuda)
    bin_dir = home / "bin"
    src = source_dir(llama_cpp_python_version())
    work = home / "cmake"
    jobs = str(jobs or os.cpu_count() or 2)
    subprocess.run(["cmake", "-S", str(src), "-B", str(work), "-G", "Ninja", *args], check=True,
                   stdout=log, stderr=log)
    subprocess.run(["cmake", "--build", str(work), "-j", jobs, "--target", *targets], check=True,
                   stdout=log, stderr=log)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for t in targets:
        shutil.copy2(work / "bin" / t, bin_dir / f".{t}.partial")
        os.replace(bin_dir / f".{t}.partial", bin_dir / t)
    return bin_dir


if __name__ == "__main__":
    argv = sys.argv[1:]
    n_jobs = int(argv[argv.index("-j") + 1]) if "-j" in argv else None
    names = tuple(a for a in argv if a in KNOWN) or TARGETS
    print(build(cuda="--cuda" in argv, jobs=n_jobs, targets=names))
