"""Click options shared by `ctxq plan`, `run` and `serve`.

Each option's destination is the library's keyword (`-c/--ctx` -> n_ctx, `-ctk` -> type_k), and
every default is None, "not given": `plan_options` gathers them into one `PlanOptions`, which the
library resolves against its defaults (`ctxq.planning.options`). A command decorated with it takes
`options` instead of the individual flags.
"""

from __future__ import annotations

import functools

import click

from ..planning.options import (DEFAULT_N_BATCH, DEFAULT_N_CTX, DEFAULT_N_UBATCH, DEFAULT_PREFER, KV_TYPES,
                                MAX_PARALLEL, PlanOptions)
from ..errors import InvalidOption
from ..units import GiB

_ON_OFF = {"on": True, "off": False, "auto": None}


def _reserve_bytes(ctx, param, gib: float | None) -> int | None:
    """--reserve in GiB, as bytes; refused in the flag's own unit (the library's message counts bytes)."""
    if gib is None:
        return None
    if gib < 0:
        raise InvalidOption(f"--reserve must be 0 GiB or more, got {gib:g} GiB", option="reserve", value=gib)
    return int(gib * GiB)


def device_options(f):
    """--gpus / --profile / --rpc (also used by `ctxq convert auto`)."""
    f = click.option("--rpc", default=None, metavar="HOST:PORT[=GiB],…",
                     help="ggml RPC workers; they come first in llama.cpp's device order.")(f)
    f = click.option("--profile", default=None,
                     help="A hardware profile in profiles/ (e.g. 3x16-2x8) or a .toml file.")(f)
    f = click.option("--gpus", default=None, metavar="GiB,…",
                     help="Describe GPUs instead of detecting them: 16,16,16,8,8 or 3x16,2x8.")(f)
    return f


