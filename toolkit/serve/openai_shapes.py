"""What `ctxq serve --parallel` reads from an OpenAI-shaped request and writes back, in the shapes
llama-cpp-python's server gives (llama_cpp/llama_types.py), so a client sees no difference:

- the prompt's tokens: a chat through the GGUF's chat template, formatted as llama-cpp-python's
  `Jinja2ChatFormatter` does it (tools and tool_choice reach the template), BOS as the template says;
- the sampling parameters (`SamplingParams` of the engine), with llama-cpp-python's request defaults;
- the answer, a stream's chunks, and `usage` with `prompt_tokens_details.cached_tokens` (OpenAI's
  name for prompt tokens not evaluated again: here those shared with another sequence's cells).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from .checks import CHAT
from .http_errors import reject
from .json_schema import compile_schema


@dataclass
class Prompt:
    """A request as the engine takes it, and what its answer must say."""

    tokens: list[int]
    params: object  # ctxq.runtime.engine.SamplingParams
    chat: bool
    stream: bool
    include_usage: bool
    tool: str | None = None  # the function a tool call is forced to (its arguments are the output)
    echo: str = ""  # a completion's prompt, given back before the text (echo=True)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex


def formatter(llm):
    """The GGUF's chat template as llama-cpp-python's `Llama.__init__` builds its formatter, or None."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    m = llm._model
    template = m.metadata().get("tokenizer.chat_template")
    if not template:
        return None
    eos, bos = m.token_eos(), m.token_bos()
    return Jinja2ChatFormatter(template=template, eos_token=m.token_get_text(eos) if eos != -1 else "",
                               bos_token=m.token_get_text(bos) if bos != -1 else "", stop_token_ids=[eos])


def _stops(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [s for s in value if s]


def _logit_bias(llm, data: dict) -> dict[int, float]:
    bias = data.get("logit_bias") or {}
    if data.get("logit_bias_type") != "tokens":
        return {int(k): float(v) for k, v in bias.items()}
    out: dict[int, float] = {}  # keys are text: every token of it gets the bias (llama-cpp-python does so)
    for text, v in bias.items():
        for t in llm.tokenize(text.encode("utf-8"), add_bos=False, special=True):
            out[t] = float(v)
    return out


def read(llm, fmt, data: dict, path: str, n_ctx: int, seed: int | None) -> Prompt:
    """The request (checked by the gate: fields, schema grammar, tools) as tokens and sampling parameters."""
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

    from ..runtime.engine import SamplingParams

    chat = path == CHAT
    req = (CreateChatCompletionRequest if chat else CreateCompletionRequest).model_validate(data)
    stops, tool, grammar, echo = _stops(req.stop), None, data.get("grammar"), ""
    if chat:
        if fmt is None:
            raise reject(400, "this model has no chat template (tokenizer.chat_template); send the prompt to "
                         "/v1/completions", param="messages", code="invalid_value")
        choice = data.get("tool_choice")
        if isinstance(choice, dict):  # the gate let only a named function through: forced, as the template's handler does
            tool = (choice.get("function") or {}).get("name")
            params = next(t["function"].get("parameters", {"type": "object", "properties": {}})
                          for t in data["tools"] if t["function"]["name"] == tool)
            grammar = compile_schema(params)
        result = fmt(messages=data["messages"], tools=data.get("tools"), tool_choice=choice)
        tokens = llm.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
        stops += _stops(result.stop)
        max_tokens = req.max_tokens
    else:
        if data.get("suffix"):
            raise reject(400, "`suffix` (fill-in-the-middle) is not served with --parallel", param="suffix",
                         code="invalid_value")
        text = req.prompt if isinstance(req.prompt, str) else (req.prompt[0] if req.prompt else "")
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        echo = text if req.echo else ""
        max_tokens = req.max_tokens if req.max_tokens is None or req.max_tokens > 0 else None
    left = n_ctx - len(tokens)
    params = SamplingParams(
        max_tokens=min(max_tokens, left) if max_tokens else left,  # none given: up to the context, as llama.cpp
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        repeat_penalty=req.repeat_penalty, presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0, seed=req.seed if req.seed is not None else seed,
        logit_bias=_logit_bias(llm, data), grammar=grammar, stop=stops, min_tokens=req.min_tokens or 0)
    usage = (data.get("stream_options") or {}).get("include_usage") is True
    return Prompt(tokens, params, chat, bool(req.stream), usage, tool=tool, echo=echo)


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def timings(req) -> dict:
    """What drafting did for a request, in llama-server's names (its response's `timings`)."""
    return {"draft_n": req.draft_n, "draft_n_accepted": req.draft_n_accepted}


def finish(p: Prompt, reason: str) -> str:
    """The finish_reason to report: a forced tool call that ended by itself says tool_calls."""
    return "tool_calls" if p.tool is not None and reason == "stop" else reason


def _call(p: Prompt, arguments: str | None) -> dict:
    return {"id": "call_" + p.id.split("-", 1)[1][:24], "type": "function",
            "function": {"name": p.tool, "arguments": arguments}}


def answer(p: Prompt, alias: str, text: str, reason: str, use: dict, times: dict | None = None) -> dict:
    """The whole answer (not streamed); `times`: llama-server's `timings` (drafts), when the engine drafts."""
    extra = {"timings": times} if times is not None else {}
    if not p.chat:
        return {"id": p.id, "object": "text_completion", "created": p.created, "model": alias,
                "choices": [{"text": p.echo + text, "index": 0, "logprobs": None, "finish_reason": reason}],
                "usage": use, **extra}
    message = {"role": "assistant", "content": text} if p.tool is None else \
        {"role": "assistant", "content": None, "tool_calls": [_call(p, text)]}
    return {"id": p.id, "object": "chat.completion", "created": p.created, "model": alias,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish(p, reason)}],
            "usage": use, **extra}


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def chunk(p: Prompt, alias: str, piece: str | None, reason: str | None = None, first: bool = False,
          times: dict | None = None) -> bytes:
    """One stream event: a piece of text (None: only the finish_reason, or the opening role); `times` on the last
    (llama-server's `timings`)."""
    if not p.chat:
        body = {"id": p.id, "object": "text_completion", "created": p.created, "model": alias,
                "choices": [{"text": piece or "", "index": 0, "logprobs": None, "finish_reason": reason}]}
    else:
        if first:
            delta = {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **_call(p, "")}]} \
                if p.tool is not None else {"role": "assistant", "content": ""}
        elif piece is None:
            delta = {}
        elif p.tool is not None:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        else:
            delta = {"content": piece}
        body = {"id": p.id, "object": "chat.completion.chunk", "created": p.created, "model": alias,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish(p, reason) if reason else None}]}
    if p.include_usage:
        body["usage"] = None  # OpenAI's streams: null on every chunk but the last
    if times is not None:
        body["timings"] = times
    return _event(body)


def usage_chunk(p: Prompt, alias: str, use: dict) -> bytes:
    """A stream's last chunk with stream_options.include_usage: no choices, the usage."""
    return _event({"id": p.id, "object": "chat.completion.chunk" if p.chat else "text_completion",
                   "created": p.created, "model": alias, "choices": [], "usage": use})


DONE = b"data: [DONE]\n\n"
