"""Benchmark `ctxq convert` against llama.cpp's own `convert_hf_to_gguf.py` on the same checkpoint.

    python scripts/bench_convert.py [MODEL_DIR] [--type f32,f16] [--repeat 2] [--llama-src DIR]

MODEL_DIR defaults to SmolLM2-135M-Instruct rebuilt as a Hugging Face checkpoint (ctxq.testing.models).
llama.cpp's converter comes from the llama-cpp-python sdist of the installed version (fetched with
`pip download` into a temporary folder, never committed) unless --llama-src names an unpacked
llama.cpp. Each tool runs in its own process; wall time and peak RSS (wait4's ru_maxrss; this
parent stays small, so the inherited value does not matter) are the best of --repeat runs. Prints
both side by side with ctxq/llama.cpp ratios, and how many output tensors are byte-identical.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path


def fetch_llama_cpp_source(tmp: Path) -> Path:
    """The vendored llama.cpp of the installed llama-cpp-python's sdist, unpacked under tmp."""
    version = md.version("llama_cpp_python")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "-d", str(tmp), f"llama-cpp-python=={version}"], check=True)
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(wanted)]
        tar.extractall(tmp, members=members, filter="data")
    return next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))


def run(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace")
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.exit(f"{cmd[0]} failed ({p.returncode}):\n{err[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def same_tensors(a: Path, b: Path) -> tuple[int, int]:
    """Tensors with equal type and bytes, counted in a child process: reading the files here would
    grow this process, and children inherit its peak RSS in ru_maxrss."""
    out = subprocess.run([sys.executable, __file__, "--compare", str(a), str(b)], capture_output=True,
                         text=True, check=True).stdout.split()
    return int(out[0]), int(out[1])


def _compare(a: Path, b: Path) -> tuple[int, int]:
    import numpy as np
    from gguf import GGUFReader

    ra, rb = GGUFReader(a), GGUFReader(b)
    tb = {t.name: t for t in rb.tensors}
    same = sum(1 for t in ra.tensors if t.name in tb and t.tensor_type == tb[t.name].tensor_type
               and np.array_equal(np.asarray(t.data), np.asarray(tb[t.name].data)))
    return same, len(ra.tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="Hugging Face model folder (default: rebuilt SmolLM2-135M-Instruct)")
    ap.add_argument("--type", default="f32,f16", help="comma-separated output types (f32, f16, bf16, q8_0)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per tool and type; the best is kept")
    ap.add_argument("--llama-src", type=Path, help="an unpacked llama.cpp with convert_hf_to_gguf.py")
    ap.add_argument("--compare", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare:
        print(*_compare(*args.compare))
        return
    if args.model is None:  # in a child, so this process stays small (see same_tensors)
        args.model = subprocess.run([sys.executable, "-c", "from ctxq.testing.models import rebuild_smollm2_hf; "
                                     "print(rebuild_smollm2_hf())"], capture_output=True, text=True,
                                    check=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="bench_convert."))
    try:
        src = args.llama_src or fetch_llama_cpp_source(tmp)
        # llama.cpp's converter runs from a copy in the temporary folder, with its own gguf-py.
        work = tmp / "llama.cpp"
        if not work.exists():
            work.mkdir()
            for name in ("convert_hf_to_gguf.py", "conversion", "gguf-py"):
                (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, work / name)
        env = {**os.environ, "PYTHONPATH": str(work / "gguf-py")}
        ctxq_exe = str(Path(sys.executable).with_name("ctxq"))
        rows = []
        for kind in args.type.split(","):
            ours, theirs = tmp / f"ctxq-{kind}.gguf", tmp / f"llama-{kind}.gguf"
            best = {"ctxq": (1e9, 1 << 62), "llama.cpp": (1e9, 1 << 62)}
            for _ in range(args.repeat):  # alternate, so both see the same page cache
                w, r = run([sys.executable, str(work / "convert_hf_to_gguf.py"), args.model, "--outtype", kind,
                            "--outfile", str(theirs)], env=env, cwd=work)
                best["llama.cpp"] = (min(best["llama.cpp"][0], w), min(best["llama.cpp"][1], r))
                w, r = run([ctxq_exe, "convert", args.model, kind, "-o", str(ours), "--force"])
                best["ctxq"] = (min(best["ctxq"][0], w), min(best["ctxq"][1], r))
            same, n = same_tensors(ours, theirs)
            rows.append((kind, best, ours.stat().st_size, theirs.stat().st_size, same, n))
            ours.unlink()
            theirs.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"model: {args.model}  (best of {args.repeat} runs each)")
    print(f"{'type':<6} {'tool':<10} {'wall s':>8} {'peak RSS MiB':>13} {'output MiB':>11}")
    for kind, best, size_ours, size_theirs, same, n in rows:
        (wo, ro), (wt, rt) = best["ctxq"], best["llama.cpp"]
        print(f"{kind:<6} {'llama.cpp':<10} {wt:>8.2f} {rt / 2**20:>13.1f} {size_theirs / 2**20:>11.1f}")
        print(f"{kind:<6} {'ctxq':<10} {wo:>8.2f} {ro / 2**20:>13.1f} {size_ours / 2**20:>11.1f}")
        print(f"{kind:<6} {'ratio':<10} {wo / wt:>7.2f}x {ro / rt:>12.2f}x   "
              f"(targets: wall <= 1.0x, RSS <= 0.5x; {same}/{n} tensors byte-identical)")


if __name__ == "__main__":
    main()