def _ubatch_list(ctx, param, value):
    """`-ub 256,512,1024` (llama-bench's list) -> (256, 512, 1024); one size -> (size,); none -> None."""
    if value is None:
        return None
    try:
        sizes = tuple(int(v) for v in str(value).split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give micro-batch sizes in tokens, e.g. 256,512,1024") from None
    if not sizes or any(n < 1 for n in sizes):
        raise click.BadParameter(f"{value!r}: give micro-batch sizes of 1 token or more, e.g. 256,512,1024")
    return sizes


def _plan_flags(for_plan: bool, parallel: bool = True, ubatch_list: bool = False) -> list:
    """The options in the order --help lists them."""
    if for_plan:
        ctx = click.option("-c", "--ctx", "n_ctx", type=int, required=True,
                           help="The context the input needs, in tokens.")
        split_help = "Evaluate this split: ratios 16:16:16:8:8 or layer counts 19,19,19,10,14."
        simulate_help = "Plan for local RPC workers standing for GPUs of these sizes (no GPU margin)."
    else:
        ctx = click.option("-c", "--ctx", "n_ctx", type=int, default=None,
                           help=f"Context in tokens; never shrunk to fit.  [default: {DEFAULT_N_CTX}]")
        split_help = ("auto (plan for the devices), ratios 16:16:16:8:8, or layer counts 19,19,19,10,14.  "
                      "[default: auto]")
        simulate_help = "Run on local RPC worker processes standing for GPUs of these sizes."
    flags = [
        ctx,
        click.option("-ts", "--split", default=None, help=split_help),
        click.option("-sm", "--split-mode", "split_mode", type=click.Choice(["layer", "tensor", "auto"]),
                     default=None, help="layer: whole layers per card (llama.cpp's -sm layer); tensor: every layer "
                     "cut across the cards, proportions searched so each card holds its part (-sm tensor, which "
                     "llama.cpp marks experimental; -ts takes proportions); auto: both planned and estimated, the "
                     "faster taken where `ctxq bench` measured both on these devices, else layer.  [default: layer]"),
        click.option("--prompt-tokens", "prompt_tokens", type=click.IntRange(min=0), default=None, metavar="N",
                     help="The prompt the plan's speed is estimated for, and its choices made by (micro-batch, "
                          "K/V pair, placement, -sm auto).  [default: the context]"),
        click.option("--gen-tokens", "gen_tokens", type=click.IntRange(min=0), default=None, metavar="N",
                     help="The tokens generated after it.  [default: 128]"),
        device_options,
        click.option("--simulate", default=None, metavar="GiB,…", help=simulate_help),
        click.option("--kv", default=None, metavar="auto|TYPE|K/V",
                     help="KV-cache types: auto chooses the pair with the least measured loss that fits; a type "
                          f"({', '.join(KV_TYPES)}) for K and V, or K/V such as q8_0/q4_0.  [default: auto]"),
        click.option("--max-kl", "max_kl", type=float, default=None, metavar="X",
                     help="Keep the KV cache within this mean KL against f16, as `ctxq quality` measured it for "
                          "this model; layers move to the CPU to hold it."),
        click.option("-ctk", "--cache-type-k", "type_k", default=None, help="K cache type (f16, q8_0, q5_1, ...)."),
        click.option("-ctv", "--cache-type-v", "type_v", default=None, help="V cache type (f16, q8_0, q4_0, ...)."),
        click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(list(_ON_OFF)), default=None,
                     callback=lambda ctx, param, v: _ON_OFF[v] if v else None,
                     help="Flash attention (auto: on; a quantized V cache needs it).  [default: auto]"),
        click.option("--prefer", type=click.Choice(["quality", "speed"]), default=None,
                     help="quality: keep KV at q8_0 or better (or --max-kl), the room from weights in host memory "
                          "or layers on the CPU, the pair estimated fastest among those; speed: trade loss for "
                          "estimated time, both stated.  "
                          f"[default: {DEFAULT_PREFER}]"),
        click.option("-ub", "--ubatch", "n_ubatches", default=None, callback=_ubatch_list, metavar="N,…",
                     help="Micro-batches to measure, tokens per graph evaluation, as llama-bench takes them: "
                          f"256,512,1024 (each one a plan of its own).  [default: {DEFAULT_N_UBATCH}]")
        if ubatch_list else
        click.option("-ub", "--ubatch", "n_ubatch", type=int, default=None,
                     help=f"Tokens per graph evaluation (sizes the compute buffers).  [default: {DEFAULT_N_UBATCH}]"),
        click.option("-b", "--batch", "n_batch", type=int, default=None,
                     help=f"Tokens per decode call of the prefill.  [default: {DEFAULT_N_BATCH}]"),
        click.option("--offload", type=click.Choice(["auto", "weights", "layers"]), default=None,
                     help="When the cards cannot hold everything at the context: weights (dense FFN weights of "
                          "chosen layers in host memory, -ot; attention and the whole KV cache stay on the cards), "
                          "layers (whole layers with their KV cache on the CPU, -ngl), or auto (the one estimated "
                          "faster to read the context; weights when that cannot be estimated).  [default: auto]"),
        click.option("--no-mmap", "no_mmap", is_flag=True, default=None, callback=lambda ctx, param, v: v or None,
                     help="Load the weights instead of mapping the file (llama.cpp's --no-mmap): whole layers left "
                          "on the CPU then sit in pinned memory, which copies to the card at the link's full rate."),
        click.option("-cmoe", "--cpu-moe", "cpu_moe", is_flag=True, default=None,
                     callback=lambda ctx, param, v: v or None,
                     help="Keep the expert weights of a mixture-of-experts model in CPU memory (llama.cpp's "
                          "--cpu-moe); the router and shared experts stay with their layer."),
        click.option("-ncmoe", "--n-cpu-moe", "n_cpu_moe", type=int, default=None, metavar="N",
                     help="Keep the expert weights of the first N layers in CPU memory (llama.cpp's --n-cpu-moe)."),
        click.option("-ot", "--override-tensor", "override_tensor", multiple=True, metavar="REGEX=BUFFER,…",
                     callback=lambda ctx, param, v: tuple(v) or None,
                     help="Put the tensors whose names match REGEX in BUFFER (llama.cpp's -ot): CPU or a device "
                          "(CUDA0, RPC0[host:port], GPU1); repeatable, the first match wins. Layer mode only."),
        click.option("--reserve", "reserve", type=float, default=None, metavar="GiB", callback=_reserve_bytes,
                     help="Memory kept free on every GPU outside llama.cpp's buffers (CUDA context, cuBLAS, "
                          "graphs).  [default: 0.75 for CUDA, 1.0 for other GPU backends]"),
    ]
    if parallel:  # `ctxq serve` has its own --parallel (P or auto)
        flags.append(click.option("-np", "--parallel", "parallel", type=click.IntRange(1, MAX_PARALLEL), default=None,
                                  metavar="P", help="Plan for P sequences decoded together in one context: "
                                  "one unified KV cache of --ctx cells (-kvu), one output row and recurrent state "
                                  "each.  [default: 1; ctxq run: one per question, plus the document's]"))
    if for_plan:
        flags.append(click.option("--cpu-memory", "cpu_memory", type=float, default=None,
                                  callback=lambda ctx, param, v: int(v * GiB) if v else None,
                                  help="Host RAM to plan with, GiB (default: available now)."))
    return flags


