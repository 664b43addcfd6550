"""`ctxq run -f DOC` with several questions against as many single runs (issue 29: "well under the time
of 4 single runs, with the same answers").

Both sides are the real command line, each a new process (the model loads in each):
- single: `ctxq run -f DOC --chat -p Q --temp 0 -n N --json`, once per question;
- together: `ctxq run -f DOC --chat -p Q1 -p Q2 ... --temp 0 -n N --json`: the document evaluated once,
  the questions forked from it and their answers decoded together.
It prints the wall time of each side, the prompt tokens each evaluated and how many answers agree.

    .venv/bin/python scripts/bench_run_many.py [--tokens 2000] [--questions 4] [-n 32] [--ctx 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_session import document  # scripts/ is on the path of a script run from it

from ctxq.models import fetch_default_model

QUESTIONS = ["Which city does the text mention first?", "Is a river mentioned? Answer yes or no.",
             "Name one colour in the text.", "What is the text about, in five words?",
             "Which season does the text describe?", "Name an object in the text.",
             "Is the tone happy or sad?", "Give the text a title."]
def ctxq(*args: str) -> tuple[float, object]:
    exe = str(Path(sys.executable).with_name("ctxq"))
    t = time.perf_counter()
    r = subprocess.run([exe, *args], capture_output=True, text=True, env={**os.environ, "CTXQ_DEBUG": ""})
    wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"ctxq {' '.join(args[:4])} ... failed: {r.stderr.strip()}")
    return wall, json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="document size in tokens")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("-n", type=int, default=32, help="tokens to generate per answer")
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    model = fetch_default_model()
    qs = QUESTIONS[:args.questions]
    doc_path = Path(tempfile.mkdtemp(prefix="ctxq-bench-many-")) / "doc.txt"
    doc_path.write_text(document(model, args.tokens))
    common = ["-f", str(doc_path), "--chat", "--temp", "0", "-n", str(args.n), "--ctx", str(args.ctx), "--json"]

    singles, single_wall, single_eval = [], 0.0, 0
    for q in qs:
        wall, out = ctxq("run", *common, "-p", q)
        singles.append(out["text"])
        single_wall += wall
        single_eval += out["n_prompt"] - out["n_cached"]
    wall_many, many = ctxq("run", *common, *[a for q in qs for a in ("-p", q)])
    many_eval = many[0]["n_document"] + sum(a["prompt_tokens"] - a["cached_tokens"] for a in many)
    same = sum(a["text"] == s for a, s in zip(many, singles))
    print(f"{Path(model).name}: a {many[0]['n_document']:,}-token document, {len(qs)} questions, "
          f"{args.n} tokens each (greedy), --ctx {args.ctx}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'':26}{'wall s':>9}{'prompt tokens evaluated':>26}")
    print(f"{f'{len(qs)} single runs':26}{single_wall:9.1f}{single_eval:26,}")
    print(f"{'one run, ' + str(len(qs)) + ' questions':26}{wall_many:9.1f}{many_eval:26,}")
    print(f"together / single: {wall_many / single_wall:.2f} of the time; answers equal: {same} of {len(qs)}")


if __name__ == "__main__":
    main()
