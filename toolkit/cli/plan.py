"""`ctxq plan`: show how a required context fits on the devices, per device."""

from __future__ import annotations

from pathlib import Path

import click

from .group import cli
from .common import GiB, echo_json, table
from .options import device_options, plan_options  # noqa: F401 (`ctxq convert` takes device_options from here)
from .options import hf_file_option, hub_read


def render_plan(p, *, title: str | None = None) -> str:
    """The per-device table, the llama.cpp flags and the choice made."""
    rows = []
    has_state = any(d.state for d in p.devices)
    for d in p.devices:
        n_l = len([x for x in d.layers if x < p.n_layer])
        has_out = p.n_layer in d.layers
        if d.device.kind != "cpu" and not d.layers:
            layers = "-"
        elif d.layers:
            layers = f"{min(d.layers)}-{max(d.layers) if not has_out else p.n_layer - 1}" if n_l else ""
            layers = f"{n_l} ({layers}{'+out' if has_out else ''})" if n_l else ("output" if has_out else "0")
        else:
            layers = "0"
        use = d.total / d.device.usable * 100 if d.device.usable else 0
        state = [d.state] if has_state else []  # the recurrent state, for hybrid models only
        rows.append([d.device.name, layers] + [f"{v / GiB:.2f}" for v in (
            d.weights, d.kv, *state, d.compute, d.cuda_extra, d.margin, d.total, d.device.usable, d.free)]
            + [f"{use:.0f}%"])
    head = ["device", "layers", "weights", "KV", *(["state"] if has_state else []), "compute", "CUDA", "reserve",
            "total", "capacity", "free", "use"]
    lines = []
    if title:
        lines.append(title)
    shared = f" shared by {p.n_seq_max} sequences" if p.parallel else ""  # --parallel: one unified KV cache
    lines.append(f"model {Path(p.model).name}: {p.n_layer} layers, context {p.n_ctx:,} tokens{shared}, "
                 f"KV {p.type_k}/{p.type_v}, flash attention {'on' if p.flash_attn else 'off'}")
    lines.append(table(rows, head) + "\n(sizes in GiB; layers: count (range), +out = output head; CUDA: CUDA's own "
                 "memory beyond the CPU backend's buffers:\n f16 K/V copies, offload copies, pool; reserve: kept free "
                 "outside every buffer; free: what is left)")
    lines.append(f"llama.cpp flags: {p.llama_flags()}")
    if p.split_mode == "tensor":
        lines.append("split: tensor mode (-sm tensor, marked experimental by llama.cpp): each card holds its share of "
                     "every layer listed, the mirrored tensors and a whole compute buffer")
    if p.left_out:
        lines.append("left out of tensor mode: " + "; ".join(f"{x['device']} ({x['why']})" for x in p.left_out))
    elif p.device_order:
        lines.append(f"device order: {p.device_order} (CUDA_VISIBLE_DEVICES, applied by ctxq run)")
    lines.append(f"why: {p.reason}")
    if p.kv_quality:
        from ..planning.kvpairs import describe

        lines.append(f"quality: {describe(p.kv_quality, p.model, p.n_ctx)}")
        from ..planning.quality_store import describe_whole

        whole = describe_whole(p.whole_quality(), p.model, p.n_ctx)
        if whole:
            lines.append(f"quality: {whole}")
    lines += _expert_lines(p)
    from ..planning.spill.placement import describe
    from ..planning.speed.reading import reading_lines

    if (spilled := describe(p)) is not None:
        lines.append(spilled)
    lines += reading_lines(p.speed.get("read") or {})
    if p.est_decode_tps and not (p.speed.get("read") or {}).get("decode_tps"):  # one decode rate: the reading's
        lines.append(f"decode estimate: ~{p.est_decode_tps:.1f} tokens/s at a full context "
                     "(from memory bandwidth; an estimate, not a measurement)")
    for n in p.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _ranges(layers: list[int]) -> str:
    """0-11,25-38: runs of consecutive layers."""
    out, start = [], None
    for i, il in enumerate(layers):
        if start is None:
            start = il
        if i + 1 == len(layers) or layers[i + 1] != il + 1:
            out.append(f"{start}-{il}" if il != start else str(il))
            start = None
    return ",".join(out)


