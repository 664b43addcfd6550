"""The input and the generation of a run: tokens before anything loads, then prefill and sampling.

Long inputs are the point, so the input is tokenized from a vocabulary-only model (milliseconds,
no weights) and checked against the context before anything loads; the context is never shrunk.
`generate()` evaluates the prompt in `n_batch` chunks so a progress callback can report, then
samples tokens and streams their text through a callback; it returns a `RunResult`.
"""

from __future__ import annotations

import codecs
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import stages
from ..errors import ContextTooLong, CtxqError, InputTooLong, InvalidOption
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
    # The host with experts in host memory and layers on devices: llama.cpp's CPU_Mapped buffer (of
    # `reported`) is the file range from the first host tensor to the last, device layers' tensors between
    # them included (llama_model_loader::get_mapping_range), while `planned` counts `tensors`, the bytes of
    # the host's own tensors. 0 and 0 elsewhere: the two figures count the same things.
    mapped: int = 0
    tensors: int = 0


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
    n_cached: int = 0  # prompt tokens restored from a saved session, not evaluated
    spec: dict | None = None  # speculative decoding: `speculative.Speculation.to_dict()` (mode, passes, acceptance)
    load_s: float = 0.0
    plan: Plan | None = None
    memory: list[DeviceMemory] = field(default_factory=list)

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens evaluated (those a session restored are not) per second."""
        return (self.n_prompt - self.n_cached) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second; the first token comes from the prefill's logits, so
        n_generated - 1 evaluations happen in decode_s (llama.cpp's n_eval counts the same way)."""
        return (self.n_generated - 1) / self.decode_s if self.n_generated > 1 and self.decode_s > 0 else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Generated tokens per llama_decode after the prompt (1.0 without drafts), counted as decode_tps counts."""
        passes = (self.spec or {}).get("passes")
        return (self.n_generated - 1) / passes if passes else 1.0

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "n_prompt": self.n_prompt,
                "n_generated": self.n_generated, "stop": self.stop,
                "load_s": self.load_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "ttft_s": self.ttft_s, "n_cached": self.n_cached, "prefill_tps": self.prefill_tps,
                "decode_tps": self.decode_tps, "spec": self.spec, "tokens_per_pass": self.tokens_per_pass,
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


SEPARATOR = "\n\n"  # between a document and the question asked after it


def input_text(prompt: str | None, document: str | None = None) -> str | None:
    """The text of a run's input: the document first (the part a session saves), then the prompt."""
    if document is None:
        return prompt
    return document + SEPARATOR + prompt if prompt else document


def document_text(document, model, n_ctx: int | None) -> str | None:
    """A document given as a file (`ctxq.textfile.TextFile`, its first block already checked) read only as far as a
    context of `n_ctx` tokens of `model`'s vocabulary can use: `InputTooLong` when there is more (n_ctx None: read
    whole). A str (or None) is returned as it is."""
    from ..models import resolve_model
    from ..textfile import TextFile, byte_limit

    if not isinstance(document, TextFile):
        return document
    limit = None if n_ctx is None else byte_limit(resolve_model(model), n_ctx)
    text, whole = document.text(limit)
    if not whole:
        raise InputTooLong(str(document.path), limit, limit // n_ctx, n_ctx)
    return text


@contextlib.contextmanager
def _vocab(model):
    """The model's vocabulary alone (a vocab-only load allocates no weights)."""
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
        yield m
    finally:
        m.close()


def _encode(m, text: str | list[dict], chat: bool, system: str | None) -> tuple[list[int], str, bool]:
    """(tokens, the text tokenized, whether BOS was added) as llama-cpp-python's completion does:
    BOS if the vocabulary wants it and the chat template has not put it, special tokens parsed."""
    add_bos = True
    if chat:
        text, has_bos = chat_prompt(m, text, system)
        add_bos = not has_bos
    return m.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True), text, add_bos


