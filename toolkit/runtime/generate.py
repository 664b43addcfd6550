"""The input and the generation of a run: tokens before anything loads, then prefill and sampling.

Long inputs are the point, so the input is tokenized from a vocabulary-only model (milliseconds,
no weights) and checked against the context before anything loads; the context is never shrunk.
`generate()` evaluates the prompt in `n_batch` chunks so a progress callback can report, then
samples tokens and streams their text through a callback; it returns a `RunResult`.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ContextTooLong, CtxqError
from ..llama import backend
from ..planning.plan import Plan


@dataclass
class Progress:
    """Prompt processing so far: tokens done of total, seconds since prefill began."""

    done: int
    total: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class DeviceMemory:
    """Bytes on one device: what the plan expected (without its safety margin) and what llama.cpp
    reported allocating (model + KV + compute + output buffers, from its log)."""

    name: str
    planned: int
    reported: int


@dataclass
class RunResult:
    """One run: the generated text and tokens, timings in seconds, and (when `runner` loaded the
    model) the plan and the per-device memory."""

    text: str
    tokens: list[int]  # generated token ids
    n_prompt: int
    prefill_s: float  # evaluating the prompt
    decode_s: float  # from the first generated token to the last
    ttft_s: float  # prefill start to the first generated token
    stop: str  # "eos" (an end-of-generation token) or "length" (n_predict reached)
    load_s: float = 0.0
    plan: Plan | None = None
    memory: list[DeviceMemory] = field(default_factory=list)

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second; the first token comes from the prefill's logits, so
        n_generated - 1 evaluations happen in decode_s (llama.cpp's n_eval counts the same way)."""
        return (self.n_generated - 1) / self.decode_s if self.n_generated > 1 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"text": self.text, "n_prompt": self.n_prompt, "n_generated": self.n_generated, "stop": self.stop,
                "load_s": self.load_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "ttft_s": self.ttft_s, "prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps,
                "memory": [vars(m) for m in self.memory], "plan": self.plan.to_dict() if self.plan else None}


def chat_prompt(model_or_llm, text: str | list[dict], system: str | None = None) -> tuple[str, bool]:
    """`text` as one user turn (or a list of OpenAI-style messages) in the GGUF's chat template:
    (prompt, whether the prompt holds BOS itself)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    m = model_or_llm._model if hasattr(model_or_llm, "_model") else model_or_llm
    template = m.metadata().get("tokenizer.chat_template")
    if not template:
        raise CtxqError("this model has no chat template (tokenizer.chat_template); use chat=False")
    eos, bos = m.token_eos(), m.token_bos()
    fmt = Jinja2ChatFormatter(template=template, eos_token=m.token_get_text(eos) if eos != -1 else "",
                              bos_token=m.token_get_text(bos) if bos != -1 else "", stop_token_ids=[eos])
    messages = text if isinstance(text, list) else \
        ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    r = fmt(messages=messages)
    return r.prompt, bool(r.added_special)


def tokenize(model, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
    """Tokens of `text` (as llama-cpp-python's completion does: BOS if the vocabulary wants it, special
    tokens parsed), from a vocabulary-only load that allocates no weights."""
    from llama_cpp import _internals

    from ..models import resolve_model

    lc = backend.llama_cpp()
    path = resolve_model(model)
    params = lc.llama_model_default_params()
    params.vocab_only = True
    with backend.capture_log():
        try:
            m = _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
        except ValueError:
            raise CtxqError(f"llama.cpp cannot read the vocabulary of {path}; check it with `ctxq inspect`") from None
    try:
        add_bos = True
        if chat:
            text, has_bos = chat_prompt(m, text, system)
            add_bos = not has_bos
        return m.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
    finally:
        m.close()


def check_context(n_prompt: int, n_predict: int, n_ctx: int) -> None:
    """Refuse an empty input, and one that with the tokens to generate does not fit in n_ctx."""
    if n_prompt == 0:
        raise CtxqError("the input is empty; give the text to read (prompt=TEXT)", option="prompt")
    if n_prompt + n_predict > n_ctx:
        raise ContextTooLong(n_prompt, n_predict, n_ctx)


def generate(llm, tokens: list[int], *, n_predict: int = 256, temp: float = 0.8, top_k: int = 40,
             top_p: float = 0.95, min_p: float = 0.05,
             on_progress: Callable[[Progress], None] | None = None,
             on_text: Callable[[str], None] | None = None) -> RunResult:
    """Evaluate `tokens` in n_batch chunks (reporting progress), then sample up to `n_predict` tokens
    from the loaded `llm`. temp 0 is greedy. The result holds no plan: `runner.execute` adds it."""
    lc = backend.llama_cpp()
    total = len(tokens)
    llm.reset()
    t0 = time.perf_counter()
    if on_progress:
        on_progress(Progress(0, total, 0.0))
    for i in range(0, total, llm.n_batch):  # Llama.eval would cut the same n_batch chunks itself
        llm.eval(tokens[i:i + llm.n_batch])
        if on_progress:
            on_progress(Progress(min(i + llm.n_batch, total), total, time.perf_counter() - t0))
    t1 = time.perf_counter()
    out: list[int] = []
    parts: list[str] = []
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
    t_first = t_last = t1
    stop = "length"
    vocab = llm._model.vocab
    if n_predict > 0:
        # The whole prompt is cached, so generate() samples from the prefill's logits at once.
        for tok in llm.generate(tokens, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=1.0):
            t_last = time.perf_counter()
            if not out:
                t_first = t_last
            if lc.llama_vocab_is_eog(vocab, tok):
                stop = "eos"
                break
            out.append(tok)
            piece = dec.decode(llm.detokenize([tok]))
            if piece:
                parts.append(piece)
                if on_text:
                    on_text(piece)
            if len(out) >= n_predict:
                break
    tail = dec.decode(b"", final=True)
    if tail:
        parts.append(tail)
        if on_text:
            on_text(tail)
    return RunResult(text="".join(parts), tokens=out, n_prompt=total, prefill_s=t1 - t0, decode_s=t_last - t_first,
                     ttft_s=t_first - t0, stop=stop)
