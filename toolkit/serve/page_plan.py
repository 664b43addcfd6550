"""The plan as the page draws it (issue 62), and `ctxq plan --html`'s file: the page's plan part alone.

`view(plan)` is what the page's `plan.js` draws: per device (each card, then the host) the segments of its bar in
bytes and its labels as `ctxq plan` prints them (two decimals of GiB, the same `total` and `capacity` as `--json`),
the llama.cpp flags and the reading-time estimate. The planner knows nothing of this: it returns a `Plan`.

`standalone_html(plan)` is one file with the page's style and plan script inlined and the view as JSON data (never
markup): it opens from disk with no server and no network. Its Content-Security-Policy allows only those two inline
blocks, by their SHA-256, so nothing else in the file could run even if a name in the plan looked like markup.
"""

from __future__ import annotations

import base64
import hashlib
import json
from importlib import resources
from pathlib import Path

from ..units import GiB

PAGE = "page"  # the folder of the page's files, package data of ctxq.serve


def page_file(name: str) -> bytes:
    """One of the page's files as shipped in the package (`ctxq/serve/page/NAME`)."""
    return resources.files(__package__).joinpath(PAGE, name).read_bytes()


def page_files() -> list[str]:
    return sorted(f.name for f in resources.files(__package__).joinpath(PAGE).iterdir() if f.is_file())


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"  # as render_plan (cli/plan.py) prints every size


def _layers(p, d) -> str:
    n = len([x for x in d.layers if x < p.n_layer])
    out = " + output" if p.n_layer in d.layers else ""
    return f"{n} layer{'s' if n != 1 else ''}{out}"


def view(p) -> dict:
    """The plan as plain data for the page: sizes in bytes, labels formatted as `ctxq plan` prints them."""
    from ..planning.speed.reading import reading_lines
    from ..planning.spill.placement import describe

    # bytes of the cards' layers that the plan keeps in host memory (spilled FFN weights, experts): in the host's
    # weights, drawn as their own segment so a spilled plan shows what it moved
    spilled = (p.host.cpu_ffn_bytes if p.cpu_ffn_layers else 0) + sum(d.cpu_expert_bytes for d in p.gpus)
    devices = []
    for d in p.devices:
        host = d is p.host
        parts = [("weights", d.weights - (spilled if host else 0))]
        if host and spilled:
            parts.append(("spilled weights", spilled))
        parts += [("KV cache", d.kv), ("state", d.state), ("compute", d.compute), ("CUDA", d.cuda_extra),
                  ("reserve", d.margin), ("free", max(0, d.free))]
        devices.append({
            "name": d.device.name, "host": host, "layers": _layers(p, d),
            "total": d.total, "capacity": d.device.usable, "total_gib": _gib(d.total),
            "capacity_gib": _gib(d.device.usable),
            "segments": [{"name": k, "bytes": v, "gib": _gib(v)} for k, v in parts if v > 0 or k == "weights"]})
    notes = [line for line in (describe(p),) if line]
    notes += reading_lines(p.speed.get("read") or {})
    if p.est_decode_tps:
        notes.append(f"decode estimate: ~{p.est_decode_tps:.1f} tokens/s at a full context (from memory bandwidth)")
    return {"model": Path(p.model).name, "n_ctx": p.n_ctx, "type_k": p.type_k, "type_v": p.type_v,
            "parallel": p.n_seq_max if p.parallel else None, "flags": p.llama_flags(), "reason": p.reason,
            "notes": notes, "devices": devices}


def _json_data(data: dict) -> str:
    """JSON inside a <script type="application/json">: `<`, `>` and `&` escaped, so no text in it can close the
    element (a device named `</script>` stays data)."""
    return json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def standalone_html(p) -> str:
    """`ctxq plan --html`: the plan's bars as one self-contained file (style and script inlined)."""
    style = page_file("page.css").decode()
    # plan.js is a module with no imports, so it runs inlined; the call below draws the embedded view
    script = page_file("plan.js").decode() + (
        '\ndrawPlan(document.getElementById("plan"), '
        'JSON.parse(document.getElementById("plan-data").textContent));\n')
    csp = f"default-src 'none'; style-src {_sha256(style)}; script-src {_sha256(script)}"
    title = f"ctxq plan: {Path(p.model).name}"
    esc = title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{esc}</title>\n'
            f"<style>{style}</style>\n</head>\n<body>\n<main>\n<h1>{esc}</h1>\n"
            '<section aria-labelledby="plan-title"><h2 id="plan-title">The plan</h2>\n'
            '<div id="plan"></div></section>\n</main>\n'
            f'<script type="application/json" id="plan-data">{_json_data(view(p))}</script>\n'
            f'<script type="module">{script}</script>\n</body>\n</html>\n')
