"""What each KV-cache pair costs, measured by `ctxq quality` (issue 37 item 5), and ctxq's measurement side by
side with llama.cpp's own, `llama-perplexity --kl-divergence-base FILE` then `--kl-divergence`.

Part 1: `ctxq quality` on the default model (SmolLM2-135M-Instruct Q4_1) and the built-in text at --ctx tokens
(and at --long tokens when given), every pair on the command line: mean KL, p99 KL, top-1 agreement, perplexity,
KV bytes per token and their share of f16's, and the time of each pass.

Part 2: for the --compare pairs, the same model, text, context, cache types, flash attention, batch sizes and
threads through llama-perplexity: first the f16 reference's full-vocabulary log-probabilities written to a file
(--kl-divergence-base), then each candidate against it. llama-perplexity cuts the text into windows of -c tokens
(it needs at least two), starts each window afresh with BOS and scores its second half; ctxq reads the first -c
tokens once and scores their second half. So llama-perplexity's first window is ctxq's pass, position for position
(checked: the tokens stored in its file against ctxq's), and its per-window line after window 1 gives the same
positions' figures; its summary covers every window. Times are wall seconds of each pass (process start to exit
for llama-perplexity; planning, load and evaluation in a child process for ctxq), file sizes as on disk.

llama-perplexity is built from the llama.cpp that llama-cpp-python vendors (the sdist of the installed version,
fetched with `pip download`, or --source DIR), with scripts/llama_tools.py's CMake flags, in a temporary folder
(--build-dir keeps it for the next run). ctxq runs in a temporary CTXQ_HOME, each pair's plan made once
beforehand so that no pass pays for the planner's first dry runs. Nothing is committed.

    .venv/bin/python scripts/bench_quality.py                        # 8,192 tokens, the ten default pairs
    .venv/bin/python scripts/bench_quality.py --long 16384           # and 16,384 tokens
    .venv/bin/python scripts/bench_quality.py f16 q8_0 q8_0/q4_0 --compare q8_0 --lp-ctx 4096
    .venv/bin/python scripts/bench_quality.py --compare none         # part 1 only
    .venv/bin/python scripts/bench_quality.py --full-vocab [--ctx 1024]   # part 3 only

Part 3 (--full-vocab): `ctxq quality` against an independent full-vocabulary computation on the same tokens, at the
context tests/test_quality.py held until issue 64 (1,024 tokens; 73 s of the suite on a loaded machine, which now
holds the same claims at 512). The reference is plain llama-cpp-python (`Llama(..., logits_all=True)`, in this
process) and numpy's softmax over the whole vocabulary. On SmolLM2 (f16, q4_0/q4_0, q8_0/q4_0): f16/f16 exactly 0 and
top-1 1, perplexity within 0.5 %; per quantized pair mean KL within 5 %, p99 within 10 %, top-1 within half a point,
perplexity within 0.5 %; the pairs' losses ordered as their bytes. On OLMo 3 (a random checkpoint, llama.cpp's
converter; near-uniform distributions) q4_0/q4_0: mean KL within 5 % and top-1 within half a point. Each claim that
fails is printed as `CLAIM FAILED: ...` and the script ends with status 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_tools  # noqa: E402

DEFAULT_PAIRS = ("f16/f16 q8_0/q8_0 q8_0/q5_1 q8_0/q5_0 q8_0/q4_0 q5_1/q5_1 q5_0/q5_0 q4_1/q4_1 iq4_nl/iq4_nl "
                 "q4_0/q4_0").split()
N_BATCH, N_UBATCH = 2048, 512  # ctxq's plan defaults (planning/options.py), passed to llama-perplexity as -b/-ub


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- llama-perplexity, built from the vendored source

def fetch_source(version: str, tmp: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python `version` sdist, downloaded from PyPI and unpacked under `tmp`."""
    log(f"fetching the llama-cpp-python {version} sdist from PyPI")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "-d", str(tmp), f"llama-cpp-python=={version}"], check=True)
    archive = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, members=[m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"],
                       filter="data")
    return next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))


