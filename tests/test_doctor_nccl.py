"""`ctxq doctor`'s multi-GPU lines (issue 44): NCCL read from the CUDA backend's ELF file, GGML_CUDA_ALLREDUCE and
GGML_CUDA_P2P as llama.cpp reads them, and scripts/nccl.sh, which tells `CTXQ_CUDA=1 make setup` whether to build
with NCCL. No GPU and no CUDA build here: the ELF reader runs on llama-cpp-python's own libraries and on small
libraries built with the system compiler, one of them linked against a stub libnccl.so.2."""

from __future__ import annotations

import ctypes.util
import json
import shlex
import shutil
import struct
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from ctxq.llama import backend, cuda_comm as cc, doctor, elf

from .conftest import run_ctxq

ROOT = Path(__file__).resolve().parent.parent
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build test libraries")


# --- the ELF reader --------------------------------------------------------------------------------

def test_elf_reads_llama_cpp_python_libraries():
    lib = backend.lib_dir()
    d = elf.dynamic(lib / "libllama.so.0")
    assert d.soname == "libllama.so.0" and d.runpath == ["$ORIGIN"]
    assert {"libggml.so.0", "libggml-base.so.0", "libc.so.6", "libstdc++.so.6"} <= set(d.needed), d.needed
    assert "libc.so.6" in elf.dynamic(lib / "libggml-base.so.0").needed
    if shutil.which("readelf"):  # the same list readelf prints, file for file, in its order
        for f in sorted(lib.glob("*.so.0")):
            out = subprocess.run(["readelf", "-d", f], capture_output=True, text=True, check=True).stdout
            want = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
            assert elf.dynamic(f).needed == want, f


def test_elf_refuses_what_is_not_one(tmp_path):
    (tmp_path / "text").write_text("not an ELF file\n")
    cut = tmp_path / "cut.so"
    cut.write_bytes((backend.lib_dir() / "libllama.so.0").read_bytes()[:100])
    for path, said in ((tmp_path / "text", "is not an ELF file"), (cut, "truncated"),
                       (tmp_path / "absent.so", "cannot read")):
        with pytest.raises(elf.ElfError, match=said):
            elf.dynamic(path)


def test_elf_32_bit_big_endian(tmp_path):
    """A minimal ELF32 MSB file made here: one PT_LOAD at 0x10000 mapping the whole file, a PT_DYNAMIC whose
    string table address goes through that mapping."""
    strtab = b"\0libnccl.so.2\0libc.so.6\0libx.so.1\0/opt/a:/opt/b\0"
    ph_off, dyn_off = 52, 52 + 2 * 32
    dyn = [(1, 1), (1, 14), (14, 24), (15, 34), (5, 0)]  # NEEDED x2, SONAME, RPATH, STRTAB (patched below)
    str_off = dyn_off + 8 * (len(dyn) + 1)
    dyn[-1] = (5, 0x10000 + str_off)
    body = b"".join(struct.pack(">iI", t, v) for t, v in dyn + [(0, 0)]) + strtab
    size = str_off + len(strtab)
    header = b"\x7fELF\x01\x02\x01" + bytes(9) + struct.pack(">HHIIIIIHHHHHH", 3, 20, 1, 0, ph_off, 0, 0, 52, 32,
                                                             2, 40, 0, 0)
    phdrs = struct.pack(">8I", 1, 0, 0x10000, 0x10000, size, size, 5, 4096) + \
        struct.pack(">8I", 2, dyn_off, 0x10000 + dyn_off, 0, 8 * (len(dyn) + 1), 0, 6, 4)
    f = tmp_path / "be32.so"
    f.write_bytes(header + phdrs + body)
    assert elf.dynamic(f) == elf.Dynamic(needed=["libnccl.so.2", "libc.so.6"], soname="libx.so.1",
                                         runpath=["/opt/a", "/opt/b"])
    assert cc.nccl_soname(elf.dynamic(f).needed) == "libnccl.so.2"


# --- a CUDA backend stand-in, built here ---------------------------------------------------------------

def _cc(*args) -> None:
    subprocess.run(["cc", *map(str, args)], check=True, capture_output=True, timeout=120)


