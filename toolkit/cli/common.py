"""Formatting shared by the commands: units appear only here, at the edge."""

from __future__ import annotations

import json

import click

from .. import interrupts
from ..units import GiB, MiB


def gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


def mib(n: int | float) -> str:
    return f"{n / MiB:.1f} MiB"


def human(n: int | float) -> str:
    return gib(n) if abs(n) >= GiB else mib(n)


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain text table, right-aligning cells that look like numbers."""
    cols = [header] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]

    def fmt(r):
        out = []
        for i, c in enumerate(r):
            c = str(c)
            numeric = c[:1].isdigit() or c[:1] == "-" and c[1:2].isdigit()
            out.append(c.rjust(widths[i]) if numeric and i else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def memory_table(memory) -> str:
    """Planned against reported bytes per device (`runtime.generate.DeviceMemory` rows). A host row whose
    llama.cpp figure holds a mapped file range (experts in host memory) is marked, and a note under the
    table says what each side counts, so its difference does not read as a planning error."""
    rows = [[m.name + (" *" if m.mapped else ""), human(m.planned), human(m.reported),
             f"{(m.reported - m.planned) / m.planned * 100:+.0f}%" if m.planned else "-"] for m in memory]
    out = table(rows, ["device", "planned", "llama.cpp", "diff"])
    for m in memory:
        if m.mapped:
            out += (f"\n* {m.name} compares two things: planned, the host's resident tensors ({human(m.tensors)}); "
                    f"llama.cpp, its mapped range\n  (CPU_Mapped, {human(m.mapped)}): the file from the first host "
                    "tensor to the last, device layers' tensors between them included")
    return out


def reexec(value: str) -> None:
    """Start this command again with the GPUs in the plan's order: CUDA reads CUDA_VISIBLE_DEVICES
    only once per process (`ReorderNeeded.value`; `runner.reorder_env` is the handshake)."""
    import os
    import sys

    from ..runtime.runner import reorder_env

    click.echo(f"ctxq: reordering the GPUs: CUDA_VISIBLE_DEVICES={value}", err=True)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-c", "from ctxq.cli import main; main()", *sys.argv[1:]],
              {**os.environ, **reorder_env(value)})


class Bars:
    """tqdm bars from the library's progress callback: one bar per phase ("write:" bytes,
    "quantize:" tensors, "convert:" the one step of llama.cpp's converter), a new bar whenever the phase changes."""

    def __init__(self):
        self.bar = None
        self.phase = None

    def __call__(self, done: int, total: int, what: str = "") -> None:
        with interrupts.held():  # a tqdm stopped inside its __init__ prints a traceback from __del__ at exit
            self._draw(done, total, what)

    def _draw(self, done: int, total: int, what: str) -> None:
        from tqdm import tqdm

        phase, _, name = what.partition(":") if ":" in what else ("quantize", "", what)
        if self.bar is None or phase != self.phase or total != self.bar.total:
            self.close()
            self.phase = phase
            byte_bar = phase == "write"
            unit = "B" if byte_bar else " step" if phase in ("convert", "measure") else \
                " chunks" if phase == "imatrix" else " tensors"
            self.bar = tqdm(total=total, desc=phase, unit=unit, unit_scale=byte_bar,
                            unit_divisor=1024 if byte_bar else 1000, leave=False, dynamic_ncols=True)
        self.bar.set_postfix_str(name[-40:], refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        with interrupts.held():
            if self.bar is not None:
                self.bar.close()
                self.bar = None


def one_line_on_abort(tensor: bool) -> None:
    """For `run` and `serve`, which load the model in their own process: llama.cpp aborts it when an RPC worker goes
    away, and in tensor mode where its meta device cannot cut a model's graph (ggml-backend-meta.cpp's split-state
    assertions, at the first batch); say so in one line and exit 1. The plan refuses the tensor-mode setups known to
    abort beforehand (planning/tensor/batch.py); this is for the ones it does not know."""
    import os
    import sys

    from ..rpc import describe_abort, on_ggml_abort

    def on_abort(message: str) -> None:
        if tensor and "ggml-backend-meta" in message:  # the meta device's own assertion: no worker to blame
            where = message.strip().rsplit("/", 1)[-1]
            line = (f"llama.cpp stopped the process in tensor mode ({where}): its tensor mode (experimental) cannot cut "
                    "this model's graph at these proportions: try -sm layer, or other -ts")
        else:
            line = describe_abort(message)
        sys.stderr.write(f"\nError: {line}\n")
        sys.stderr.flush()
        os._exit(1)

    on_ggml_abort(on_abort)