def build_perplexity(source: Path | None, build_dir: Path, jobs: int) -> Path:
    """llama-perplexity, built once in `build_dir` (reused when it is already there)."""
    binary = build_dir / "cmake" / "bin" / "llama-perplexity"
    if binary.exists():
        return binary
    from ctxq.conversion.upstream import llama_cpp_python_version

    if source is None or not source.is_dir():
        source = fetch_source(llama_cpp_python_version(), build_dir / "sdist")
    log(f"building llama-perplexity from {source} in {build_dir} ({jobs} jobs; minutes)")
    t0 = time.perf_counter()
    with open(build_dir / "build.log", "wb") as out:
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir / "cmake"), "-G", "Ninja",
                        *llama_tools.cmake_args(cuda=False)], check=True, stdout=out, stderr=out)
        subprocess.run(["cmake", "--build", str(build_dir / "cmake"), "-j", str(jobs), "--target", "llama-perplexity"],
                       check=True, stdout=out, stderr=out)
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return binary


CHUNK = re.compile(r"^\s*(\d+)\s+([\d.]+) ±\s+[\d.]+\s+(-?[\d.]+) ±\s+[\d.]+\s+(-?[\d.]+) ±\s+[\d.]+\s+"
                   r"([\d.]+) ±\s+[\d.]+ %\s+([\d.]+) ±\s+[\d.]+ %", re.M)