def _backend(folder: Path, source: str, *link) -> Path:
    """folder/libggml-cuda.so built from `source` (C), linked with `link`."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "ggml_cuda.c"
    src.write_text(source)
    out = folder / "libggml-cuda.so"
    _cc("-shared", "-fPIC", src, "-o", out, *link)
    return out


def _message(text: bytes) -> str:
    return f'__attribute__((used)) const char * ggml_msg = "{text.decode()}";\n'


@pytest.fixture(scope="module")
def stub_nccl(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("nccl")
    (d / "nccl.c").write_text("int ncclCommInitAll(void * c, int n, const int * d) { return 0; }\n")
    _cc("-shared", "-fPIC", d / "nccl.c", "-o", d / "libnccl.so.2", "-Wl,-soname,libnccl.so.2")
    return d


@needs_cc
def test_nccl_linked_is_read_from_dt_needed(stub_nccl, tmp_path):
    src = _message(cc._WITH_NCCL) + "int ncclCommInitAll(void *, int, const int *);\n" \
        "int ggml_cuda_comm(void) { return ncclCommInitAll(0, 2, 0); }\n"
    lib = _backend(tmp_path / "lib", src, f"-L{stub_nccl}", "-l:libnccl.so.2", "-Wl,-rpath,$ORIGIN")
    assert "libnccl.so.2" in elf.dynamic(lib).needed and cc.cuda_library(lib.parent) == lib
    c = cc.cuda_comm(lib.parent, n_gpus=3, environ={})
    assert (c.nccl, c.nccl_soname) == (True, "libnccl.so.2")
    if ctypes.util.find_library("nccl") is None:  # not beside the library, not in the system: not found
        assert c.nccl_found is False and "libnccl.so.2" in c.nccl_error
    shutil.copy(stub_nccl / "libnccl.so.2", lib.parent)  # beside it: found through RUNPATH $ORIGIN
    c = cc.cuda_comm(lib.parent, n_gpus=3, environ={})
    assert c.nccl_found is True and c.nccl_error is None
    assert c.allreduce == "nccl" and c.allreduce_why.startswith("llama.cpp's default on Linux")
    assert c.peer_access is True and "NCCL enables peer access" in c.peer_access_why


@needs_cc
def test_nccl_absent_or_static(tmp_path):
    plain = _backend(tmp_path / "plain", _message(cc._WITHOUT_NCCL))
    c = cc.cuda_comm(plain.parent, n_gpus=2, environ={"GGML_CUDA_P2P": "0"})
    assert (c.nccl, c.nccl_soname, c.nccl_found) == (False, None, None)
    assert c.allreduce == "internal" and "NCCL is not compiled in" in c.allreduce_why
    assert c.peer_access is True and "only checks that it is set" in c.peer_access_why
    c = cc.cuda_comm(plain.parent, n_gpus=5, environ={"GGML_CUDA_ALLREDUCE": "nccl"})
    assert c.allreduce == "butterfly" and "exactly 2 cards (5 here)" in c.allreduce_why and c.peer_access is False
    static = _backend(tmp_path / "static", _message(cc._WITH_NCCL))  # NCCL's code inside: no DT_NEEDED entry
    c = cc.cuda_comm(static.parent, environ={})
    assert (c.nccl, c.nccl_soname, c.allreduce) == (True, None, "nccl")


@pytest.mark.parametrize("value, nccl, n, method, said", [
    (None, True, 4, "nccl", "llama.cpp's default on Linux, NCCL"),
    ("nccl", False, 2, "internal", "NCCL is not compiled in"),
    ("internal", True, 2, "internal", "the internal all-reduce"),
    ("internal", True, 3, "butterfly", "exactly 2 cards (3 here)"),
    ("none", True, 2, "butterfly", "none: the meta backend's generic all-reduce"),
    ("NCCL", True, 2, "butterfly", "unknown GGML_CUDA_ALLREDUCE value\" and uses none"),  # compared case-sensitively
    ("", True, 2, "butterfly", "is not one of nccl|internal|none"),
])
def test_allreduce_as_llama_cpp_chooses(value, nccl, n, method, said):
    got, why = cc.allreduce(value, nccl, n)
    assert got == method and said in why, why
    assert cc.allreduce(None, nccl, 2, linux=False)[0] == "internal"  # not Linux: internal by default


def test_peer_access_needs_only_the_variable_to_be_set():
    assert cc.peer_access(None, False)[0] is False and "GGML_CUDA_P2P=1" in cc.peer_access(None, False)[1]
    assert cc.peer_access("1", False) == (True, cc.peer_access("1", True)[1])
    on, why = cc.peer_access("off", False)
    assert on and "'off'" in why and "only checks that it is set" in why


# --- doctor ----------------------------------------------------------------------------------------------

def test_doctor_says_cuda_absent_here():
    env = {"GGML_CUDA_ALLREDUCE": "bogus", "GGML_CUDA_P2P": "1"}
    d = json.loads(run_ctxq("doctor", "--json", env=env).stdout)
    c = d["cuda_comm"]
    assert set(c) >= {"library", "needed", "nccl", "nccl_soname", "nccl_found", "allreduce_env", "allreduce",
                      "allreduce_why", "p2p_env", "peer_access", "peer_access_why"}
    if d["features"]["cuda"]:
        pytest.skip("this llama-cpp-python has a CUDA backend: the no-CUDA answer does not apply")
    assert c["library"] is None and c["nccl"] is False and c["allreduce"] is None
    assert (c["allreduce_env"], c["p2p_env"]) == ("bogus", "1") and "'bogus' is not one of" in c["allreduce_why"]
    r = run_ctxq("doctor", env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith("multi-GPU")]
    assert lines == ["multi-GPU: no CUDA backend in this build, so no NCCL, all-reduce or peer access "
                     "(GGML_CUDA_ALLREDUCE=bogus, GGML_CUDA_P2P=1: no effect)"], r.stdout
    if not d["nvidia_gpus"]:
        assert sum(line.startswith("NVIDIA GPUs: none (") for line in r.stdout.splitlines()) == 1, r.stdout


@needs_cc
def test_doctor_lines_for_a_cuda_backend(stub_nccl, tmp_path, capsys):
    from ctxq.cli.info import _multi_gpu

    src = _message(cc._WITH_NCCL) + "int ncclCommInitAll(void *, int, const int *);\n" \
        "int f(void) { return ncclCommInitAll(0, 2, 0); }\n"
    lib = _backend(tmp_path, src, f"-L{stub_nccl}", "-l:libnccl.so.2", "-Wl,-rpath,$ORIGIN")
    shutil.copy(stub_nccl / "libnccl.so.2", tmp_path)
    _multi_gpu(cc.cuda_comm(lib.parent, n_gpus=2, environ={"GGML_CUDA_ALLREDUCE": "internal"}))
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "  NCCL          linked (libnccl.so.2, found by the loader)", out
    assert out[2].startswith("  all-reduce    internal (GGML_CUDA_ALLREDUCE 'internal'): the internal"), out
    assert out[3].startswith("  peer access   on: GGML_CUDA_P2P unset, but with NCCL"), out


def test_peer_facts_in_nvidia_smi_words():
    """NVML's answers (a stand-in for the driver library, which this machine lacks) as doctor words them."""
    nvml = SimpleNamespace(NVML_P2P_CAPS_INDEX_READ=0, NVML_P2P_CAPS_INDEX_WRITE=1, NVML_P2P_STATUS_OK=0,
                           NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED=1, NVML_TOPOLOGY_HOSTBRIDGE=30,
                           nvmlDeviceGetP2PStatus=lambda a, b, cap: {0: 0, 1: 1}[cap],
                           nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 30)
    assert doctor.peer_facts(nvml, "a", "b") == {"p2p_read": "ok", "p2p_write": "chipset not supported",
                                                 "topology": "PHB"}
    del nvml.nvmlDeviceGetTopologyCommonAncestor  # an older nvidia-ml-py: unknown, not an error
    assert doctor.peer_facts(nvml, "a", "b")["topology"] is None