def _expert_lines(p) -> list[str]:
    """Per device, the layers whose experts are kept in CPU memory and the host RAM they take."""
    if not p.cpu_expert_layers:
        return []
    out = [f"experts in CPU memory: {len(p.cpu_expert_layers)} of {len(p.expert_layers)} layers, "
           f"{p.host.experts / GiB:.2f} GiB of host RAM (in the CPU row's weights)"]
    for d in p.gpus:
        if d.cpu_experts:
            out.append(f"  {d.device.name}: layers {_ranges(d.cpu_experts)} ({len(d.cpu_experts)}), "
                       f"{d.cpu_expert_bytes / GiB:.2f} GiB")
    return out


def svg(p) -> str:
    """Per-device stacked bars: weights, KV, compute, CUDA's own, reserve against capacity."""
    colors = {"weights": "#4e79a7", "KV": "#f28e2b", "compute": "#59a14f", "CUDA": "#e15759", "reserve": "#bab0ac"}
    devs = p.devices
    w_bar, gap, h, top = 60, 30, 300, 40
    scale = h / max(max(d.device.usable, d.total) for d in devs)
    width = len(devs) * (w_bar + gap) + gap + 120
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h + top + 60}" font-family="sans-serif" font-size="11">',
           f'<text x="{gap}" y="20" font-size="13">{Path(p.model).name} at {p.n_ctx:,} tokens, KV {p.type_k}/{p.type_v}</text>']
    for i, d in enumerate(devs):
        x = gap + i * (w_bar + gap)
        cap_y = top + h - d.device.usable * scale
        out.append(f'<rect x="{x}" y="{cap_y:.1f}" width="{w_bar}" height="{d.device.usable * scale:.1f}" fill="none" stroke="#333"/>')
        y = top + h
        for name, val in (("weights", d.weights), ("KV", d.kv), ("compute", d.compute), ("CUDA", d.cuda_extra),
                          ("reserve", d.margin)):
            hh = val * scale
            y -= hh
            out.append(f'<rect x="{x}" y="{y:.1f}" width="{w_bar}" height="{hh:.1f}" fill="{colors[name]}">'
                       f'<title>{name}: {val / GiB:.2f} GiB</title></rect>')
        out.append(f'<text x="{x}" y="{top + h + 15}">{d.device.name[:12]}</text>')
        out.append(f'<text x="{x}" y="{top + h + 28}">{d.total / GiB:.1f}/{d.device.usable / GiB:.1f} GiB</text>')
    lx = gap + len(devs) * (w_bar + gap)
    for j, (name, c) in enumerate(colors.items()):
        out.append(f'<rect x="{lx}" y="{top + j * 18}" width="12" height="12" fill="{c}"/>'
                   f'<text x="{lx + 16}" y="{top + j * 18 + 10}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


@cli.command("plan")
@click.argument("model", required=False)
@plan_options(for_plan=True)
@hf_file_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--svg", "svg_path", type=click.Path(dir_okay=False), default=None, help="Write per-device bars to FILE.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Write the plan drawn per device to FILE: one HTML file that opens with no server or network "
                   "(the plan part of `ctxq serve`'s page).")
def plan_cmd(model, options, hf_file, as_json, svg_path, html_path):
    """Plan MODEL (a GGUF; default: the embedded SmolLM2) for a context of --ctx tokens.

    Chooses the KV-cache type, flash attention and the layers per device so that the whole context
    fits, leftover layers on the CPU; never shrinks the context. MODEL may be a GGUF repo on the
    Hugging Face Hub, USER/REPO:QUANT (headers read over HTTP, no weights downloaded), or a Hugging
    Face checkpoint (a folder or USER/REPO): then each quantization type is planned and one recommended.
    """
    from ..hub import parse_ref, with_file
    from ..planning import planner

    model = with_file(model, hf_file) if hf_file else model
    ref = parse_ref(model) if model is not None and not Path(model).exists() else None
    if model is not None and (Path(model).is_dir() or (ref is not None and not ref.is_gguf)):
        if html_path:  # one drawing per plan; a table of candidates has several
            raise click.ClickException("--html draws one plan; plan the converted GGUF with it")
        return _plan_hf(model, options, as_json, svg_path)
    p = planner.plan(model, options=options)
    read = hub_read(model) if ref is not None else None
    if svg_path:
        Path(svg_path).write_text(svg(p))
    if html_path:
        from ..serve.page_plan import standalone_html

        Path(html_path).write_text(standalone_html(p), encoding="utf-8")
    if as_json:
        echo_json(p.to_dict() | ({"hub_bytes_read": read[0]} if read else {}))
    else:
        click.echo(render_plan(p))
        if read:
            click.echo(read[1])


