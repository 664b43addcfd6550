"""The independent reference for quality figures: plain llama-cpp-python's logits over the whole vocabulary.

`Llama(..., logits_all=True)` in this process and a softmax over every token id, on the tokens ctxq measured: none
of ctxq's measuring path (its top-k capture, its worker, its cache handling) is used. tests/test_quality.py and
scripts/bench_quality.py --full-vocab hold `ctxq quality` to it.
"""

from __future__ import annotations


def full_logprobs(model, tokens, type_k: str, type_v: str):
    """Log-probabilities [len(tokens), n_vocab] of `model` on `tokens` with a K/V cache of these types, on the CPU."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType as T
    from llama_cpp import Llama

    from ..quality import stats

    llm = Llama(str(model), n_ctx=len(tokens), n_batch=512, n_ubatch=512, logits_all=True, flash_attn=True,
                type_k=int(T[type_k.upper()]), type_v=int(T[type_v.upper()]), n_gpu_layers=0, verbose=False)
    try:
        llm.eval(list(tokens))
        return stats.log_softmax(np.array(llm.scores[: len(tokens)]))
    finally:
        llm.close()
