"""One llama.cpp context for many sequences: the document evaluated and held once, the answers
decoded together.

The engine creates its own context from a loaded model with a unified KV cache (`kv_unified`,
`n_seq_max`): one pool of n_ctx cells for every sequence, in which `llama_memory_seq_cp` shares
cells instead of copying them (`llama_kv_cache::seq_cp`). One thread owns the context; each step it
admits what fits, forks shared prefixes, then decodes one `llama_batch` holding a token for every
generating sequence and prompt chunks of newly admitted ones (`n_batch` bound), and samples each
sequence with its own chain. Callers only talk to it through `submit()` and the `Request` it returns.

Cells are counted by the engine itself (`prefix.PrefixStore`), so a request is admitted only while
the cells it may need are free, and refused with both numbers when it can never fit; `llama_decode`
is never used to find out.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from ..errors import CtxqError, DoesNotFit, InvalidOption
from ..llama import backend
from . import engine_spec
from .context import context_params
from .prefix import PrefixStore
from .request import COUNTED, EngineStats, Event, Request, Result  # noqa: F401 (the contract's names live here too)
from .sampling import Chain, SamplingParams  # noqa: F401
from .scheduler import Scheduler, Seq

log = logging.getLogger(__name__)

class Engine:
    """Many sequences in one llama.cpp context made from `llm`'s model (see the module's docstring).
    Use as a context manager, or call `close()`: it stops the thread and frees the context."""

    def __init__(self, llm, *, n_seq_max: int, n_ctx: int | None = None, own_llm: bool = False,
                 spec: str | None = None, spec_cost: dict | None = None, **context_params_):
        lc = backend.llama_cpp()
        limit = lc.llama_max_parallel_sequences()
        if not 1 <= n_seq_max <= limit:  # LLAMA_MAX_SEQ (src/llama-cparams.h); the context refuses more
            raise InvalidOption(f"n_seq_max must be 1 to {limit}, got {n_seq_max}", option="n_seq_max",
                                value=n_seq_max, limit=limit)
        self._lc, self._llm, self._own_llm = lc, llm, own_llm
        model = llm._model.model
        self._vocab = llm._model.vocab
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        # drafts (`spec`: ngram, auto with `spec_cost`, off): verified in the batch, their logits need output rows
        self.spec = engine_spec.configure(spec, spec_cost, bool(lc.llama_model_is_recurrent(model) or
                                                                lc.llama_model_is_hybrid(model)))
        if self.spec.active:
            context_params_ = {"n_outputs_max": n_seq_max + engine_spec.DRAFT_OUTPUTS, **context_params_}
        cp = context_params(llm, n_seq_max, n_ctx, context_params_)
        with backend.capture_log() as lines:
            ctx = lc.llama_init_from_model(model, cp)
        if not ctx:
            tail = next((l.strip() for l in reversed(lines) if l.strip()), "no reason logged")
            raise CtxqError(f"llama.cpp could not make a context of {cp.n_ctx} tokens for {n_seq_max} sequences "
                            f"({tail})")
        self._ctx = ctx
        self.allocations = backend.parse_allocations(lines)  # this context's buffers, as llama.cpp logged them
        self.n_seq_max = n_seq_max
        self.n_ctx = lc.llama_n_ctx(ctx)  # the unified pool: n_ctx_seq = n_ctx (llama_context ctor)
        self.n_batch = lc.llama_n_batch(ctx)
        # recurrent state is one whole state per sequence: shared only whole, never cut part-way
        self.recurrent = bool(lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model))
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self._store = PrefixStore(n_seq_max, self.spec.grams)
        self._outputs = cp.n_outputs_max
        self._sched = Scheduler(self._store, self.n_ctx, self.recurrent)
        self._counters = Counter(dict.fromkeys(COUNTED, 0))  # EngineStats' running totals
        self._lock = threading.Condition()
        self._queue: deque[Seq] = deque()
        self._cancels: list[Request] = []
        self._tasks: list[tuple[Callable, Future]] = []  # run on the thread between steps
        self._closed = False
        self._snapshot = self._make_stats()
        self._thread = threading.Thread(target=self._loop, name="ctxq-engine", daemon=True)
        self._thread.start()

    # --- the callers' side ------------------------------------------------------------------------

    def submit(self, tokens: list[int], params: SamplingParams | None = None, *,
               share_limit: int | None = None) -> Request:
        """Queue `tokens` for an answer; returns at once. Raises DoesNotFit (value = cells needed,
        limit = cells the engine has) when the request can never fit, InvalidOption for bad settings.
        `share_limit`: share at most that many first tokens with other sequences (`ctxq run` gives
        the document's end, so the document and each question are evaluated in the batches a single
        run evaluates them in)."""
        return self.submit_all([tokens], params, share_limit=share_limit)[0]

    def submit_all(self, prompts: list[list[int]], params: SamplingParams | None = None, *,
                   share_limit: int | None = None) -> list[Request]:
        """`submit` for prompts queued together, admitted in one step: those sharing a document evaluate it once even
        on a recurrent model, whose state is shared only whole, where the document ends (one by one, the first can
        be past that point when the next arrives). Every prompt is checked before any is queued."""
        params = params or SamplingParams()
        params.check(self.n_vocab)
        prepared = []
        try:
            for tokens in prompts:
                tokens = self._checked(tokens)
                need = len(tokens) + params.max_tokens
                if need > self.n_ctx:
                    raise DoesNotFit(f"the request needs {need:,} KV cells ({len(tokens):,} prompt tokens + max_tokens "
                                     f"{params.max_tokens:,}) but the engine holds {self.n_ctx:,}",
                                     "use a shorter prompt, fewer max_tokens or a larger n_ctx", value=need,
                                     limit=self.n_ctx)
                req = Request(self, len(tokens))
                if params.max_tokens == 0:
                    req._finish("length")
                    prepared.append((req, None))
                    continue
                chain = Chain(self._vocab, self.n_vocab, params)  # bad grammar raises here, in the caller's thread
                prepared.append((req, Seq(req, tokens, params, chain, share_limit=share_limit,
                                          drafter=self.spec.drafter(need, self.n_batch))))
            with self._lock:
                if self._closed:
                    raise CtxqError("the engine is closed")
                self._queue.extend(seq for _, seq in prepared if seq is not None)
                self._lock.notify_all()
        except BaseException:
            for _, seq in prepared:
                if seq is not None:
                    seq.chain.close()
            raise
        return [req for req, _ in prepared]

    def prefill(self, tokens: list[int]) -> Request:
        """Evaluate `tokens` into a sequence that stays resident for later requests to share (a
        document read before its questions); the request finishes ("length", no text) once they are in."""
        tokens = self._checked(tokens)
        if len(tokens) > self.n_ctx:
            raise DoesNotFit(f"the document needs {len(tokens):,} KV cells but the engine holds {self.n_ctx:,}",
                             "use a larger n_ctx", value=len(tokens), limit=self.n_ctx)
        req = Request(self, len(tokens))
        with self._lock:
            self._queue.append(Seq(req, tokens, SamplingParams(max_tokens=0), None))
            self._lock.notify_all()
        return req

    def _checked(self, tokens: list[int]) -> list[int]:
        """The prompt as ints, refused when empty or holding an id outside the vocabulary (llama_decode
        would refuse the whole batch, every sequence in it: llama_batch_allocr::init)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise InvalidOption("the prompt is empty", option="prompt")
        bad = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise InvalidOption(f"token {bad} is outside the vocabulary of {self.n_vocab}", option="prompt",
                                value=bad, limit=self.n_vocab)
        return tokens

    def save_prefix(self, tokens: list[int], write: Callable) -> bool:
        """Call `write(ctx, seq_id)` on the engine's thread for the resident sequence holding exactly
        `tokens` (a prefilled document); False when none does."""
        def task():
            seq_id, n = self._store.match(tokens, whole=True)
            if seq_id is None or n != len(tokens):
                return False
            write(self._ctx, seq_id)
            return True

        return self._on_thread(task)

    def load_prefix(self, read: Callable) -> int:
        """Call `read(ctx, seq_id)` on the engine's thread with a free sequence id; it loads a saved
        state there and returns the tokens it holds (or raises), which stay resident for later
        requests to share. The number of tokens loaded."""
        def task():
            seq_id = self._store.free_slot()
            if seq_id is None:
                seq_id = self._store.lru_idle()
                if seq_id is None:
                    raise CtxqError("every sequence is busy; load the session before submitting requests")
                self._sched._evict(seq_id, self._rm)
            try:
                tokens = read(self._ctx, seq_id)
            except BaseException:
                self._lc.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
                raise
            self._store.append(seq_id, list(tokens))
            self._store.touch(seq_id)
            return len(tokens)

        return self._on_thread(task)

    def _on_thread(self, fn: Callable):
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise CtxqError("the engine is closed")
            self._tasks.append((fn, fut))
            self._lock.notify_all()
        return fut.result()

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._snapshot
            s.queued = len(self._queue)
            return EngineStats(**vars(s))

    def close(self) -> None:
        """Stop the thread, cancel what is pending, free the context (and the model it was made for,
        when the engine loaded it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._thread.join()
        self._sched.tell()
        for fn, fut in self._tasks:
            fut.set_exception(CtxqError("the engine is closed"))
        for s in list(self._queue) + self._sched.active:
            s.req._finish("cancelled")
            if s.chain:
                s.chain.close()
        self._queue.clear()
        self._lc.llama_batch_free(self._batch)
        self._lc.llama_free(self._ctx)
        self._ctx = None
        if self._own_llm:
            self._llm.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cancel(self, req: Request) -> None:
        with self._lock:
            queued = next((s for s in self._queue if s.req is req), None)
            if queued is not None:
                self._queue.remove(queued)
                if queued.chain:
                    queued.chain.close()
                req._finish("cancelled")
            elif not req.done:
                self._cancels.append(req)
                self._lock.notify_all()

    # --- the engine's thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._closed or self._queue or self._cancels or self._tasks or self._sched.active):
                    self._lock.wait()
                if self._closed:
                    return
                cancels, self._cancels = self._cancels, []
                tasks, self._tasks = self._tasks, []
            for fn, fut in tasks:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # the caller's thread raises it
                    fut.set_exception(e)
            try:
                for req in cancels:
                    self._sched.cancel(req, self._rm)
                self._admit()
                if not self._step():
                    with self._lock:  # nothing to evaluate until a request ends, arrives or is cancelled
                        self._lock.wait(0.05)
            except Exception as e:  # a failed step ends its sequences, never the thread
                log.exception("engine step failed")
                for s in list(self._sched.active):
                    self._sched.finish(s, "error", self._rm, error=e)
            with self._lock:
                self._snapshot = self._make_stats()
            self._sched.tell()

    def _rm(self, seq_id: int, p0: int) -> None:
        """Free `seq_id`'s cells from position p0 on (-1: all) in llama.cpp; the store does the same."""
        if not self._lc.llama_memory_seq_rm(self._mem, seq_id, p0, -1):
            raise CtxqError(f"llama.cpp could not remove sequence {seq_id} from position {p0}")

    def _cp(self, src: int, dst: int, n: int) -> None:
        # recurrent state is one cell per sequence: copy it whole (p0 = p1 = -1)
        p1 = -1 if self.recurrent else n
        self._lc.llama_memory_seq_cp(self._mem, src, dst, -1 if self.recurrent else 0, p1)

    def _admit(self) -> None:
        """Admit queued requests in order while their cells and a sequence id are free."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                s = self._queue[0]
            if not self._sched.admit(s, self._cells_free, self._rm, self._cp):
                return
            with self._lock:
                if self._queue and self._queue[0] is s:
                    self._queue.popleft()

    def _cells_free(self) -> int:
        return self.n_ctx - self._store.cells_used() - self._sched.reserved()

    def _step(self) -> bool:
        """One llama_decode of every generating token and the prompt chunks that fit; False: nothing to do."""
        lc, b = self._lc, self._batch
        self._sched.fork_waiting(self._cp, self._rm)
        if self.spec.active:  # the drafts take what the batch and the output rows leave after one token each
            busy = sum(1 for s in self._sched.active if s.next_token is not None)
            engine_spec.propose(self._sched.active, self._store, min(self.n_batch, self._outputs) - busy)
        plan = self._sched.build(self.n_batch)
        if not plan.entries:
            return False
        for i, (seq, tok, pos, out) in enumerate(plan.entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq.seq_id
            b.logits[i] = out
        b.n_tokens = len(plan.entries)
        rc = lc.llama_decode(self._ctx, b)
        self._counters["steps"] += 1
        if rc != 0:  # the engine's own accounting should make this impossible: say so loudly
            raise CtxqError(f"llama_decode returned {rc} for a batch of {b.n_tokens} tokens "
                            f"({self._store.cells_used()} of {self.n_ctx} cells in use)")
        self._counters["prompt_tokens_evaluated"] += plan.n_prompt
        self._sched.evaluated(plan, self._rm)
        for i, seq in plan.outputs:
            if seq.drafter is not None and seq.generated:  # decoding (not a prompt's last token)
                engine_spec.verify(self, seq, i)
            else:
                self._token(seq, seq.chain.sample(self._ctx, i))
        return True

    def _token(self, s: Seq, tok: int) -> None:
        if s.zombie:  # cancelled while it still prefills for sequences that fork from it
            return
        if self._lc.llama_vocab_is_eog(self._vocab, tok):
            self._sched.finish(s, "stop", self._rm)
            return
        self._counters["tokens_generated"] += 1
        s.generated.append(tok)
        s.chain.accepted(len(s.generated))  # min_tokens: the end token is let through from here on
        s.req.completion_tokens = len(s.generated)
        s.req._emit(s.stream.feed(self._piece(tok)), tok)
        if s.stream.stopped:
            self._sched.finish(s, "stop", self._rm)
        elif len(s.generated) >= s.params.max_tokens:
            self._sched.finish(s, "length", self._rm)
        else:
            s.next_token = tok

    def _piece(self, tok: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._lc.llama_token_to_piece(self._vocab, tok, buf, len(buf), 0, False)
        if n < 0:  # the piece is longer than the buffer: -n is its length
            buf = ctypes.create_string_buffer(-n)
            n = self._lc.llama_token_to_piece(self._vocab, tok, buf, len(buf), 0, False)
        return buf.raw[:n]

    def _make_stats(self) -> EngineStats:
        st = self._store
        busy = sum(1 for sl in st.slots if sl.busy)
        return EngineStats(sequences_active=busy, queued=len(self._queue), n_seq_max=self.n_seq_max,
                           cells_total=self.n_ctx, cells_used=st.cells_used(), cells_shared=st.cells_shared(),
                           prompt_tokens_reused=self._sched.reused,
                           sequences_resident=sum(1 for sl in st.slots if sl.tokens and not sl.busy), **self._counters)


def from_plan(plan, *, n_seq_max: int | None = None, n_ctx: int | None = None, spec: str | None = None,
              **load_kwargs) -> Engine:
    """An engine on `plan`'s model, loaded as `ctxq.runtime.runner.load_plan` loads it. The Llama's own
    context is freed at once (the engine's replaces it, so the plan's KV memory is held once). A parallel
    plan (`Plan.context_settings`) gives n_seq_max and n_outputs_max; else n_seq_max is needed. `spec`: drafts
    (ngram, off; auto, the default, where `ctxq bench --spec` measured their cost for this plan)."""
    if plan.parallel:
        n_seq_max = n_seq_max or plan.n_seq_max
        if n_seq_max != plan.n_seq_max:
            raise InvalidOption(f"the plan is for {plan.n_seq_max} sequences, not {n_seq_max}: plan with "
                                f"parallel={n_seq_max}", option="n_seq_max", value=n_seq_max, limit=plan.n_seq_max)
    elif n_seq_max is None:
        raise InvalidOption("give n_seq_max, or a plan made with parallel=P", option="n_seq_max", value=None)
    from .runner import engine_memory, load_plan

    llm, _, _ = load_plan(plan, **load_kwargs)
    llm._ctx.close()  # llama-cpp-python frees a closed context only once (LlamaContext.close)
    try:
        mode, cost, _ = engine_spec.for_plan(plan, spec)
        e = Engine(llm, n_seq_max=n_seq_max, n_ctx=n_ctx or plan.n_ctx, own_llm=True, spec=mode, spec_cost=cost)
    except BaseException:
        llm.close()
        raise
    e.memory = engine_memory(plan, llm, e)  # planned against the model's buffers and this context's
    return e
