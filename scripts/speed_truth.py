"""ctxq's speed estimate beside published GPU runs, in one table (issue 61; docs/speed-truth.md).

    .venv/bin/python scripts/speed_truth.py                 # prints the table
    .venv/bin/python scripts/speed_truth.py --write-doc     # and puts it into docs/speed-truth.md

Every row is a llama-bench figure someone posted (ctxq.testing.speed_truth: source, rig, setting); ctxq's estimate
runs on a header-only GGUF of the same geometry. tests/test_speed_truth.py holds the same rows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ctxq.testing import speed_truth as st

DOC = Path(__file__).resolve().parent.parent / "docs" / "speed-truth.md"
BEGIN, END = "<!-- speed-truth table: scripts/speed_truth.py --write-doc -->", "<!-- end of the table -->"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-doc", action="store_true", help=f"replace the table in {DOC.name}")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        held = st.hold(d)
    text = st.table(held)
    compared = [h for h in held if not h.row.why_not]
    rigs = {(h.row.card.name, h.row.n_cards) for h in compared}
    within = sum(1 for h in compared if h.within)
    summary = (f"{len(held)} rows, {len(compared)} compared over {len(rigs)} rigs: {within} within tolerance "
               f"(absolute +-{st.ABS_TOLERANCE:.0%}, ratios +-{st.RATIO_TOLERANCE:.0%}), "
               f"{len(held) - len(compared)} kept with the reason they are not compared")
    print(text + "\n\n" + summary)
    if a.write_doc:
        doc = DOC.read_text()
        head, _, rest = doc.partition(BEGIN)
        _, _, tail = rest.partition(END)
        DOC.write_text(f"{head}{BEGIN}\n{text}\n\n{summary}\n{END}{tail}")
    return 0 if within == len(compared) else 1


if __name__ == "__main__":
    sys.exit(main())