def render_hf(r) -> str:
    from ..conversion.hfplan import QUALITY_SOURCE

    rows = []
    for c in r.candidates:
        p = c.plan
        if p is None:
            rows.append([("* " if c.recommended else "  ") + c.type, f"{c.size / GiB:.2f}", "no", "-", "-", "-",
                         c.quality])
            continue
        # types that need an importance matrix: `ctxq convert` makes ctxq's own when --imatrix is not given
        rows.append([("* " if c.recommended else "  ") + c.type, f"{c.size / GiB:.2f}",
                     "yes" + (" (ctxq makes an imatrix)" if c.needs_imatrix else ""), f"{p.type_k}/{p.type_v}",
                     str(p.cpu_layers), f"{p.est_decode_tps:.1f}" if p.est_decode_tps else "-", c.quality])
    out = [f"{r.model} at {r.n_ctx:,} tokens:",
           table(rows, ["type", "GiB", "fits", "KV", "CPU layers", "tok/s (est.)", "quality (llama.cpp)"]),
           f"* recommended: the highest-quality type that fits with every layer on the GPUs, else the "
           f"fewest layers on the CPU. Quality figures: {QUALITY_SOURCE}."]
    rec = r.recommended
    if rec:
        out.append(f"convert it: ctxq convert {r.model} {rec.type}   (or: ctxq convert {r.model} auto --ctx {r.n_ctx} ...)")
        out.append(f"llama.cpp flags for {rec.type}: {rec.plan.llama_flags()}")
    else:
        out.append("nothing fits: " + next((c.why_not for c in r.candidates if c.why_not), ""))
    return "\n".join(out)


def _plan_hf(model, options, as_json, svg_path):
    from ..conversion import hfplan

    if svg_path:  # one picture per plan; a table of candidates has several
        raise click.ClickException("--svg draws one plan; plan the converted GGUF with it")
    r = hfplan.plan_hf(model, options=options)
    fitted = _fitted(model, r, options)
    if as_json:
        echo_json({"model": r.model, "n_ctx": r.n_ctx, "candidates": [
            {"type": c.type, "size": c.size, "fits": c.fits, "recommended": c.recommended,
             "needs_imatrix": c.needs_imatrix, "quality": c.quality, "why_not": c.why_not,
             "plan": c.plan.to_dict() if c.plan else None} for c in r.candidates],
            "fitted": fitted if isinstance(fitted, dict) else fitted.to_dict() if fitted else None})
    else:
        click.echo(render_hf(r))
        for line in _fitted_lines(fitted, r.n_ctx):
            click.echo(line)


def _fitted(model, r, options):
    """The mix and K/V pair `ctxq convert MODEL fit --ctx N` would choose together on these devices, predicted from
    the header (`hf_joint.fitted`); {"error": why} where no mix holds every layer on the GPUs; None where nothing is
    to be gained (f16 weights hold every layer) or no type fits at all."""
    from ..conversion import hf_joint
    from ..errors import CtxqError

    rec = r.recommended
    if rec is None or not rec.plan.gpus or (rec.type in ("F16", "BF16") and not rec.plan.cpu_layers):
        return None
    try:
        return hf_joint.fitted(r.model, r.source, r.n_ctx, options, reference=rec.plan)
    except CtxqError as e:
        return {"error": str(e), "command": hf_joint.command(r.model, r.n_ctx, options)}


def _fitted_lines(f, n_ctx: int) -> list[str]:
    if f is None:
        return []
    if isinstance(f, dict):
        return [f"fitted mix and KV (ctxq convert … fit --ctx): {f['error']}"]
    return [f"fitted: a {f.mix_bytes / 1e9:.1f} GB mix with KV {f.pair} holds {n_ctx:,} tokens with every layer on the "
            f"GPUs; predicted mean KL {f.total:.4f} = weights {f.weights_loss:.4f} (a prior from the header, scaled "
            f"to KL on SmolLM2's measured fits) + KV {f.kv_loss:.5f} ({_kv_basis(f.kv_source)}); predicted, not "
            "measured",
            f"make and measure it: {f.command}   (it measures this model's own table and may choose another mix or "
            "pair)"]


def _kv_basis(source: str) -> str:
    from ..conversion.joint import DEFAULT_SOURCE

    return "ctxq's default table, measured on SmolLM2 at 2,048 tokens" if source == DEFAULT_SOURCE else source
