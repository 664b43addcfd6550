"""`ctxq imatrix`: an importance matrix for a GGUF model, in llama.cpp's imatrix format, made and cached by ctxq."""

from __future__ import annotations

import click

from .common import Bars as _Bars, human
from .group import cli


@cli.command("imatrix")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-f", "--file", "text", type=click.Path(dir_okay=False), default=None,
              help="The text to collect on (default: ctxq quality's built-in English text).")
@click.option("--chunks", type=int, default=None, help="Chunks of --chunk-size tokens to evaluate (default: all).")
@click.option("--chunk-size", "chunk", type=int, default=512, show_default=True,
              help="Tokens per chunk (llama-imatrix's -c).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Also write the matrix here (default: only ctxq's cache).")
@click.option("--force", is_flag=True, help="Collect again even when the cache holds this matrix.")
def imatrix_cmd(model: str, text: str | None, chunks: int | None, chunk: int, output: str | None, force: bool):
    """Collect MODEL's importance matrix over a text, as llama.cpp's llama-imatrix does.

    For every matrix multiplication of a layer's weight, the sum of the squared inputs per input column and the
    rows counted (per expert for MoE experts), over chunks of 512 tokens. The file (GGUF, llama.cpp's imatrix
    format) is cached per model file, text and chunks; `ctxq convert MODEL IQ3_XXS --imatrix FILE` and
    llama.cpp's llama-quantize read it. `ctxq convert` makes one itself for a type that needs one.
    """
    from ..conversion.imatrix import make_imatrix

    bars = _Bars()
    try:
        r = make_imatrix(model, text, chunks=chunks, chunk=chunk, out=output, force=force, progress=bars)
    finally:
        bars.close()
    how = "from the cache" if r.cached else f"in {r.seconds:.1f} s, peak memory {human(r.peak_rss_bytes)}"
    click.echo(f"{r.path}  imatrix  {r.tensors} tensors  {r.chunks} chunks of {r.chunk} tokens of {r.dataset} ({how})")
