"""The CUDA wheel `CTXQ_CUDA=1 make setup` builds (issue 23), on a machine without the NVIDIA driver.

It is built with GGML_BACKEND_DL, so libggml-cuda.so is a module that needs the driver's libcuda.so.1
to load: here it cannot, and ctxq must still import, say so in one line and run on the CPU. CI does
not compile CUDA (34+ minutes), so these tests skip where the cached CUDA wheel is absent."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest

from .test_package import _run, ctxq, dist, setup_cache, user_venv  # noqa: F401  (dist is a fixture)

pytestmark = pytest.mark.slow

NO_CUDA = "CUDA build, no CUDA device visible"


def cuda_wheel() -> Path | None:
    """The newest cached llama-cpp-python wheel that holds the CUDA backend."""
    found = []
    for w in (setup_cache() / "wheels").glob("*/llama_cpp_python-*.whl"):
        with zipfile.ZipFile(w) as z:
            if "llama_cpp/lib/libggml-cuda.so" in z.namelist():
                found.append(w)
    return max(found, key=lambda w: w.stat().st_mtime, default=None)


def nvidia_site() -> Path | None:
    """Where scripts/cuda_toolkit.sh installed PyPI's nvidia-cublas wheel (cuBLAS for the build)."""
    return next(iter(sorted((setup_cache() / "cuda").glob("*/site/nvidia"))), None)


@pytest.fixture(scope="module")
def the_cuda_wheel() -> Path:
    wheel = cuda_wheel()
    if wheel is None:
        pytest.skip(f"no cached CUDA llama-cpp-python wheel under {setup_cache() / 'wheels'}: "
                    "build it with `CTXQ_CUDA=1 make setup` (docs/gpu.md)")
    return wheel


@pytest.fixture(scope="module")
def cuda_venv(the_cuda_wheel, dist, tmp_path_factory, smollm2) -> dict:  # noqa: F811  (before dist: skip first)
    wheel = the_cuda_wheel
    inst = user_venv(tmp_path_factory.mktemp("cuda"), [dist["wheel"], wheel], smollm2)
    inst["wheel"] = wheel
    return inst


def _with_cublas(inst) -> None:
    """Make PyPI's nvidia-cublas importable in the venv (a .pth line), as `pip install nvidia-cublas`
    would: ctxq preloads cuBLAS from it, so the driver library is the only thing missing."""
    site = nvidia_site()
    if site is None:
        pytest.skip("nvidia-cublas is not installed under ~/.cache/ctxq/cuda (scripts/cuda_toolkit.sh)")
    purelib = _run([inst["py"], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=inst["cwd"], env=inst["env"]).stdout.strip()
    Path(purelib, "nvidia-cublas.pth").write_text(f"{site.parent}\n")


def test_cuda_wheel_imports_and_doctor_says_one_line(cuda_venv):
    assert _run([cuda_venv["py"], "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                cwd=cuda_venv["cwd"], env=cuda_venv["env"]).stdout.strip() == "0.3.36"
    out = ctxq(cuda_venv, "doctor").stdout
    assert "build: CUDA yes, RPC yes" in out, out
    lines = [line for line in out.splitlines() if NO_CUDA in line]
    assert len(lines) == 1 and lines[0].startswith(NO_CUDA), out
    assert re.search(r"^  CPU\s+cpu", out, re.M), out  # the CPU backend module loaded


def test_missing_driver_is_named(cuda_venv):
    _with_cublas(cuda_venv)
    r = ctxq(cuda_venv, "doctor", "--json")
    d = json.loads(r.stdout)  # cuBLAS came from the wheel: only the driver library is missing
    assert d["features"]["cuda"] and d["features"]["rpc"] and "libcuda.so.1" in d["module_errors"]["cuda"]
    assert d["cuda_unavailable"].startswith(NO_CUDA)
    assert [g["type"] for g in d["ggml_devices"]] == ["cpu"]
    # NCCL is read from the module's file, loaded or not (issue 44): as readelf sees it
    c = d["cuda_comm"]
    needed = _run(["readelf", "-d", c["library"]], cwd=cuda_venv["cwd"]).stdout
    assert c["library"].endswith("/llama_cpp/lib/libggml-cuda.so") and c["needed"]
    assert c["nccl"] == ("[libnccl.so" in needed) and c["allreduce"] in ("nccl", "internal", "butterfly")
    out = ctxq(cuda_venv, "doctor").stdout
    assert re.search(r"^  NCCL          (linked|not built in)", out, re.M), out


def test_run_falls_back_to_the_cpu_in_one_line(cuda_venv):
    r = ctxq(cuda_venv, "run", "--ctx", "512", "-n", "4", "--temp", "0", "-p", "The capital of France is")
    said = [line for line in r.stderr.splitlines() if NO_CUDA in line]
    assert len(said) == 1 and said[0].startswith(f"ctxq: {NO_CUDA}"), r.stderr
    assert said[0].endswith("; running on the CPU"), said
    assert r.stdout.strip() and re.search(r"generated [1-4] tokens", r.stderr), r.stderr


def test_rpc_module_serves_a_simulated_run(cuda_venv):
    """The RPC backend is a module in this build too: local workers and the client both load it."""
    r = ctxq(cuda_venv, "run", "--ctx", "512", "-n", "4", "--temp", "0", "--simulate", "1,1",
             "-p", "The capital of France is", timeout=300)
    assert "RPC" in r.stderr and r.stdout.strip(), r.stderr


def test_toolkit_root_builds_and_links_cublas_and_the_driver_stand_in(tmp_path):
    """scripts/cuda_toolkit.sh's merged root, where it was made, used as CMake uses it for ggml-cuda
    (-isystem ROOT/include, the libraries from ROOT/lib64): nvcc compiles a file that includes cuBLAS
    from the PyPI wheel and links cuBLAS and libcuda (the stand-in, soname libcuda.so.1)."""
    roots = sorted((setup_cache() / "cuda").glob("*/root"))
    if not roots:
        pytest.skip("no merged CUDA toolkit under ~/.cache/ctxq/cuda (scripts/cuda_toolkit.sh makes it)")
    root = roots[-1]
    src = tmp_path / "t.cu"
    src.write_text("#include <cublas_v2.h>\n#include <cuda.h>\n"
                   "int main() { cublasHandle_t h; CUdevice d;\n"
                   "  return (int) cublasCreate(&h) + (int) cuDeviceGet(&d, 0); }\n")
    exe = tmp_path / "t"
    _run([root / "bin" / "nvcc", "-arch=sm_90", f"-isystem={root}/include", src, "-o", exe,
          f"-L{root}/lib64", f"-L{root}/lib64/stubs", "-lcublas", "-lcuda"],
         cwd=tmp_path, timeout=300)
    needed = _run(["readelf", "-d", exe], cwd=tmp_path).stdout
    assert "[libcublas.so.13]" in needed or "[libcublas.so.12]" in needed, needed
    assert "[libcuda.so.1]" in needed, needed
