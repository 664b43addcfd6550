"""Layer and tensor mode, at several micro-batches, timed side by side on the same devices in one run (issue 44).

Each candidate is the plan `ctxq plan -sm MODE -ub N` makes for these options (in tensor mode, over every card and
over each subset the planner considers, `-dev` naming the cards kept), loaded in a child process and timed
as llama-bench times it (`ctxq bench`: -p prompt tokens in one batch, -n tokens generated one by one, at depth -d,
-r repetitions after a warm-up). The table gives tokens/s (mean ± sd) and each figure's ratio against the baseline,
layer mode at llama.cpp's default micro-batch (512), measured in the same run; then the total time of a workload
(--prompt-tokens of prefill and --gen-tokens of decoding at those rates) per candidate.

Here, without a GPU, the devices are local RPC workers (`--simulate`, CPU backends over loopback TCP); on a GPU
machine leave --simulate out and the cards present are used.

    .venv/bin/python scripts/bench_split.py                                  # SmolLM2, 2 workers, 4k
    .venv/bin/python scripts/bench_split.py MODEL --ctx 8192 --simulate 0.4,0.2 -ub 128,256,512,1024
    .venv/bin/python scripts/bench_split.py MODEL --ctx 65536 --simulate none    # the GPUs present
"""

from __future__ import annotations

import argparse
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    from ctxq.planning.options import PlanOptions
    from ctxq.runtime import bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="a GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--simulate", default="0.3,0.2", help="worker sizes in GiB, or `none` for the devices present")
    ap.add_argument("-ub", "--ubatch", default="128,256,512", help="micro-batches, e.g. 128,256,512,1024")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-d", "--n-depth", type=int, default=0)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="the workload's prefill (default: --ctx)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="the workload's generated tokens")
    ap.add_argument("--kv", default="f16")
    a = ap.parse_args(argv)
    ubs = tuple(int(x) for x in a.ubatch.split(","))
    if 512 not in ubs:
        ubs = (512, *ubs)  # the baseline's micro-batch, llama.cpp's default
    opts = PlanOptions(n_ctx=a.ctx, kv=a.kv, simulate=None if a.simulate == "none" else a.simulate)
    rows = bench.bench(a.model, opts, modes=bench.MODES, n_prompt=a.n_prompt, n_gen=a.n_gen, depth=a.n_depth,
                       reps=a.repetitions, ubatches=ubs, on_progress=lambda s: print(f"  {s}", file=sys.stderr))
    measured = [(m, p, r) for m, p, r in rows if not isinstance(r, str)]
    base = next(((p, r) for m, p, r in measured if m == "layer" and p.n_ubatch == 512), None)
    if base is None:
        print("the baseline (layer mode, -ub 512) could not be measured: "
              + "; ".join(r for m, _, r in rows if isinstance(r, str)), file=sys.stderr)
        return 1
    bp, br = base
    work_p = a.prompt_tokens or a.ctx
    print(f"{a.model or 'SmolLM2-135M-Instruct Q4_1'} at {a.ctx:,} tokens, KV {a.kv}, devices: "
          f"{', '.join(g.device.name for g in bp.gpus) or 'CPU'}; pp{a.n_prompt} and tg{a.n_gen} at depth "
          f"{a.n_depth}, {a.repetitions} repetitions; baseline: layer mode, -ub 512")
    head = f"{'mode':<7}{'-ts':>10}{'-ub':>6}{'pp t/s':>18}{'x base':>8}{'tg t/s':>16}{'x base':>8}{'workload s':>12}"
    print(head)
    for m, p, r in measured:
        total = work_p / r.pp + a.gen_tokens / r.tg if r.pp and r.tg else float("nan")
        ts = ",".join(map(str, p.tensor_split)) + (" -dev " + ",".join(p.llama_devices) if p.llama_devices else "")
        print(f"{m:<7}{ts:>10}{p.n_ubatch:>6}{_ms(r.pp_tps):>18}{r.pp / br.pp:>8.2f}"
              f"{_ms(r.tg_tps):>16}{r.tg / br.tg:>8.2f}{total:>12.1f}")
    for m, _, r in rows:
        if isinstance(r, str):
            print(f"{m}: not measured: {r}")
    print(f"(workload: {work_p:,} prompt tokens + {a.gen_tokens} generated, at the measured rates)")
    return 0


def _ms(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.1f} ± {sd:.1f}"


if __name__ == "__main__":
    sys.exit(main())