# --- scripts/nccl.sh: where `CTXQ_CUDA=1 make setup` finds NCCL -----------------------------------------

def _nccl_sh(home: Path | None, call: str = "nccl_find", **env) -> dict:
    env = {"PATH": "/usr/bin:/bin:/sbin", **env, **({"CTXQ_NCCL_HOME": str(home)} if home else {})}
    script = f'source scripts/nccl.sh; {call}; rc=$?; ' \
        'printf "%s\\n" "$rc" "$NCCL_INCLUDE_DIR" "$NCCL_LIBRARY" "$NCCL_WHY" "${NCCL_CMAKE_ARGS:-}" "${NCCL_SAID:-}"'
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    keys = ("rc", "include", "library", "why", "cmake_args", "said")
    return dict(zip(keys, out.stdout.split("\n")))


def test_nccl_found_under_ctxq_nccl_home(tmp_path):
    home = tmp_path / "my nccl"  # a space in the path: the CMake arguments stay whole
    (home / "include").mkdir(parents=True)
    (home / "include" / "nccl.h").write_text("/* stand-in */\n")
    (home / "lib").mkdir()
    (home / "lib" / "libnccl.so.2").write_bytes(b"")
    got = _nccl_sh(home)
    assert (got["rc"], got["include"], got["library"]) == ("0", f"{home}/include", f"{home}/lib/libnccl.so.2")
    (home / "lib" / "libnccl.so").write_bytes(b"")  # the -dev symlink's name wins: it is what CMake looks for
    got = _nccl_sh(home, "nccl_cmake_args")
    assert shlex.split(got["cmake_args"]) == ["-DGGML_CUDA_NCCL=ON", f"-DNCCL_INCLUDE_DIR={home}/include",
                                              f"-DNCCL_LIBRARY={home}/lib/libnccl.so"]
    assert got["said"].startswith(f"NCCL found ({home}/lib/libnccl.so, ") and "LD_LIBRARY_PATH" in got["said"]