def plan_options(for_plan: bool = False, parallel: bool = True, ubatch_list: bool = False):
    """Add the options that make a plan; the command receives them as one `options: PlanOptions`.
    for_plan: `ctxq plan`'s variant (--ctx required, --cpu-memory, a split to evaluate); parallel: add
    --parallel P (serve has its own); ubatch_list: -ub takes a list, passed on as `n_ubatches` (`ctxq bench`)."""
    def decorate(f):
        @functools.wraps(f)
        def command(**kw):
            return f(options=PlanOptions.take(kw), **kw)

        for flag in reversed(_plan_flags(for_plan, parallel, ubatch_list)):  # click lists options in reverse order of application
            command = flag(command)
        return command

    return decorate


def load_options(f):
    """-t / --seed: how `run` and `serve` load the plan."""
    f = click.option("--seed", type=int, default=None, help="Sampling seed (default: random).")(f)
    f = click.option("-t", "--threads", "n_threads", type=int, default=None,
                     help="CPU threads (default: every CPU this process may use).")(f)
    return f


def session_option(f=None, *, serve: bool = False):
    """--session: the saved state of the input's document (`ctxq.runtime.session`); FILE|auto for
    `run`, FILE for `serve` (which restores and does not save)."""
    if serve:
        return click.option("--session", default=None, metavar="FILE", type=click.Path(exists=True, dir_okay=False),
                            help="Start with the document a `ctxq run --session FILE` saved in the cache (when it "
                                 "matches the model and these settings).")
    return click.option("--session", default=None, metavar="FILE|auto",
                        help="Restore the document's saved state from FILE when it matches, else process it and "
                             "save it there; auto: a file in ctxq's session cache (least recently used evicted "
                             "beyond CTXQ_SESSION_CACHE_GIB, default 20).")(f)


def echo_session_log() -> None:
    """Show the session's one-line reports (restored, saved, not used and why) on stderr in flag terms."""
    import logging

    from ..errors import CtxqError
    from .errors import cli_message

    class Echo(logging.Handler):
        def emit(self, record):
            import sys

            from tqdm import tqdm

            # tqdm.write: a line of its own even while the prefill bar is drawn (a save happens mid-prefill)
            tqdm.write(f"ctxq: {cli_message(CtxqError(record.getMessage()))}", file=sys.stderr)

    logger = logging.getLogger("ctxq.runtime.session")
    if not any(type(h).__name__ == "Echo" for h in logger.handlers):
        logger.addHandler(Echo(logging.INFO))
        logger.setLevel(logging.INFO)
        logger.propagate = False


def hf_file_option(f):
    """--hf-file: one exact file of a Hub repo (llama.cpp's and gguf-parser's flag)."""
    return click.option("--hf-file", "hf_file", default=None, metavar="PATH",
                        help="With MODEL = USER/REPO: this exact GGUF file of the Hugging Face repo.")(f)


def hub_read(model) -> tuple[int, str] | None:
    """For a model on the Hub: the bytes its headers took over the network, and a line saying so."""
    from ..models import model_header

    g = model_header(model)  # already read: from memory
    if g.source is None:
        return None
    where = "from the Hub" if g.bytes_read else "from the header cache (nothing downloaded)"
    return g.bytes_read, (f"headers read {where}: {g.bytes_read:,} bytes of {g.file_size:,} "
                          f"({g.bytes_read / g.file_size:.4%}); the weights are downloaded by `ctxq run`")
