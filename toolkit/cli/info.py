"""`ctxq doctor` and `ctxq inspect`."""

from __future__ import annotations

import click

from .group import cli
from .common import echo_json, gib, human, mib, table
from .options import hf_file_option, hub_read


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool):
    """Show versions, the llama.cpp build (CUDA, RPC), devices, GPUs, CPU and RAM.

    For a CUDA build also: whether its CUDA backend links NCCL, the all-reduce tensor split mode will use
    (GGML_CUDA_ALLREDUCE), peer access (GGML_CUDA_P2P), and each pair of cards' peer-to-peer link."""
    from ..llama.doctor import doctor as run_doctor

    r = run_doctor()
    if as_json:
        echo_json(r.to_dict())
        return
    f = r.features
    click.echo(f"ctxq {r.ctxq_version}, llama-cpp-python {r.llama_cpp_python_version}, Python {r.python}")
    click.echo(f"build: CUDA {'yes' if f['cuda'] else 'no'}, RPC {'yes' if f['rpc'] else 'no'}, "
               f"GPU offload {'yes' if f['gpu_offload'] else 'no'}")
    if r.cuda_unavailable:
        click.echo(f"{r.cuda_unavailable}: runs use the CPU")
    click.echo(f"llama.cpp: {r.system_info}")
    click.echo("ggml devices:")
    for d in r.ggml_devices:
        click.echo(f"  {d['name']:<12} {d['type']:<5} {d['description']}  "
                   f"({gib(d['free'])} free of {gib(d['total'])})")
    if r.nvidia_gpus:
        click.echo("NVIDIA GPUs (NVML):")
        for g in r.nvidia_gpus:
            link = f"PCIe {g.pcie_gen or '?'} x{g.pcie_width or '?'}" + (f", NVLink x{g.nvlinks}" if g.nvlinks else "")
            click.echo(f"  {g.index}: {g.name}  {gib(g.free)} free of {gib(g.total)}, {link}")
        for g in r.nvidia_gpus:
            for p in g.peers:
                if p["index"] > g.index:
                    click.echo(f"  {g.index}-{p['index']}: peer-to-peer read {p['p2p_read'] or '?'}, "
                               f"write {p['p2p_write'] or '?'}, topology {p['topology'] or '?'}")
    else:
        click.echo(f"NVIDIA GPUs: none ({r.nvml_error})")
    _multi_gpu(r.cuda_comm)
    c = r.cpu
    click.echo(f"CPU: {c['model']}, {c['usable_cores']} usable cores; "
               f"RAM: {gib(r.ram_available)} available of {gib(r.ram_total)}")
    for w in r.warnings:
        click.echo(f"warning: {w}", err=True)


def _multi_gpu(c) -> None:
    """The CUDA backend's NCCL, all-reduce and peer access (ctxq.llama.cuda_comm), a few lines."""
    if c.library is None:
        set_ = [f"{k}={v}" for k, v in (("GGML_CUDA_ALLREDUCE", c.allreduce_env), ("GGML_CUDA_P2P", c.p2p_env))
                if v is not None]
        click.echo("multi-GPU: no CUDA backend in this build, so no NCCL, all-reduce or peer access"
                   + (f" ({', '.join(set_)}: no effect)" if set_ else ""))
        return
    if c.error:
        click.echo(f"multi-GPU: cannot read {c.library}: {c.error}")
        return
    if c.nccl_soname:
        found = "found by the loader" if c.nccl_found else f"NOT found: {c.nccl_error}"
        nccl = f"linked ({c.nccl_soname}, {found})"
    else:
        nccl = "linked statically" if c.nccl else "not built in (rebuild with NCCL installed: CTXQ_CUDA=1 make setup)"
    env = "unset" if c.allreduce_env is None else repr(c.allreduce_env)
    click.echo(f"multi-GPU (llama.cpp CUDA backend, {c.library}):")
    click.echo(f"  NCCL          {nccl}")
    click.echo(f"  all-reduce    {c.allreduce} (GGML_CUDA_ALLREDUCE {env}): {c.allreduce_why}")
    click.echo(f"  peer access   {'on' if c.peer_access else 'off'}: {c.peer_access_why}")


@cli.command()
@click.argument("model")
@hf_file_option
@click.option("--json", "as_json", is_flag=True, help="Print the model's facts as JSON.")
def inspect(model: str, hf_file: str | None, as_json: bool):
    """Show a GGUF model's geometry, weights and KV-cache cost, read from its header only.

    MODEL may be a GGUF repo on the Hugging Face Hub, USER/REPO:QUANT: its headers are read over HTTP."""
    from ..gguf.info import model_info
    from ..hub import with_file
    from ..models import model_header

    model = with_file(model, hf_file)
    src = model_header(model)
    info = model_info(src)
    read = hub_read(model) if src.source else None
    if as_json:
        echo_json(info.to_dict() | ({"source": src.source, "hub_bytes_read": read[0]} if read else {}))
        return
    heads = sorted(set(info.n_head))
    kv_heads = sorted({la.n_head_kv for la in info.layers if la.attention}) or [0]
    click.echo(f"{src.source or info.path}" + (f"\n  {read[1]}" if read else ""))
    click.echo(f"  architecture   {info.arch} ({info.name or 'unnamed'})")
    click.echo(f"  parameters     {info.n_params / 1e9:.3f} B, file type {info.file_type}, {human(info.file_size)}")
    click.echo("  tensor types   " + ", ".join(f"{k} {v}" for k, v in info.tensor_types.items()))
    click.echo(f"  layers         {info.n_layer}, width {info.n_embd}, trained context {info.n_ctx_train}")
    click.echo(f"  heads          {','.join(map(str, heads))} (KV {','.join(map(str, kv_heads))}), "
               f"head size K {info.head_dim_k} / V {info.head_dim_v}")
    swa = f"{info.n_swa} tokens on {sum(info.swa_layers)} of {info.n_layer} layers" if info.n_swa else "none"
    click.echo(f"  sliding window {swa}")
    n_attn, n_recr = sum(la.attention for la in info.layers), sum(info.recurrent_layers)
    if n_attn < info.n_layer or n_recr:
        n_mtp = sum(la.mtp for la in info.layers)
        kinds = [f"{n_attn} of {info.n_layer} layers attend"]
        if n_recr:
            kinds.append(f"{n_recr} recurrent (recurrent state {human(info.state_bytes_per_seq)} per sequence)")
        if n_mtp:
            kinds.append(f"{n_mtp} NextN (multi-token prediction: not loaded)")
        click.echo(f"  layer kinds    {', '.join(kinds)}")
    click.echo(f"  vocabulary     {info.n_vocab}")
    lb = [b for b, la in zip(info.layer_bytes, info.layers) if not la.mtp]
    click.echo(f"  weights        layers {human(sum(lb))} ({mib(min(lb))}..{mib(max(lb))} each), "
               f"token embeddings {human(info.token_embd_bytes)}, output {human(info.output_bytes)}"
               f"{' (tied to token embeddings)' if info.output_tied else ''}")
    rows = [[k, f"{v / 1024:.1f} KiB", gib(v * 65536)] for k, v in info.kv_bytes_per_token.items()]
    click.echo("  KV cache (K and V, attention layers):")
    click.echo("    " + table(rows, ["type", "per token", "at 64k"]).replace("\n", "\n    "))
