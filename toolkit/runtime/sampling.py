"""Sampling settings of one request, and the llama.cpp sampler chain that applies them to its sequence.

One chain per sequence holds that sequence's grammar, penalty window and random state:
`llama_sampler_sample(chain, ctx, i)` reads row i of the last batch's logits, applies the chain and
accepts the token into it itself (`src/llama-sampler.cpp`, llama_sampler_sample).
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass, field

from ..errors import InvalidOption
from ..llama import backend

# llama.cpp's own defaults (common/common.h, common_params_sampling): the penalty window, the
# tokens top_p / min_p always keep.
PENALTY_LAST_N = 64
MIN_KEEP = 1


@dataclass
class SamplingParams:
    """What one request asks for; the names are llama.cpp's (temperature 0 is greedy)."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None  # GBNF text (structured output, tool calls)
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # the end-of-sequence token is refused before this many (llama-cpp-python's MinTokens...)

    def check(self, n_vocab: int) -> None:
        """Refuse values llama.cpp's samplers cannot take, with the setting's name."""
        if self.max_tokens < 0:
            raise InvalidOption(f"max_tokens must be 0 or more, got {self.max_tokens}", option="max_tokens",
                                value=self.max_tokens)
        if not 0.0 <= self.top_p <= 1.0 or not 0.0 <= self.min_p <= 1.0:
            raise InvalidOption("top_p and min_p must be between 0 and 1", option="top_p", value=self.top_p)
        bad = [t for t in self.logit_bias if not 0 <= int(t) < n_vocab]
        if bad:
            raise InvalidOption(f"logit_bias names token {bad[0]}, outside the vocabulary of {n_vocab}",
                                option="logit_bias", value=bad[0], limit=n_vocab)
        if self.min_tokens < 0:
            raise InvalidOption(f"min_tokens must be 0 or more, got {self.min_tokens}", option="min_tokens",
                                value=self.min_tokens)
        if any(not s for s in self.stop):
            raise InvalidOption("a stop string is empty", option="stop", value="")


class Chain:
    """A llama.cpp sampler chain for one sequence; `close()` frees it."""

    def __init__(self, vocab, n_vocab: int, p: SamplingParams):
        lc = backend.llama_cpp()
        self._lc = lc
        self.ptr = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        self.min_tokens = p.min_tokens
        try:
            if p.min_tokens > 0:  # first in the chain, as llama-cpp-python's logits processor is (Llama._init_sampler)
                eos = (lc.llama_logit_bias * 1)()
                eos[0].token, eos[0].bias = lc.llama_vocab_eos(vocab), float("-inf")
                lc.llama_sampler_chain_add(self.ptr, lc.llama_sampler_init_logit_bias(n_vocab, 1, eos))
            self._build(lc, vocab, n_vocab, p)
        except BaseException:
            self.close()
            raise

    def _build(self, lc, vocab, n_vocab: int, p: SamplingParams) -> None:
        add = lambda s: lc.llama_sampler_chain_add(self.ptr, s)  # noqa: E731 (the chain owns what it is given)
        if p.logit_bias:
            arr = (lc.llama_logit_bias * len(p.logit_bias))()
            for i, (tok, bias) in enumerate(p.logit_bias.items()):
                arr[i].token, arr[i].bias = int(tok), float(bias)
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), arr))
        if p.grammar:
            g = lc.llama_sampler_init_grammar(vocab, p.grammar.encode("utf-8"), b"root")
            if not g:  # NULL is llama_grammar_init_impl's answer to bad GBNF; its parser printed where on stderr
                raise InvalidOption("the grammar does not parse as GBNF (llama.cpp printed where on stderr)",
                                    option="grammar")
            add(g)
        if p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            add(lc.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, p.repeat_penalty, p.frequency_penalty,
                                                p.presence_penalty))
        if p.temperature <= 0:
            add(lc.llama_sampler_init_greedy())
            return
        # common_sampler's order (common/sampling.cpp): top_k, top_p, min_p, then temperature, then draw
        if p.top_k > 0:
            add(lc.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            add(lc.llama_sampler_init_top_p(p.top_p, MIN_KEEP))
        if p.min_p > 0.0:
            add(lc.llama_sampler_init_min_p(p.min_p, MIN_KEEP))
        add(lc.llama_sampler_init_temp(p.temperature))
        seed = p.seed if p.seed is not None else random.getrandbits(32)
        add(lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))

    def sample(self, ctx, i: int) -> int:
        """The token drawn from output row `i` of the last decode (accepted into the chain)."""
        return self._lc.llama_sampler_sample(self.ptr, ctx, ctypes.c_int32(i))

    def accepted(self, n_generated: int) -> None:
        """`n_generated` tokens are out: at min_tokens the end token's refusal leaves the chain. llama-cpp-python's
        MinTokensLogitsProcessor refuses token_eos (only) while fewer than min_tokens were generated."""
        if self.min_tokens and n_generated >= self.min_tokens:
            self._lc.llama_sampler_free(self._lc.llama_sampler_chain_remove(self.ptr, 0))
            self.min_tokens = 0

    def close(self) -> None:
        if self.ptr:
            self._lc.llama_sampler_free(self.ptr)
            self.ptr = None
