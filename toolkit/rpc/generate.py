"""A greedy generation that reports what llama.cpp did: tokens, timings, devices, allocations.

Part of the `ctxq.rpc` API (import these names from there): `generate_greedy(model, prompt,
n_predict, **llama_kwargs)` -> `Generation`, for tests, benchmarks and accuracy checks; run it
through `run_supervised(rpc=...)` to place the model on RPC workers. Timings count as
`ctxq.runtime.runner.RunResult` does, so a `Generation` and a `ctxq run` report the same rates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..llama import backend, overrides


@dataclass
class Generation:
    tokens: list[int]  # generated token ids (greedy: argmax of the logits)
    n_prompt: int  # prompt tokens evaluated
    prefill_s: float  # evaluating the prompt
    decode_s: float  # from the first generated token to the last
    devices: list[str]  # ggml devices of the model, in llama.cpp's order
    allocations: backend.Allocations = field(default_factory=backend.Allocations)

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second; the first token comes from the prefill's logits, so
        len(tokens) - 1 evaluations happen in decode_s (as in RunResult and llama.cpp's n_eval)."""
        n = len(self.tokens)
        return (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else 0.0


def generate_greedy(model: str, prompt: str | list[int], n_predict: int = 16, *, cpu_patterns: tuple[str, ...] = (),
                    **llama_kwargs) -> Generation:
    """Load `model` with `Llama(**llama_kwargs)`, evaluate `prompt`, then take the argmax `n_predict`
    times; timings separate prefill from decode. Register RPC workers first (`run_supervised(rpc=)`).
    `cpu_patterns`: tensors to keep in CPU memory (`Plan.expert_overrides()`, `ctxq.llama.overrides`)."""
    import numpy as np

    lc = backend.llama_cpp()
    llama_kwargs.setdefault("verbose", False)
    with backend.capture_log() as lines:
        llm = overrides.create_llama(str(model), llama_kwargs, cpu_patterns)
    try:
        toks = llm.tokenize(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        n_vocab = llm.n_vocab()
        t0 = time.perf_counter()
        llm.eval(toks)
        lc.llama_synchronize(llm.ctx)  # decoding is asynchronous on RPC devices: wait for the result
        t1 = time.perf_counter()
        out: list[int] = []
        t_first = t_last = t1
        for i in range(n_predict):
            if i:  # the previous token's evaluation; the last token is not evaluated (as in `ctxq run`)
                llm.eval([out[-1]])
            # reading the logits waits for the evaluation (llama_get_logits_ith synchronizes)
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            out.append(int(np.argmax(logits)))
            t_last = time.perf_counter()
            if not i:
                t_first = t_last
    finally:
        llm.close()
    devices = [l.split("using device ", 1)[1].split(" ")[0] for l in lines if "using device " in l]
    return Generation(out, len(toks), t1 - t0, t_last - t_first, devices, backend.parse_allocations(lines))
