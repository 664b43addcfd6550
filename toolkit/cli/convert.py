"""`ctxq convert`: Hugging Face checkpoint -> GGUF, and GGUF -> any llama.cpp quantization."""

from __future__ import annotations

import click

from .group import cli
from .common import Bars as _Bars, human
from .plan import device_options


@cli.command("convert")
@click.argument("model")
@click.argument("type", required=False)
@click.option("-o", "--output", type=click.Path(), help="Output file (default: <models dir>/<name>-<TYPE>.gguf).")
@click.option("--revision", help="Hub branch, tag or commit to download.")
@click.option("--pre", help="BPE pre-tokenizer name for llama.cpp, when ctxq cannot recognise it.")
@click.option("--imatrix", type=click.Path(exists=True, dir_okay=False), help="Importance matrix (GGUF) for quantizing.")
@click.option("--output-tensor-type", help="ggml type for output.weight (quantized types).")
@click.option("--token-embedding-type", help="ggml type for token_embd.weight (quantized types).")
@click.option("--leave-output-tensor", is_flag=True, help="Keep output.weight unquantized.")
@click.option("--pure", is_flag=True, help="One type for every tensor, no per-tensor mix.")
@click.option("--no-check", is_flag=True, help="Skip the quality check after quantizing.")
@click.option("--force", is_flag=True, help="Replace an existing output and ignore the cache.")
@click.option("-c", "--ctx", "n_ctx", type=int, default=None,
              help="With TYPE auto or fit: the context that must fit on the devices.")
@click.option("--target-size", help="With TYPE fit: the file's size at most (80MiB, 40GB).")
@click.option("--method", type=click.Choice(["kl", "error"]), default="kl", show_default=True,
              help="With TYPE fit: choose by measured KL per tensor group, or by the weights' error alone.")
@click.option("--json", "as_json", is_flag=True, help="With TYPE fit: the result as JSON.")
@click.option("--kv", default=None, metavar="TYPE|K/V",
              help="With TYPE fit --ctx: fix the KV-cache pair (q8_0, q8_0/q4_0); default: chosen with the mix.")
@click.option("--simulate", default=None, metavar="GiB,…",
              help="With TYPE fit or auto: plan for local RPC workers standing for GPUs of these sizes.")
@device_options
def convert_cmd(model: str, type: str | None, output: str | None, revision: str | None, pre: str | None,
                imatrix: str | None, output_tensor_type: str | None, token_embedding_type: str | None,
                leave_output_tensor: bool, pure: bool, no_check: bool, force: bool, n_ctx: int | None,
                target_size: str | None, method: str, as_json: bool, kv: str | None, simulate: str | None,
                gpus: str | None, profile: str | None, rpc: str | None):
    """Convert MODEL (a Hugging Face folder, a hub id, or a GGUF) to TYPE.

    TYPE is f32, f16, bf16 or q8_0 (default: the checkpoint's own float type), or any llama.cpp
    quantization such as q4_k_m, which is made from an f16/bf16 conversion. TYPE auto picks the
    type `ctxq plan MODEL --ctx N` recommends for the devices (--gpus/--profile/--rpc, or detected).
    TYPE fit chooses a type per tensor group by measured loss, for a file of at most --target-size; with
    --ctx N, the KV-cache pair and the mix together, the least predicted loss (weights + cache) that holds N
    tokens on the devices with every layer on a GPU, then measured (--kv fixes the pair).
    """
    from ..conversion.convert import convert
    from ..errors import CtxqError

    if type and type.lower() == "fit":
        from .fit import fit_command

        return fit_command(model, output, target_size=target_size, n_ctx=n_ctx, method=method, as_json=as_json,
                           force=force, check=not no_check, revision=revision, gpus=gpus, profile=profile, rpc=rpc,
                           simulate=simulate, kv=kv)
    if target_size or as_json or kv:
        raise CtxqError("--target-size, --kv and --json go with TYPE fit")
    if type and type.lower() == "auto":
        if not n_ctx:
            raise CtxqError("convert MODEL auto needs --ctx N (the context that must fit) and the devices "
                            "(--gpus, --profile or --rpc; default: the GPUs present)")
        from ..conversion.hfplan import plan_hf

        r = plan_hf(model, n_ctx, gpus=gpus, profile=profile, rpc=rpc, simulate=simulate)
        if r.recommended is None:
            raise CtxqError(f"no quantization fits {n_ctx} tokens on these devices: "
                            + next((c.why_not for c in r.candidates if c.why_not), "see ctxq plan"))
        type = r.recommended.type
        p = r.recommended.plan
        click.echo(f"auto: {type} ({human(r.recommended.size)}, KV {p.type_k}, {p.cpu_layers} layers on the CPU "
                   f"at {n_ctx:,} tokens; see `ctxq plan {model} --ctx {n_ctx}`)", err=True)
    elif n_ctx or gpus or profile or rpc or simulate:
        raise CtxqError("--ctx, --gpus, --profile, --rpc and --simulate go with TYPE auto or fit")

    quant = {k: v for k, v in dict(imatrix=imatrix, output_tensor_type=output_tensor_type,
                                   token_embedding_type=token_embedding_type,
                                   leave_output_tensor=leave_output_tensor or None, pure=pure or None,
                                   check=False if no_check else None).items() if v is not None}
    bars = _Bars()
    try:
        r = convert(model, type, output, revision=revision, pre=pre, progress=bars, force=force, **quant)
    finally:
        bars.close()
    note = " (up to date)" if r.up_to_date else " (from the cache)" if r.cached else f" in {r.seconds:.1f} s"
    if r.source_was_quantized:
        click.echo("note: the source GGUF was already quantized; this requantizes it, and the quality check "
                   "compares against that quantized source, not the original weights", err=True)
    if r.imatrix is not None:
        m = r.imatrix
        click.echo(f"imatrix: {r.type} needs one; ctxq's own over {m.chunks} chunks of {m.chunk} tokens of the built-in "
                   f"text ({'from the cache' if m.cached else f'made in {m.seconds:.0f} s'}: {m.path})", err=True)
    click.echo(f"{r.path}  {r.type}  {r.arch}  {human(r.size)}{note}")
    if r.quality:
        g = r.quality
        click.echo(f"quality vs {g.get('reference', 'the unquantized model')}: top-1 agreement "
                   f"{g['top1_agreement']:.3f}, mean KL {g['mean_kl']:.4f} nats over {g.get('n_tokens', '?')} tokens")
