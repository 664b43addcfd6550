#!/usr/bin/env bash
# Print the root of a CUDA toolkit that llama.cpp's CMake (FindCUDAToolkit) can build ggml-cuda with,
# assembling one when the installed toolkit lacks parts (issue 23, shared/NOTES-llama-cpp.md):
#
#   - nvcc: $CUDACXX, $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc or the one on PATH;
#   - cuBLAS (headers, libcublas, libcublasLt): the toolkit's, else PyPI's `nvidia-cublas` wheel of the
#     same major version;
#   - the CUDA runtime (libcudart): the toolkit's, else PyPI's `nvidia-cuda-runtime` wheel;
#   - libcuda.so (ggml-cuda links CUDA::cuda_driver for its VMM pool): the toolkit's stub or the
#     driver's library, else a link-time stand-in built here. The stand-in only satisfies the linker
#     (soname libcuda.so.1, the driver functions ggml-cuda calls); at run time the loader takes the
#     real libcuda.so.1 of the NVIDIA driver, and it is never installed anywhere.
#
# When the toolkit is complete its own root is printed. Otherwise the merged root is a folder of
# symlinks under ${XDG_CACHE_HOME:-~/.cache}/ctxq/cuda/<nvcc version>/root (the wheels are installed
# beside it, in site/), reused by later calls. Progress goes to stderr, the root alone to stdout.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
say() { echo "cuda_toolkit: $*" >&2; }
die() { say "$*"; exit 1; }

# --- nvcc and the toolkit it belongs to -------------------------------------------------------
nvcc=""
for c in "${CUDACXX:-}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
    [ -n "$c" ] && [ -x "$c" ] && { nvcc="$c"; break; }
done
[ -n "$nvcc" ] || die "no nvcc found (set CUDA_HOME or CUDACXX, or put nvcc on PATH)"
# nvcc may be a wrapper script: its dry run names the real toolkit (`#$ TOP=<root>/bin/..`).
top="$({ "$nvcc" -dryrun /dev/null 2>&1 || true; } | sed -n 's/^#\$ TOP=//p' | head -n 1)"
tk="$(cd "${top:-$(dirname "$nvcc")/..}" && pwd -P)"
version="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
major="${version%%.*}"
[ -n "$major" ] || die "cannot read nvcc's version"
arch_dir="targets/$(uname -m)-linux"
say "nvcc $version in $tk"

has() {  # has DIR PATTERN: a file matching PATTERN in DIR's lib folders
    local d
    for d in "$1"/lib64 "$1"/lib "$1/$arch_dir"/lib "$1"/lib64/stubs "$1/$arch_dir"/lib/stubs; do
        compgen -G "$d/$2" >/dev/null && return 0
    done
    return 1
}
need_cublas=0; need_cudart=0; need_driver=0
has "$tk" 'libcublas.so' && compgen -G "$tk/include/cublas_v2.h" >/dev/null || need_cublas=1
has "$tk" 'libcudart.so' || need_cudart=1
has "$tk" 'libcuda.so' || need_driver=1
if [ $need_cublas = 0 ] && [ $need_cudart = 0 ] && [ $need_driver = 0 ]; then
    echo "$tk"; exit 0
fi

cache="${XDG_CACHE_HOME:-$HOME/.cache}/ctxq/cuda/$version"
root="$cache/root"
want="$tk $need_cublas $need_cudart $need_driver"
if [ "$(cat "$cache/.done" 2>/dev/null)" = "$want" ] && [ -x "$root/bin/nvcc" ]; then
    echo "$root"; exit 0
fi