def test_nccl_missing_parts_are_named(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "nccl.h").write_text("")
    got = _nccl_sh(tmp_path)
    assert got["rc"] == "1" and got["why"] == f"no libnccl.so under {tmp_path} (CTXQ_NCCL_HOME)"
    (tmp_path / "include" / "nccl.h").unlink()
    got = _nccl_sh(tmp_path, "nccl_cmake_args")
    assert got["cmake_args"] == "-DGGML_CUDA_NCCL=OFF" and got["why"].startswith("no nccl.h/libnccl.so under")
    assert got["said"].startswith("NCCL not found (no nccl.h/libnccl.so") and "GGML_CUDA_NCCL=OFF" in got["said"]


@pytest.mark.skipif(ctypes.util.find_library("nccl") is not None, reason="this machine has NCCL installed")
def test_nccl_found_where_the_loader_cache_says(tmp_path):
    """No CTXQ_NCCL_HOME: the library ldconfig -p lists (an ldconfig stand-in on PATH; the real one lists none
    here), the header under NCCL_ROOT; a library in the loader's cache needs no LD_LIBRARY_PATH."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "sys").mkdir()
    (tmp_path / "sys" / "libnccl.so.2").write_bytes(b"")
    (tmp_path / "root" / "include").mkdir(parents=True)
    (tmp_path / "root" / "include" / "nccl.h").write_text("")
    fake = tmp_path / "bin" / "ldconfig"
    fake.write_text("#!/bin/sh\necho '1 libs found in cache'\n"
                    f"printf '\\tlibnccl.so.2 (libc6,x86-64) => {tmp_path}/sys/libnccl.so.2\\n'\n")
    fake.chmod(0o755)
    got = _nccl_sh(None, "nccl_cmake_args", PATH=f"{tmp_path}/bin:/usr/bin:/bin", NCCL_ROOT=str(tmp_path / "root"))
    assert (got["rc"], got["library"]) == ("0", f"{tmp_path}/sys/libnccl.so.2"), got
    assert got["include"] == f"{tmp_path}/root/include" and "LD_LIBRARY_PATH" not in got["said"], got
