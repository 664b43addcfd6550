"""The quality gate: how closely a quantized model follows its unquantized reference.

Both models read the same built-in text (at least 128 tokens); at every position ctxq compares
the next-token distributions: top-1 agreement (the share of positions where both pick the same
token) and the mean KL divergence KL(reference || quantized) in nats, the measure llama.cpp's
`llama-perplexity --kl-divergence` reports. The models are loaded one after the other, so the
peak memory is that of the larger one. The arithmetic is `ctxq.quality.stats`, as `ctxq quality`'s;
at this length the whole vocabulary is kept (57 MB for SmolLM2), so the KL is exact, and it runs in
the quantizer's child process already.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from .. import tempfiles
from ..units import default_threads

log = logging.getLogger(__name__)

MIN_TOKENS = 128

# Plain English prose written for ctxq (no copyrighted source): varied vocabulary, numbers and
# punctuation, about 250 tokens with a BPE vocabulary such as SmolLM2's.
REFERENCE_TEXT = (
    "The old lighthouse stood at the end of a narrow spit of land, where the river met the sea. "
    "For more than a hundred years its lamp had turned every night, warning ships away from the "
    "shallow banks that shifted with each winter storm. The keeper, a patient woman named Ada, "
    "kept a logbook in which she wrote the weather, the passing vessels and the price of oil. "
    "In 1923 she counted 1,482 ships; in 1924, after the new harbour opened upstream, only 611. "
    "Each morning she climbed the 97 steps to clean the glass, trim the wick and wind the clockwork "
    "that turned the lens. She believed that small, careful work, done every day, was worth more "
    "than any grand plan. When engineers finally replaced the lamp with an electric light, they "
    "asked her what she would miss. \"The quiet,\" she said, \"and the feeling that someone out "
    "there was counting on me.\" Today the tower is a museum. Visitors read her logbook behind "
    "glass, and children try to guess how many ships will pass before sunset. Most of them guess "
    "too many. The sea is wide, the river is slow, and the light still turns, although nobody "
    "needs to wind it any more. On clear evenings you can see it from the hills, twenty miles "
    "away, blinking twice every ten seconds, exactly as it did when Ada first lit it."
)


def _tokens(path: str, n_ctx: int) -> list[int]:
    """The reference text's tokens under the reference model's vocabulary; for a model without a
    usable vocabulary (tokenizer "none"), a fixed pseudo-random token sequence instead."""
    from llama_cpp import Llama

    from ..gguf.reader import read_gguf

    llm = Llama(path, n_ctx=n_ctx, vocab_only=True, verbose=False)
    # llama.cpp aborts (GGML_ASSERT) when asked to tokenize with a "none" vocabulary.
    if read_gguf(path, skip_arrays=True).get("tokenizer.ggml.model") in ("none", "no_vocab"):
        toks = []
    else:
        toks = llm.tokenize(REFERENCE_TEXT.encode(), add_bos=True)
    n_vocab = llm.n_vocab()
    llm.close()
    if len(toks) >= MIN_TOKENS:
        return toks[:n_ctx]
    log.info("%s: the reference text gives %d tokens; using fixed token ids instead", path, len(toks))
    rng = np.random.default_rng(0)
    return rng.integers(0, n_vocab, size=2 * MIN_TOKENS).tolist()


def _logits(path: str, tokens: list[int], n_ctx: int) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=default_threads(), n_gpu_layers=0, verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float64)
    finally:
        llm.close()


def compare_logits(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """Top-1 agreement and mean/max KL(reference || candidate) over positions (rows)."""
    from ..quality import stats

    lp, lq = stats.log_softmax(reference), stats.log_softmax(candidate)
    kl = stats.full_kl(lp, lq)
    return {
        "top1_agreement": float((lp.argmax(1) == lq.argmax(1)).mean()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "n_tokens": int(len(reference)),
    }


def _reference_logits(reference: str, tokens: list[int], n_ctx: int, cache_dir: Path | None,
                      reference_id: str | None = None) -> np.ndarray:
    """The reference's logits, kept as float32 in `cache_dir` keyed by the file's identity (or the
    caller's `reference_id` for its contents, e.g. a temporary's) and the tokens: quantizing one model
    to several types evaluates the (largest) reference once."""
    if cache_dir is None:
        return _logits(reference, tokens, n_ctx)
    import hashlib
    import importlib.metadata as md

    st = os.stat(reference)
    ident = reference_id or [os.path.realpath(reference), st.st_size, st.st_mtime_ns, st.st_ino]
    stamp = json.dumps([ident, tokens, md.version("llama_cpp_python")])
    path = Path(cache_dir) / (hashlib.sha256(stamp.encode()).hexdigest()[:32] + ".npy")
    try:
        return np.load(path).astype(np.float64)
    except (OSError, ValueError):
        pass
    logits = _logits(reference, tokens, n_ctx)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = tempfiles.create(path, "npy")
    try:
        with open(part, "wb") as f:  # np.save to a path would add ".npy" to the temporary's name
            np.save(f, logits.astype(np.float32))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return logits


def compare(reference: str | os.PathLike, candidate: str | os.PathLike, *, n_ctx: int = 512,
            cache_dir: str | os.PathLike | None = None, reference_id: str | None = None) -> dict:
    """Run both GGUF models on the built-in text; return top1_agreement, mean_kl (nats), max_kl,
    n_tokens and the reference path. With `cache_dir`, the reference's logits are reused (looked up
    by `reference_id` when given: a string that names the reference's contents)."""
    reference, candidate = str(Path(reference)), str(Path(candidate))
    tokens = _tokens(reference, n_ctx)
    ref = _reference_logits(reference, tokens, n_ctx, Path(cache_dir) if cache_dir else None, reference_id)
    cand = _logits(candidate, tokens, n_ctx)
    return {**compare_logits(ref, cand), "reference": reference}