def input_tokens(model, prompt: str | list[dict] | None, *, document: str | None = None, chat: bool = False,
                 system: str | None = None) -> tuple[list[int], int]:
    """(tokens, n_document): the input's tokens (the document first, then the prompt after a blank
    line; with `chat` both are one user turn in the chat template, the document at its start) and how
    many of them stay the same whatever follows the document: the part a session saves. That part
    ends where the tokens of the input cut after the document stop agreeing with the whole's.
    Without a document the prompt's text is the document; a list of messages is saved whole."""
    head = document if document is not None else prompt if isinstance(prompt, str) else None
    whole = input_text(prompt, document) if head is not None else prompt
    with _vocab(model) as m:
        tokens, text, add_bos = _encode(m, whole, chat, system)
        at = text.rfind(whole) if head is not None else -1  # where the user's text starts in a chat prompt
        if at < 0 or at + len(head) == len(text):
            return tokens, len(tokens)
        cut = m.tokenize(text[:at + len(head)].encode("utf-8"), add_bos=add_bos, special=True)
    return tokens, next((i for i, (a, b) in enumerate(zip(tokens, cut)) if a != b), min(len(tokens), len(cut)))


def tokenize(model, text: str | list[dict], *, chat: bool = False, system: str | None = None) -> list[int]:
    """Tokens of `text` (as llama-cpp-python's completion does: BOS if the vocabulary wants it, special
    tokens parsed), from a vocabulary-only load that allocates no weights."""
    with _vocab(model) as m:
        return _encode(m, text, chat, system)[0]


UNTIL_FULL = -1  # n_predict as llama.cpp's -n reads it: generate until the model stops or the context is full


def check_n_predict(n_predict: int) -> None:
    """n_predict is 0 or more tokens, or -1 (llama.cpp's "until the context is full", common/arg.cpp -n)."""
    if n_predict < UNTIL_FULL:
        raise InvalidOption(f"n_predict must be 0 or more tokens, or -1 to generate until the context is full; "
                            f"got {n_predict}", option="n_predict", value=n_predict)


def check_context(n_prompt: int, n_predict: int, n_ctx: int) -> None:
    """Refuse an empty input, and one that with the tokens to generate does not fit in n_ctx
    (with n_predict -1, one that leaves no room for a single token)."""
    check_n_predict(n_predict)
    if n_prompt == 0:
        raise CtxqError("the input is empty; give the text to read (prompt=TEXT)", option="prompt")
    if n_prompt + max(n_predict, 1 if n_predict == UNTIL_FULL else 0) > n_ctx:
        raise ContextTooLong(n_prompt, max(n_predict, 1), n_ctx)


def generate(llm, tokens: list[int], *, n_predict: int = 256, temp: float = 0.8, top_k: int = 40,
             top_p: float = 0.95, min_p: float = 0.05, n_cached: int = 0, keep: int | None = None,
             on_keep: Callable[[list[int]], None] | None = None,
             on_progress: Callable[[Progress], None] | None = None,
             on_text: Callable[[str], None] | None = None) -> RunResult:
    """Evaluate `tokens` in n_batch chunks (reporting progress), then sample up to `n_predict` tokens
    (-1: until the model stops or the context is full) from the loaded `llm`. temp 0 is greedy. The result holds no plan: `runner.execute` adds it.

    `n_cached`: llm already holds the first n_cached tokens (a restored session). `keep`: the chunks
    stop once at this token, where `on_keep(tokens[:keep])` is called (to save a session); a run
    with and without a session thus evaluates the same batches, so they give the same tokens."""
    lc = backend.llama_cpp()
    total = len(tokens)
    check_n_predict(n_predict)
    if n_predict == UNTIL_FULL:
        n_predict = llm.n_ctx() - total
    if not n_cached:
        llm.reset()
    t0 = time.perf_counter()
    if on_progress:
        on_progress(Progress(n_cached, total, 0.0))
    stops = sorted({n_cached, total} | ({keep} if keep is not None and n_cached < keep < total else set()))
    for start, end in zip(stops, stops[1:]):
        for i in range(start, end, llm.n_batch):  # Llama.eval would cut the same n_batch chunks itself
            llm.eval(tokens[i:min(i + llm.n_batch, end)])
            if on_progress:
                on_progress(Progress(min(i + llm.n_batch, end), total, time.perf_counter() - t0))
            stages.reached("prefill")  # tests only (ctxq.stages)
        if end == keep and on_keep:
            on_keep(tokens[:keep])
    t1 = time.perf_counter()
    out: list[int] = []
    parts: list[str] = []
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
    t_first = t_last = t1
    stop = "length"
    vocab = llm._model.vocab
    spec = getattr(llm, "ctxq_spec", None)  # drafts verified in one batch (speculative.attach)
    if spec is not None:
        spec.expect(n_predict)  # the end rule: no draft past the last token asked for
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
                     ttft_s=t_first - t0, stop=stop, n_cached=n_cached, spec=spec.to_dict() if spec else None)