def _num(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else None


def perplexity_run(binary: Path, model: Path, n_ctx: int, threads: int, type_k: str, type_v: str, base: Path,
                   text: Path | None, logs: Path, chunks: int | None = None) -> dict:
    """One llama-perplexity pass: the base (with `text`) or a candidate against `base`; its figures and wall time."""
    cmd = [str(binary), "-m", str(model), "-c", str(n_ctx), "-b", str(N_BATCH), "-ub", str(N_UBATCH),
           "-ctk", type_k, "-ctv", type_v, "-fa", "on", "-t", str(threads), "--kl-divergence-base", str(base)]
    cmd += ["-f", str(text)] if text is not None else ["--kl-divergence"]
    cmd += ["--chunks", str(chunks)] if chunks else []
    label = "base" if text is not None else f"{type_k}-{type_v}"
    log(f"llama-perplexity {label}: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (logs / f"llama-perplexity-{label}.log").write_text(out.stdout + out.stderr)
    both = out.stdout + "\n" + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"llama-perplexity {label} failed ({out.returncode}): {both[-1500:]}")
    r = {"seconds": wall, "cmd": cmd, "windows": int(_num(r"(?:computing|calculating perplexity) over (\d+) chunks",
                                                          both) or 0)}
    if text is not None:  # [1]12.3456,[2]... running estimates; "Final estimate: PPL = x +/- y"
        r["ppl"] = _num(r"Final estimate: PPL = ([\d.]+)", both)
        if r["ppl"] is None or not base.exists():
            raise SystemExit(f"llama-perplexity {label}: no final estimate: {both[-1500:]}")
        r["ppl_window1"] = _num(r"\[1\]([\d.]+)", both)
        r["bytes"] = base.stat().st_size
        return r
    windows = CHUNK.findall(both)  # cumulative over the windows read so far: the first is window 1 alone
    if not windows:
        raise SystemExit(f"llama-perplexity {label}: no per-window lines in its output: {both[-1500:]}")
    w1 = windows[0]
    r.update(ppl=_num(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", both), ppl_base=_num(r"Mean PPL\(base\)\s*:\s*([\d.]+)", both),
             mean_kl=_num(r"Mean\s+KLD:\s*(-?[\d.]+)", both), p99_kl=_num(r"99\.0%\s+KLD:\s*(-?[\d.]+)", both),
             top1=_num(r"Same top p:\s*([\d.]+)", both) / 100,
             w1={"ppl": float(w1[1]), "mean_kl": float(w1[3]), "top1": float(w1[5]) / 100})
    return r


def base_tokens(base: Path) -> tuple[int, int, np.ndarray]:
    """(n_ctx, windows, tokens) from a --kl-divergence-base file: "_logits_", n_ctx u32, n_vocab i32, n_chunk i32,
    then the n_chunk * n_ctx tokens (tools/perplexity/perplexity.cpp, perplexity())."""
    with open(base, "rb") as f:
        assert f.read(8) == b"_logits_"
        n_ctx, _n_vocab, n_chunk = struct.unpack("<Iii", f.read(12))
        toks = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32)
    return n_ctx, n_chunk, toks


# ------------------------------------------------------------------------------------------------ ctxq quality

def ctxq_measure(model: Path, n_ctx: int, pairs: list[tuple[str, str]], home: Path) -> tuple[dict, Path]:
    """`ctxq quality` at n_ctx on the built-in text, f16/f16 first (so its time is the reference pass's): {pair:
    Result} and the reference file it keeps (CTXQ_HOME/quality/ref-*.npz). Measured again at a context already
    measured, the cached results (and their times) come back."""
    import ctxq
    from ctxq import quality

    order = [("f16", "f16")] + [p for p in pairs if p != ("f16", "f16")]
    for tk, tv in order:  # the planner's first dry runs, outside the timed passes
        ctxq.plan(str(model), n_ctx, type_k=tk, type_v=tv)

    def progress(label, done, total):
        if done == total or done % 4096 == 0:
            log(f"  ctxq {label}: {done:,}/{total:,} tokens")

    t0 = time.perf_counter()
    got = {r.pair: r for r in quality.measure(model, quality.Measurement(n_ctx=n_ctx, progress=progress), order)}
    log(f"ctxq quality at {n_ctx:,}: {len(order)} configurations in {time.perf_counter() - t0:.0f} s")
    refs = [p for p in (home / "quality").glob("ref-*.npz") if _ref_len(p) == n_ctx]
    return got, refs[0]


def _ref_len(path: Path) -> int:
    with np.load(path) as z:
        return len(z["tokens"])


def part1_table(results: list, f16_bytes: int) -> str:
    rows = ["| K/V | KV bytes/token | % of f16 | mean KL | p99 KL | top-1 | PPL | time s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        rows.append(f"| {r.pair} | {r.bytes:,} | {r.bytes / f16_bytes * 100:.1f} % | {r.mean_kl:.5f} | "
                    f"{r.p99_kl:.4f} | {r.top1_agreement * 100:.2f} % | {r.ppl:.4f} | {r.seconds:.1f} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------- the run

def parse_pair(spec: str) -> tuple[str, str]:
    from ctxq.quality import parse_pairs

    return parse_pairs(spec)[0]


def _builtin_tokens(model, n: int) -> list[int]:
    from llama_cpp import Llama

    from ctxq import quality

    llm = Llama(str(model), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(quality.builtin_text(), add_bos=True)[:n]
    finally:
        llm.close()


def full_vocab(n_ctx: int) -> int:
    """Part 3: ctxq quality against plain llama-cpp-python and numpy over the whole vocabulary; 1 if a claim failed."""
    from ctxq import quality
    from ctxq.models import fetch_default_model
    from ctxq.quality import stats
    from ctxq.testing import upstream_models
    from ctxq.testing.full_vocab import full_logprobs

    failed = []

    def claim(what: str, ok: bool) -> None:
        if not ok:
            failed.append(what)

    def compare(name, model, n, pairs):
        t0 = time.perf_counter()
        got = {r.pair: r for r in quality.measure(model, quality.Measurement(n_ctx=n), quality.parse_pairs(pairs))}
        tokens = _builtin_tokens(model, n)
        scored = slice(n // 2, n - 1)  # each position predicts the next token
        targets = np.array(tokens[n // 2 + 1:])
        ref = full_logprobs(model, tokens, "f16", "f16")
        ppl_ref = float(np.exp(-ref[scored][np.arange(len(targets)), targets].mean()))
        print(f"\n## {name}, {n:,} tokens, positions {n // 2:,}-{n - 2:,} scored\n")
        print("| pair | ctxq mean KL | full mean KL | ctxq p99 | full p99 | ctxq top-1 | full top-1 | ctxq ppl | full ppl |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        if "f16/f16" in got:
            r = got["f16/f16"]
            print(f"| f16/f16 | {r.mean_kl:.6f} | 0 | {r.p99_kl:.6f} | 0 | {r.top1_agreement:.4f} | 1 | {r.ppl:.4f} "
                  f"| {ppl_ref:.4f} |")
            claim(f"{name} f16/f16: KL 0 and top-1 1", r.mean_kl == 0 and r.top1_agreement == 1)
            claim(f"{name} f16/f16: perplexity within 0.5 %", abs(r.ppl / ppl_ref - 1) <= 0.005)
        for pair, r in got.items():
            if pair == "f16/f16":
                continue
            cand = full_logprobs(model, tokens, *pair.split("/"))
            kl = stats.full_kl(ref[scored], cand[scored])
            top1 = float((ref[scored].argmax(1) == cand[scored].argmax(1)).mean())
            ppl = float(np.exp(-cand[scored][np.arange(len(targets)), targets].mean()))
            p99 = float(np.percentile(kl, 99))
            print(f"| {pair} | {r.mean_kl:.6f} | {kl.mean():.6f} | {r.p99_kl:.6f} | {p99:.6f} | {r.top1_agreement:.4f} "
                  f"| {top1:.4f} | {r.ppl:.4f} | {ppl:.4f} |")
            claim(f"{name} {pair}: {r.n_scored} positions scored, {len(kl)} expected", r.n_scored == len(kl))
            claim(f"{name} {pair}: mean KL {r.mean_kl:.6f} within 5 % of {kl.mean():.6f}",
                  abs(r.mean_kl / kl.mean() - 1) <= 0.05)
            claim(f"{name} {pair}: top-1 {r.top1_agreement:.4f} within 0.005 of {top1:.4f}",
                  abs(r.top1_agreement - top1) <= 0.005)
            if name == "SmolLM2":
                claim(f"{name} {pair}: p99 {r.p99_kl:.6f} within 10 % of {p99:.6f}", abs(r.p99_kl / p99 - 1) <= 0.10)
                claim(f"{name} {pair}: perplexity {r.ppl:.4f} within 0.5 % of {ppl:.4f}", abs(r.ppl / ppl - 1) <= 0.005)
        print(f"\n({time.perf_counter() - t0:.0f} s)")
        return got

    smol = compare("SmolLM2", fetch_default_model(), n_ctx, "f16,q4_0,q8_0/q4_0")
    claim("SmolLM2: 0 < KL(q8_0/q4_0) < KL(q4_0/q4_0)", 0 < smol["q8_0/q4_0"].mean_kl < smol["q4_0/q4_0"].mean_kl)
    claim("SmolLM2: bytes(q8_0/q4_0) > bytes(q4_0/q4_0)", smol["q8_0/q4_0"].bytes > smol["q4_0/q4_0"].bytes)
    try:
        olmo = upstream_models.build("olmo3")
    except upstream_models.NotBuildable as e:
        print(f"\nOLMo 3 not measured: llama.cpp's converter cannot build it here ({e})")
    else:
        compare("OLMo 3", olmo, n_ctx, "q4_0")
    for what in failed:
        print(f"CLAIM FAILED: {what}", flush=True)
    return 1 if failed else 0


def main() -> None:
    if "--full-vocab" in sys.argv[1:]:
        ap = argparse.ArgumentParser(description="part 3: against the full vocabulary")
        ap.add_argument("--full-vocab", action="store_true")
        ap.add_argument("--ctx", type=int, default=1024)
        sys.exit(full_vocab(ap.parse_args().ctx))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="*", default=DEFAULT_PAIRS,
                    help="K/V pairs, e.g. q8_0/q4_0, or q8_0 for both (default: the ten of issue 37)")
    ap.add_argument("--ctx", type=int, default=8192, help="the context of part 1 (and of part 2 unless --lp-ctx)")
    ap.add_argument("--long", type=int, default=None, help="also measure every pair at this context (e.g. 16384)")
    ap.add_argument("--compare", default="q8_0/q8_0,q4_0/q4_0",
                    help="pairs to measure with llama-perplexity as well; none: skip part 2")
    ap.add_argument("--lp-ctx", type=int, default=None, help="the context of part 2 (default --ctx)")
    ap.add_argument("--lp-chunks", type=int, default=None,
                    help="llama-perplexity's --chunks: read only this many windows (default: the whole text)")
    ap.add_argument("--source", type=Path, default=None,
                    help="an unpacked vendor/llama.cpp to build from; absent: the sdist from PyPI")
    ap.add_argument("--build-dir", type=Path, default=None, help="build llama-perplexity here and keep it")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2, help="compile jobs")
    a = ap.parse_args()

    from ctxq import quality
    from ctxq.models import fetch_default_model
    from ctxq.quality.measurement import kv_bytes_per_token
    from ctxq.units import default_threads

    model = Path(fetch_default_model())  # from the usual cache, before CTXQ_HOME moves
    pairs = [parse_pair(p) for spec in a.pairs for p in spec.split(",") if p]
    compare = [] if a.compare == "none" else [parse_pair(p) for p in a.compare.split(",")]
    lp_ctx = a.lp_ctx or a.ctx
    threads = default_threads()  # what ctxq quality's passes use (quality/measurement.py), given to llama-perplexity
    work = Path(tempfile.mkdtemp(prefix="ctxq-bench-quality-"))
    home = work / "home"
    os.environ["CTXQ_HOME"] = str(home)  # ctxq's caches for this run only: every figure measured now
    started = datetime.datetime.now()
    try:
        text = work / "licences.txt"
        text.write_bytes(quality.builtin_text())
        binary = None
        if compare:  # the build first: it fails early rather than after the measurements
            build_dir = a.build_dir or work / "build"
            build_dir.mkdir(parents=True, exist_ok=True)
            binary = build_perplexity(a.source, build_dir, a.jobs)

        f16_bytes = kv_bytes_per_token(str(model), "f16", "f16")
        measured, refs, tables = {}, {}, []
        for n in [a.ctx] + ([a.long] if a.long else []):
            t0 = time.perf_counter()
            measured[n], refs[n] = ctxq_measure(model, n, pairs, home)
            res = [measured[n][f"{k}/{v}"] for k, v in pairs]
            tables.append((n, part1_table(res, f16_bytes), time.perf_counter() - t0, res[0].n_scored))

        lp = None
        if compare:
            got, refs[lp_ctx] = ctxq_measure(model, lp_ctx, compare, home)  # cached when part 1 measured them
            measured.setdefault(lp_ctx, {}).update(got)
            lp = perplexity_side(binary, model, lp_ctx, threads, compare, text, work, refs[lp_ctx], a.lp_chunks)
        report(model, tables, measured, refs, lp, lp_ctx, compare, threads, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def perplexity_side(binary: Path, model: Path, n_ctx: int, threads: int, compare, text: Path, work: Path,
                    ref: Path, chunks: int | None) -> dict:
    """llama-perplexity's base pass and one pass per pair; whether its window 1 holds ctxq's tokens."""
    from llama_cpp import Llama

    base = work / f"base-{n_ctx}.kld"
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    lp = {"base": perplexity_run(binary, model, n_ctx, threads, "f16", "f16", base, text, logs, chunks)}
    for k, v in compare:
        lp[f"{k}/{v}"] = perplexity_run(binary, model, n_ctx, threads, k, v, base, None, logs, chunks)
    n_ctx_file, lp["windows"], toks = base_tokens(base)
    with np.load(ref) as z:
        lp["same_tokens"] = bool(n_ctx_file == n_ctx and np.array_equal(toks[:n_ctx], z["tokens"]))
    vocab = Llama(str(model), vocab_only=True, verbose=False)
    try:  # as both tools tokenize: BOS first, no special tokens parsed
        lp["text_tokens"] = len(vocab.tokenize(text.read_bytes(), add_bos=True, special=False))
    finally:
        vocab.close()
    base.unlink()
    return lp


def report(model, tables, by_ctx, refs, lp, lp_ctx, compare, threads, started) -> None:
    argv = " ".join(["scripts/bench_quality.py", *sys.argv[1:]])
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    print(f"# .venv/bin/python {argv}")
    print(f"# {started:%Y-%m-%d %H:%M}, {model.name}, built-in text (licences), {threads} threads, {cpu}, "
          f"load average {os.getloadavg()[0]:.1f} at the end\n")
    for n, table, wall, n_scored in tables:
        print(f"## ctxq quality, {n:,} tokens: positions {n // 2:,}-{n - 2:,} scored ({n_scored:,}), "
              f"against an f16 cache ({wall:.0f} s in all; f16/f16's time is the reference pass)\n")
        print(table + "\n")
    if not lp:
        return
    ref_bytes = refs[lp_ctx].stat().st_size
    base = lp["base"]
    windows = lp["windows"]
    half = lp_ctx - 1 - lp_ctx // 2  # positions scored per window, by both tools
    ctxq_f16 = by_ctx[lp_ctx]["f16/f16"]
    print(f"## ctxq quality against llama-perplexity --kl-divergence, {lp_ctx:,}-token context\n")
    print(f"The text: {lp['text_tokens']:,} tokens. "
          f"llama-perplexity: {windows} windows of {lp_ctx:,} tokens ({windows * lp_ctx:,} tokens read), "
          f"positions {lp_ctx // 2:,}-{lp_ctx - 2:,} of each scored: {windows * half:,}; ctxq: the first "
          f"{lp_ctx:,} tokens, {half:,} scored. Window 1 holds the same tokens as ctxq's pass: "
          f"{'yes' if lp['same_tokens'] else 'NO'}. -c {lp_ctx} -b {N_BATCH} -ub {N_UBATCH} -fa on -t {threads}.\n")
    rows = ["| | ctxq quality | llama-perplexity, window 1 | llama-perplexity, all windows | ratio ctxq / llama-perplexity |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| positions scored | {half:,} | {half:,} | {windows * half:,} | |",
            f"| reference (f16) PPL | {ctxq_f16.ppl:.4f} | {base['ppl_window1']:.4f} | {base['ppl']:.4f} | |",
            f"| reference pass, s | {ctxq_f16.seconds:.1f} | | {base['seconds']:.1f} | "
            f"{ctxq_f16.seconds / base['seconds']:.2f} ({ctxq_f16.seconds / (base['seconds'] / windows):.2f} per window) |",
            f"| reference file, bytes | {ref_bytes:,} | | {base['bytes']:,} | "
            f"{ref_bytes / base['bytes']:.4f} ({ref_bytes / (base['bytes'] / windows):.4f} per window) |"]
    for k, v in compare:
        pair = f"{k}/{v}"
        c, r = by_ctx[lp_ctx][pair], lp[pair]
        rows += [f"| **{pair}** mean KL | {c.mean_kl:.5f} | {r['w1']['mean_kl']:.5f} | {r['mean_kl']:.6f} | "
                 f"{c.mean_kl / r['w1']['mean_kl']:.3f} (window 1) |" if r["w1"]["mean_kl"] else
                 f"| **{pair}** mean KL | {c.mean_kl:.5f} | {r['w1']['mean_kl']:.5f} | {r['mean_kl']:.6f} | |",
                 f"| {pair} p99 KL | {c.p99_kl:.4f} | | {r['p99_kl']:.4f} | |",
                 f"| {pair} top-1 (\"Same top p\") | {c.top1_agreement * 100:.2f} % | {r['w1']['top1'] * 100:.2f} % | "
                 f"{r['top1'] * 100:.2f} % | |",
                 f"| {pair} PPL | {c.ppl:.4f} | {r['w1']['ppl']:.4f} | {r['ppl']:.4f} | |",
                 f"| {pair} candidate pass, s | {c.seconds:.1f} | | {r['seconds']:.1f} | {c.seconds / r['seconds']:.2f} "
                 f"({c.seconds / (r['seconds'] / windows):.2f} per window) |"]
    total_ctxq = ctxq_f16.seconds + sum(by_ctx[lp_ctx][f"{k}/{v}"].seconds for k, v in compare)
    total_lp = base["seconds"] + sum(lp[f"{k}/{v}"]["seconds"] for k, v in compare)
    rows.append(f"| reference + {len(compare)} candidates, s | {total_ctxq:.1f} | | {total_lp:.1f} | "
                f"{total_ctxq / total_lp:.2f} ({total_ctxq / (total_lp / windows):.2f} per window) |")
    print("\n".join(rows))
    print(f"\nllama-perplexity's times are whole processes (load, warm-up, every window); per window: that time "
          f"divided by {windows}. Its KL figures are printed to 5 (window 1) and 6 (summary) decimals.")


if __name__ == "__main__":
    main()
