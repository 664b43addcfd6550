"""Many questions about one document, answered together: the document evaluated and held once.

`ask()` (the Python API) and `ctxq run -f DOC -p Q1 -p Q2 ...` drive the same engine
(`ctxq.runtime.engine`): the document is read into one sequence first (or restored from a session), then
every question forks from it (`llama_memory_seq_cp`, no copy) and the answers decode in one batch
per step. Each question is tokenized as a single run tokenizes it (`generate.input_tokens`), so the
document and each question are evaluated in the batches a single run evaluates them in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import CtxqError, DoesNotFit, InvalidOption
from ..gguf.once import one_parse
from ..planning.options import PlanOptions
from ..planning.plan import Plan
from .generate import DeviceMemory, check_n_predict, document_text, input_tokens

log = logging.getLogger(__name__)

CELL_ROUND = 256  # llama.cpp pads the KV cache to 256 cells (llama_kv_cache::get_padding, n_pad)


@dataclass
class Answer:
    """One question's answer; token counts as OpenAI's usage reports them."""

    question: str
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens shared with the document's sequence, not evaluated again
    completion_tokens: int

    def to_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class ManyResult:
    """A run of several questions: the answers in order, and what the engine did (seconds, tokens)."""

    answers: list[Answer]
    n_document: int  # the tokens every question shares
    n_cached: int  # of those, restored from a session
    prompt_tokens_evaluated: int
    tokens_generated: int
    cells_used: int  # KV cells held at the end (the document once, plus each question and answer)
    tokens_drafted: int = 0  # draft tokens verified (spec), and of those accepted
    tokens_draft_accepted: int = 0
    spec_note: str | None = None  # why nothing was drafted, when drafts were asked for
    load_s: float = 0.0
    prefill_s: float = 0.0  # reading the document (or restoring it)
    total_s: float = 0.0  # from the document's start to the last answer
    plan: Plan | None = None
    memory: list[DeviceMemory] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"answers": [a.to_dict() for a in self.answers], "n_document": self.n_document,
                "n_cached": self.n_cached, "prompt_tokens_evaluated": self.prompt_tokens_evaluated,
                "tokens_generated": self.tokens_generated, "cells_used": self.cells_used, "load_s": self.load_s,
                "tokens_drafted": self.tokens_drafted, "tokens_draft_accepted": self.tokens_draft_accepted,
                "prefill_s": self.prefill_s, "total_s": self.total_s,
                "memory": [vars(m) for m in self.memory], "plan": self.plan.to_dict() if self.plan else None}


def question_tokens(model, document: str, questions: list[str], *, chat: bool = False,
                    system: str | None = None) -> tuple[list[list[int]], int]:
    """(tokens of each question after the document, the tokens they all share up to the document's end)."""
    if not questions:
        raise CtxqError("give at least one question", option="prompt")
    if any(not q.strip() for q in questions):
        raise InvalidOption("a question is empty", option="prompt", value="")
    from .runner import check_vocabulary

    check_vocabulary(model)  # before llama.cpp tokenizes (it aborts on a model without a tokenizer)
    pairs = [input_tokens(model, q, document=document, chat=chat, system=system) for q in questions]
    tokens = [t for t, _ in pairs]
    keep = min(k for _, k in pairs)
    keep = min([keep] + [len(t) - 1 for t in tokens])  # each question's last token is evaluated (its logits)
    return tokens, keep


def cells_needed(tokens: list[list[int]], keep: int, n_predict: int) -> int:
    """KV cells for the document once and every question with its answer."""
    return keep + sum(len(t) - keep + n_predict for t in tokens)


def answer_all(engine, questions: list[str], tokens: list[list[int]], keep: int, params, *,
               session=None, plan: Plan | None = None,
               on_answer: Callable[[int, Answer], None] | None = None) -> ManyResult:
    """Read the document (or restore it from `session`), then ask every question on `engine` at once."""
    from . import session as sessions

    t0 = time.perf_counter()
    doc = tokens[0][:keep]
    n_cached = 0
    path = sessions.session_path(session, plan, doc) if session is not None else None
    if path is not None and plan is not None:
        n_cached = sessions.restore_into_engine(engine, path, plan, doc)
    if n_cached < keep:
        if keep:
            engine.prefill(doc).result()
        if path is not None and plan is not None:
            sessions.save_from_engine(engine, session, doc, plan)
    t1 = time.perf_counter()
    reqs = engine.submit_all(tokens, params, share_limit=keep)  # together: the document evaluated once
    answers = []
    for i, (q, r) in enumerate(zip(questions, reqs)):
        res = r.result()
        a = Answer(q, res.text, res.finish_reason, res.prompt_tokens, res.cached_tokens, res.completion_tokens)
        answers.append(a)
        if on_answer:
            on_answer(i, a)
    st = engine.stats()
    return ManyResult(answers, keep, n_cached, st.prompt_tokens_evaluated, st.tokens_generated, st.cells_used,
                      st.tokens_drafted, st.tokens_draft_accepted, engine.spec.note,
                      prefill_s=t1 - t0, total_s=time.perf_counter() - t0, plan=plan)


@one_parse  # the model's header parsed once in the call
def ask(model_or_llm=None, document: str = "", questions: list[str] | None = None, *, n_ctx: int | None = None,
        max_tokens: int = 256, temperature: float = 0.0, seed: int | None = None, chat: bool = True,
        system: str | None = None, session=None, n_threads: int | None = None,
        options: PlanOptions | None = None, spec: str | None = None, **settings) -> list[Answer]:
    """Answer every question about `document` together, the document evaluated and held once.

    `model_or_llm`: a model (path, Hub name, None for the default) planned and loaded for the call, or
    a `llama_cpp.Llama` from `ctxq.load()` (its model is shared; the engine makes its own context of
    `n_ctx` cells, default the Llama's). `n_ctx` defaults to what the document once plus every
    question and `max_tokens` answer need. Greedy by default (temperature 0). `settings` are
    `PlanOptions` fields (kv, gpus, ...). `spec`: drafts from the context (ngram, off, auto: `ctxq run --spec`).
    Returns the answers in the order of the questions."""
    return ask_many(model_or_llm, document, questions or [], n_ctx=n_ctx, max_tokens=max_tokens,
                    temperature=temperature, seed=seed, chat=chat, system=system, session=session,
                    n_threads=n_threads, options=options, spec=spec, **settings).answers


def ask_many(model_or_llm, document: str, questions: list[str], *, n_ctx: int | None = None,
             max_tokens: int = 256, temperature: float = 0.0, seed: int | None = None, chat: bool = False,
             system: str | None = None, session=None, n_threads: int | None = None,
             options: PlanOptions | None = None, spec: str | None = None,
             on_plan: Callable[[Plan, int], None] | None = None,
             on_loaded: Callable[[Plan, float], None] | None = None,
             on_answer: Callable[[int, Answer], None] | None = None, **settings) -> ManyResult:
    """`ask()` with the whole result (timings, tokens evaluated, memory) and callbacks for the CLI. `spec`: drafts
    from the context in the engine's batches (ngram, off; auto, the default: where `ctxq bench --spec` measured)."""
    from . import engine_spec
    from .engine import Engine, SamplingParams, from_plan

    check_n_predict(max_tokens)
    if max_tokens < 0:
        raise InvalidOption("with several questions give max_tokens (n_predict) of 0 or more",
                            option="n_predict", value=max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    given = settings.get("parallel") or (options.parallel if options else None)
    if given is not None and given < 2:  # the document's sequence and at least one question's
        raise InvalidOption(f"parallel={given}: several questions need 2 sequences or more (the document's and "
                            "a question's)", option="parallel", value=given)
    if hasattr(model_or_llm, "_model"):  # a loaded Llama
        llm = model_or_llm
        document = document_text(document, llm.model_path, n_ctx or llm.n_ctx())
        tokens, keep = question_tokens(llm.model_path, document, questions, chat=chat, system=system)
        mode, cost, _ = engine_spec.for_plan(getattr(llm, "ctxq_plan", None), spec)
        with Engine(llm, n_seq_max=given or _n_seq(questions), n_ctx=n_ctx or llm.n_ctx(), spec=mode,
                    spec_cost=cost) as e:
            _check_fits(tokens, keep, max_tokens, e.n_ctx)
            return answer_all(e, questions, tokens, keep, params, session=session,
                              plan=getattr(llm, "ctxq_plan", None), on_answer=on_answer)
    from ..models import resolve_model
    from .runner import local_workers, make_plan

    with local_workers((options or PlanOptions()).updated(**settings)) as opts:
        path = resolve_model(model_or_llm) if opts.n_ctx is None and n_ctx is None else None
        if path is not None:  # the context is sized from the input: tokenize before planning
            document = document_text(document, path, None)
            tokens, keep = question_tokens(path, document, questions, chat=chat, system=system)
            n_ctx = -(-cells_needed(tokens, keep, max_tokens) // CELL_ROUND) * CELL_ROUND
        # the plan is the engine's context: one sequence per question and the document's (unless given)
        plan = make_plan(model_or_llm, options=opts.updated(n_ctx=n_ctx, parallel=opts.parallel or _n_seq(questions)))
        if path is None:
            document = document_text(document, plan.model, plan.n_ctx)
            tokens, keep = question_tokens(resolve_model(plan.model), document, questions, chat=chat, system=system)
        _check_fits(tokens, keep, max_tokens, plan.n_ctx)
        if on_plan:
            on_plan(plan, cells_needed(tokens, keep, max_tokens))
        t0 = time.perf_counter()
        with from_plan(plan, rpc=opts.rpc, n_threads=n_threads, seed=seed, spec=spec) as e:
            load_s = time.perf_counter() - t0
            if on_loaded:
                on_loaded(plan, load_s)
            r = answer_all(e, questions, tokens, keep, params, session=session, plan=plan, on_answer=on_answer)
        r.load_s, r.memory = load_s, e.memory
        return r


def _n_seq(questions: list[str]) -> int:
    # one id per question, one for the document's sequence; llama.cpp takes at most LLAMA_MAX_SEQ (256)
    return min(len(questions) + 1, 256)


def _check_fits(tokens: list[list[int]], keep: int, max_tokens: int, n_ctx: int) -> None:
    """The document and the longest question with its answer must fit; more questions than fit at once
    wait for cells (the engine queues them)."""
    need = max(len(t) for t in tokens) + max_tokens
    if need > n_ctx:
        raise DoesNotFit(f"the document ({keep:,} tokens) with its longest question and a {max_tokens:,}-token "
                         f"answer needs {need:,} KV cells, but the context holds {n_ctx:,}",
                         f"use n_ctx={need} or more, or a shorter input or n_predict", option="n_ctx",
                         value=need, limit=n_ctx)


def read_questions(path: str | Path) -> list[str]:
    """A file of questions, one per line (blank lines skipped). A file that is not text is refused from its first
    block (`ctxq.textfile`); the rest is read whole: every question in it is asked, whatever the context."""
    from ..textfile import TextFile

    lines = TextFile(path).text()[0].splitlines()
    qs = [l.strip() for l in lines if l.strip()]
    if not qs:
        raise CtxqError(f"{path} holds no questions (one per line)", option="questions")
    return qs