# --- the wheels (PyPI), installed once into $cache/site ----------------------------------------
site="$cache/site"
pkgs=()
[ $need_cublas = 1 ] && pkgs+=("nvidia-cublas==$major.*")
[ $need_cudart = 1 ] && pkgs+=("nvidia-cuda-runtime==$major.*")
if [ ${#pkgs[@]} -gt 0 ]; then
    say "installing ${pkgs[*]} into $site (cuBLAS is a ~450 MB download)"
    "$PYTHON" -m pip install -q --no-deps --upgrade --target "$site" "${pkgs[@]}" >&2 \
        || die "pip could not install ${pkgs[*]}"
fi
wheel="$site/nvidia/cu$major"

# --- the driver library's link-time stand-in ---------------------------------------------------
if [ $need_driver = 1 ]; then
    drv="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')"
    mkdir -p "$cache/stub"
    if [ -n "$drv" ]; then
        ln -sfn "$drv" "$cache/stub/libcuda.so"
    else
        say "no libcuda.so: building a link-time stand-in (soname libcuda.so.1)"
        # The driver functions ggml-cuda calls (grep '\bcu[A-Z]\w+(' ggml/src/ggml-cuda); cuda.h's
        # macros give each its versioned symbol name. Each fails with CUDA_ERROR_STUB_LIBRARY, as
        # the toolkit's own stub does; the real driver library replaces it at run time.
        cat > "$cache/libcuda-stub.c" <<'EOF'
#include <cuda.h>
#define STUB return CUDA_ERROR_STUB_LIBRARY;
CUresult CUDAAPI cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "stub"; STUB }
CUresult CUDAAPI cuDeviceGet(CUdevice *d, int i) { (void)d; (void)i; STUB }
CUresult CUDAAPI cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) { (void)v; (void)a; (void)d; STUB }
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr p, size_t n) { (void)p; (void)n; STUB }
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t a, CUdeviceptr addr,
                                     unsigned long long f) { (void)p; (void)n; (void)a; (void)addr; (void)f; STUB }
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *p,
                             unsigned long long f) { (void)h; (void)n; (void)p; (void)f; STUB }
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p,
                                               CUmemAllocationGranularity_flags o) { (void)g; (void)p; (void)o; STUB }
CUresult CUDAAPI cuMemMap(CUdeviceptr p, size_t n, size_t o, CUmemGenericAllocationHandle h,
                          unsigned long long f) { (void)p; (void)n; (void)o; (void)h; (void)f; STUB }
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle h) { (void)h; STUB }
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr p, size_t n, const CUmemAccessDesc *d, size_t c) { (void)p; (void)n; (void)d; (void)c; STUB }
CUresult CUDAAPI cuMemUnmap(CUdeviceptr p, size_t n) { (void)p; (void)n; STUB }
EOF
        cc -shared -fPIC -O1 -Wall -Werror -Wl,-soname,libcuda.so.1 -I"$tk/include" ${wheel:+-I"$wheel/include"} \
            -o "$cache/stub/libcuda.so.1" "$cache/libcuda-stub.c" || die "cannot build the libcuda stand-in"
        ln -sfn libcuda.so.1 "$cache/stub/libcuda.so"
    fi
fi

# --- the merged root: the toolkit's folders, plus the wheels' headers and libraries ------------
rm -rf "$root.tmp" && mkdir -p "$root.tmp"
merge() {  # merge DEST SRC...: DEST gets a symlink to each entry of each SRC, the first one winning
    local dest="$1" src e; shift
    mkdir -p "$dest"
    for src in "$@"; do
        [ -d "$src" ] || continue
        for e in "$src"/*; do
            [ -e "$dest/${e##*/}" ] || ln -s "$e" "$dest/${e##*/}"
        done
    done
}
for e in "$tk"/*; do
    case "${e##*/}" in include|lib|lib64|targets) ;; *) ln -s "$e" "$root.tmp/${e##*/}" ;; esac
done
inc="$root.tmp/$arch_dir/include"; lib="$root.tmp/$arch_dir/lib"
merge "$root.tmp/$arch_dir" "$tk/$arch_dir"
rm -f "$inc" "$lib"
merge "$inc" "$tk/$arch_dir/include" "$tk/include" "${wheel:+$wheel/include}"
merge "$lib" "$tk/$arch_dir/lib" "$tk/lib64" "$tk/lib" "${wheel:+$wheel/lib}"
ln -s "$arch_dir/include" "$root.tmp/include"
ln -s "$arch_dir/lib" "$root.tmp/lib64"
ln -s "$arch_dir/lib" "$root.tmp/lib"
# The wheels ship only versioned names (libcublas.so.13); find_library wants the plain .so.
for f in "$lib"/lib*.so.*; do
    plain="${f##*/}"; plain="${plain%%.so.*}.so"
    [ -e "$lib/$plain" ] || ln -s "${f##*/}" "$lib/$plain"
done
if [ $need_driver = 1 ]; then
    rm -rf "$lib/stubs" && merge "$lib/stubs" "$tk/$arch_dir/lib/stubs" "$cache/stub"
fi
rm -rf "$root" && mv "$root.tmp" "$root"
echo "$want" > "$cache/.done"
say "toolkit root $root"
echo "$root"
