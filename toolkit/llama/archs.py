"""Which architectures llama.cpp runs in tensor mode (`-sm tensor`), asked of the libllama ctxq is linked with.

llama.cpp refuses tensor mode per architecture in `llama_model_create` (src/llama-model.cpp: "LLAMA_SPLIT_MODE_TENSOR
not implemented for architecture 'X'") through `llm_arch_supports_sm_tensor` (src/llama-arch.cpp). Both that function
and `llm_arch_name` are exported by libllama (C++ symbols), so ctxq calls them through ctypes for every value of the
`llm_arch` enum, up to LLM_ARCH_UNKNOWN (named "(unknown)"): the answer is the build's own, for whatever version is
installed, never a list typed from one version's source. Pure functions of an enum: nothing is loaded, no state
touched. A build that does not export them (another C++ ABI) answers None; the caller then says it cannot tell.
"""

from __future__ import annotations

import ctypes
import functools

# Itanium C++ ABI names (GCC, Clang): llm_arch_name(llm_arch), llm_arch_supports_sm_tensor(const llm_arch &)
_NAME = "_Z13llm_arch_name8llm_arch"
_SUPPORTS = "_Z27llm_arch_supports_sm_tensorRK8llm_arch"
_UNKNOWN = "(unknown)"  # LLM_ARCH_NAMES has no entry for LLM_ARCH_UNKNOWN: llm_arch_name's fallback
_MAX = 4096  # a bound on the enum, should the fallback name ever change


@functools.lru_cache(maxsize=1)
def tensor_mode_support() -> dict[str, bool] | None:
    """{architecture name: whether llama.cpp runs it in tensor mode} for every architecture this libllama knows, or
    None when the build does not export the two functions."""
    from .backend import llama_cpp

    lib = llama_cpp().llama_cpp._lib
    try:
        name = getattr(lib, _NAME)
        supports = getattr(lib, _SUPPORTS)
    except AttributeError:
        return None
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    supports.restype, supports.argtypes = ctypes.c_bool, [ctypes.POINTER(ctypes.c_int)]
    out: dict[str, bool] = {}
    for i in range(_MAX):
        got = name(i)
        arch = got.decode() if got else _UNKNOWN
        if arch == _UNKNOWN:
            break
        out[arch] = bool(supports(ctypes.byref(ctypes.c_int(i))))
    return out


def refuses_tensor_mode(arch: str) -> bool | None:
    """True when llama.cpp refuses tensor mode for `arch`, False when it does not, None when this build cannot say
    (the functions are not exported, or the architecture is unknown to it)."""
    table = tensor_mode_support()
    if table is None or arch not in table:
        return None
    return not table[arch]
