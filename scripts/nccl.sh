# Where NCCL is, for llama.cpp's CUDA build (issue 44): sourced by scripts/setup.sh and scripts/gpu_check.sh.
#
# nccl_find sets NCCL_INCLUDE_DIR (the folder of nccl.h) and NCCL_LIBRARY (libnccl.so, else libnccl.so.N) and
# returns 0, or sets NCCL_WHY (what is missing, where it looked) and returns 1. It looks in CTXQ_NCCL_HOME only,
# when that is set (include/, lib/ or lib64/ under it); otherwise where the loader's cache (ldconfig -p) has
# libnccl, then NCCL_ROOT, CUDA_HOME, /usr/local/cuda, /usr and /usr/local, as llama.cpp's FindNCCL.cmake
# (ggml/cmake/) and the linker's default paths do. The build is then given both paths
# (-DNCCL_INCLUDE_DIR, -DNCCL_LIBRARY: FindNCCL takes them as found), so CMake uses what this found.
nccl_find() {
    NCCL_INCLUDE_DIR="" NCCL_LIBRARY="" NCCL_WHY=""
    local roots=() libs=() d f lib
    if [ -n "${CTXQ_NCCL_HOME:-}" ]; then
        roots=("$CTXQ_NCCL_HOME")
    else
        roots=(${NCCL_ROOT:+"$NCCL_ROOT"} ${CUDA_HOME:+"$CUDA_HOME"} /usr/local/cuda /usr /usr/local)
        # the loader's own answer first: a libnccl it lists is one the built library will load
        lib="$( (ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null) \
            | awk '$1 ~ /^libnccl\.so(\.[0-9]+)*$/ {print $NF}' | sort)"
        lib="${lib%%$'\n'*}"  # the first (sorted: libnccl.so before libnccl.so.2), without cutting the pipe
        [ -n "$lib" ] && libs+=("$lib")
    fi
    for d in "${roots[@]}"; do
        for f in "$d"/{lib,lib64,lib/x86_64-linux-gnu,lib/aarch64-linux-gnu}/libnccl.so \
                 "$d"/{lib,lib64,lib/x86_64-linux-gnu,lib/aarch64-linux-gnu}/libnccl.so.[0-9]*; do
            [ -f "$f" ] && libs+=("$f")
        done
        [ -z "$NCCL_INCLUDE_DIR" ] && [ -f "$d/include/nccl.h" ] && NCCL_INCLUDE_DIR="$d/include"
    done
    # libnccl.so (the -dev symlink) before a versioned file: that is the name CMake's find_library wants
    for f in "${libs[@]}"; do
        case "$f" in */libnccl.so) NCCL_LIBRARY="$f"; break ;; esac
    done
    [ -z "$NCCL_LIBRARY" ] && [ "${#libs[@]}" -gt 0 ] && NCCL_LIBRARY="${libs[0]}"
    if [ -n "$NCCL_INCLUDE_DIR" ] && [ -n "$NCCL_LIBRARY" ]; then
        return 0
    fi
    local missing=()
    [ -z "$NCCL_INCLUDE_DIR" ] && missing+=(nccl.h)
    [ -z "$NCCL_LIBRARY" ] && missing+=(libnccl.so)
    NCCL_WHY="no $(IFS=/; echo "${missing[*]}") under ${roots[*]}${CTXQ_NCCL_HOME:+ (CTXQ_NCCL_HOME)}"
    NCCL_INCLUDE_DIR="" NCCL_LIBRARY=""
    return 1
}

# nccl_cmake_args: the CMake flags for the CUDA build, in NCCL_CMAKE_ARGS (quoted for CMAKE_ARGS), and one line
# for the user in NCCL_SAID. GGML_CUDA_NCCL is ON by default upstream, with its own search: OFF is said
# explicitly so that the build is the one this line describes.
nccl_cmake_args() {
    if nccl_find; then
        NCCL_CMAKE_ARGS="-DGGML_CUDA_NCCL=ON '-DNCCL_INCLUDE_DIR=$NCCL_INCLUDE_DIR' '-DNCCL_LIBRARY=$NCCL_LIBRARY'"
        NCCL_SAID="NCCL found ($NCCL_LIBRARY, $NCCL_INCLUDE_DIR/nccl.h): building with GGML_CUDA_NCCL=ON"
        local dir="${NCCL_LIBRARY%/*}" cache
        cache="$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)"  # whole: grep -q would cut a pipe
        if [[ "$cache" != *"=> $dir/libnccl"* && ":${LD_LIBRARY_PATH:-}:" != *":$dir:"* ]]; then
            NCCL_SAID="$NCCL_SAID; the loader does not search $dir: add it to LD_LIBRARY_PATH to run (ctxq doctor checks)"
        fi
    else
        NCCL_CMAKE_ARGS="-DGGML_CUDA_NCCL=OFF"
        NCCL_SAID="NCCL not found ($NCCL_WHY): building with GGML_CUDA_NCCL=OFF; tensor split mode then"
        NCCL_SAID="$NCCL_SAID all-reduces without it (install NCCL or set CTXQ_NCCL_HOME; docs/cuda.md)"
    fi
}
