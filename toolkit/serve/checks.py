"""Checks of a completion request before it waits for the model: its fields, its model name, and
whether its prompt and output limit (`max_tokens`, or `max_completion_tokens`) fit in the context.
Each failure is raised as `http_errors.reject` (an HTTP answer, never shown to a person as a ctxq
error), so nothing malformed reaches llama-cpp-python, whose handlers would answer it with a 500.
"""

from __future__ import annotations

from ..runtime.runner import chat_prompt
from .http_errors import reject, validation_error
from .json_schema import check_schema, compile_schema
from .output import Expected

CHAT = "/v1/chat/completions"
COMPLETIONS = ("/v1/completions", "/v1/engines/copilot-codex/completions")


def is_object(data) -> dict:
    if not isinstance(data, dict):
        raise reject(400, "the body must be a JSON object", code="invalid_value")
    return data


def output_limit(path: str, data: dict) -> str:
    """`max_completion_tokens`, OpenAI's current name for the output limit (LangChain's ChatOpenAI sends it
    for its max_tokens), checked as `max_tokens` is and moved there: llama-cpp-python's handlers and the
    engine read only `max_tokens`, and would ignore it. Returns the name the client used, for messages.

    Both at once is refused as OpenAI's API refuses it (400, invalid_parameter_combination); llama.cpp's
    own server would take max_completion_tokens (server-schema.cpp: n_predict's aliases in that order)."""
    from pydantic import TypeAdapter, ValidationError

    value = data.pop("max_completion_tokens", None)
    if value is None:
        return "max_tokens"
    if data.get("max_tokens") is not None:
        raise reject(400, "`max_tokens` and `max_completion_tokens` cannot both be set; send "
                     "`max_completion_tokens` alone (`max_tokens` is its older name)", param="max_tokens",
                     code="invalid_parameter_combination")
    try:  # the same lax integer as `max_tokens` in llama-cpp-python's request models
        value = TypeAdapter(int).validate_python(value)
    except ValidationError:
        raise reject(400, "`max_completion_tokens` must be an integer (the most tokens to generate)",
                     param="max_completion_tokens", code="invalid_value") from None
    least = 1 if path == CHAT else 0  # completions take 0: "fill the context", as max_tokens
    if value < least:
        raise reject(400, f"`max_completion_tokens` is {value}; it must be {least} or more",
                     param="max_completion_tokens", code="invalid_value")
    data["max_tokens"] = value
    return "max_completion_tokens"


def validate(path: str, data) -> dict:
    """The request's fields, checked with llama-cpp-python's own request models plus what they let
    through but the handlers cannot do (several prompts, n > 1, empty messages, max_tokens < 1).
    The body is a JSON object (`is_object`), parsed by `body.parse`."""
    from pydantic import ValidationError
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

    chat = path == CHAT
    try:
        req = (CreateChatCompletionRequest if chat else CreateCompletionRequest).model_validate(data)
    except ValidationError as e:
        message, param = validation_error(e.errors(include_url=False, include_input=False))
        raise reject(400, message, param=param, code="invalid_value") from None
    if data.get("max_tokens") is not None:  # as parsed: "8" or 8.0 are 8 to the checks below
        data["max_tokens"] = req.max_tokens
    if chat and not data.get("messages"):
        raise reject(400, "`messages` is missing or empty; send at least one message", param="messages", code="invalid_value")
    if not chat and isinstance(data.get("prompt"), list) and len(data["prompt"]) > 1:
        raise reject(400, f"`prompt` holds {len(data['prompt'])} prompts; this server takes one per request",
                       param="prompt", code="invalid_value")
    if data.get("n") not in (None, 1):
        raise reject(400, f"n={data['n']}: this server returns one choice per request", param="n",
                       code="invalid_value")
    bias = data.get("logit_bias") or {}
    if data.get("logit_bias_type") != "tokens" and not all(k.lstrip("-").isdigit() for k in bias):
        raise reject(400, "`logit_bias` keys must be token ids (or set logit_bias_type to \"tokens\")",
                     param="logit_bias", code="invalid_value")
    max_tokens = data.get("max_tokens")
    if chat and max_tokens is not None and max_tokens < 1:  # completions take 0: "fill the context"
        raise reject(400, f"`max_tokens` is {max_tokens}; it must be 1 or more", param="max_tokens",
                       code="invalid_value")
    return data


def structured(path: str, data: dict) -> Expected | None:
    """A `response_format` with a schema (OpenAI's json_schema, or json_object with `schema` as
    llama-cpp-python has it) turned into `grammar`, compiled here (`json_schema`): llama-cpp-python's
    request model knows only text and json_object, and its handlers would compile json_object's
    schema with the converter's own string rule. What the output must then be, or None."""
    fmt = data.get("response_format")
    if fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text":
        data.pop("response_format", None)
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise reject(400, "`response_format.json_schema` must be an object with `name` and `schema`",
                         param="response_format", code="invalid_value")
        schema = spec["schema"]
    elif kind == "json_object":
        schema = fmt.get("schema", {"type": "object"})  # llama-cpp-python's JSON grammar: an object
    else:
        raise reject(400, "`response_format.type` must be text, json_object or json_schema",
                     param="response_format", code="invalid_value")
    for other in ("grammar", "tools", "functions"):
        if data.get(other):
            raise reject(400, f"`response_format` and `{other}` cannot be combined; send one", param=other,
                         code="invalid_value")
    if data.get("stop"):  # a stop string met inside a JSON string would cut the document
        raise reject(400, "`stop` cannot be combined with a JSON `response_format`: the grammar ends the output "
                     "when the JSON closes", param="stop", code="invalid_value")
    if not isinstance(schema, (dict, bool)):
        raise reject(400, "the schema must be a JSON object", param="response_format", code="invalid_value")
    check_schema(schema)
    data["grammar"] = compile_schema(schema)
    del data["response_format"]
    return Expected(schema, max_tokens=data.get("max_tokens"))


def check_model(data: dict, alias: str, names: set[str]) -> None:
    """404 for a model this server does not have; the request then names it by its alias, so every
    answer's `model` is the alias (llama-cpp-python would put the file's path on the server there)."""
    model = data.get("model")
    if model is not None and model not in names:
        raise reject(404, f"the model `{model}` does not exist; this server has `{alias}`", param="model",
                       code="model_not_found")
    data["model"] = alias


def check_grammar(llm, grammar: str | None, message: str = "`grammar` is not a GBNF grammar llama.cpp can "
                  "parse (it needs a `root ::= ...` rule)", param: str = "grammar") -> None:
    """400 for a grammar llama.cpp cannot parse: llama-cpp-python would hand the sampler chain the
    NULL that `llama_sampler_init_grammar` returns for it, and the process would crash."""
    import llama_cpp

    if grammar is None:
        return
    sampler = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise reject(400, message, param=param, code="invalid_value")
    llama_cpp.llama_sampler_free(sampler)


def check_with_model(llm, data: dict, expected: Expected | None = None) -> None:
    """What only the loaded model can tell: the grammar, token ids in `logit_bias`, and logprobs
    (llama-cpp-python computes them only for a model loaded with logits_all=True, which a plan
    does not do: it would keep n_ctx x n_vocab floats)."""
    if expected is not None and expected.schema is not None:  # the grammar compiled from the schema
        check_grammar(llm, data.get("grammar"), "the schema's grammar is more than llama.cpp's grammar parser "
                      "takes (a large maxLength or maxItems repeats a rule that many times)", "response_format")
    else:
        check_grammar(llm, data.get("grammar"))
    if data.get("logit_bias_type") != "tokens":
        outside = [k for k in data.get("logit_bias") or {} if not 0 <= int(k) < llm.n_vocab()]
        if outside:
            raise reject(400, f"`logit_bias` names token {outside[0]}, outside the vocabulary (0 to "
                         f"{llm.n_vocab() - 1})", param="logit_bias", code="invalid_value")
    chat_logprobs = data.get("logprobs") is True and data.get("top_logprobs") is not None
    completion_logprobs = "messages" not in data and data.get("logprobs") is not None
    if (chat_logprobs or completion_logprobs) and not llm._logits_all:
        raise reject(400, "this server does not return logprobs (the model is not loaded with logits_all=True)",
                     param="logprobs", code="invalid_value")


def prompt_tokens(llm, data: dict, path: str, expected: Expected | None = None) -> int:
    """Tokens the request's prompt will take, as llama-cpp-python will build it; `check_with_model` first."""
    check_with_model(llm, data, expected)
    if path == CHAT:
        msgs = data["messages"]
        try:  # the GGUF's template; a model without one is measured on its plain text
            prompt, has_bos = chat_prompt(llm, msgs)
        except Exception:
            prompt, has_bos = "\n".join(str(m.get("content") or "") for m in msgs if isinstance(m, dict)), False
        return len(llm.tokenize(prompt.encode("utf-8"), add_bos=not has_bos, special=True))
    prompt = data.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return len(llm.tokenize(prompt.encode("utf-8"), special=True)) + (1 if data.get("suffix") else 0)


def check_context(n: int, data: dict, n_ctx: int, limit: str = "max_tokens") -> None:
    """400 with the numbers when the prompt, or the prompt and `max_tokens`, do not fit; `limit`: the
    name the client gave the output limit (`output_limit`).

    An over-large max_tokens is refused, not clamped: OpenAI's API and vLLM answer it with a 400
    that clients already show (BadRequestError), while a clamp would return a shorter answer than
    the client planned for without saying so."""
    if n >= n_ctx:
        raise reject(400, f"this request's prompt is {n} tokens but the context holds {n_ctx}; shorten it, "
                       "or restart the server with a larger n_ctx", param="messages" if "messages" in data
                       else "prompt", code="context_length_exceeded", prompt_tokens=n, n_ctx=n_ctx)
    max_tokens = data.get("max_tokens")
    if max_tokens and n + max_tokens > n_ctx:
        raise reject(400, f"{limit} is {max_tokens} but the context leaves {n_ctx - n} tokens after the "
                       f"{n}-token prompt (n_ctx {n_ctx}); ask for {n_ctx - n} or fewer",
                       param=limit, code="context_length_exceeded", prompt_tokens=n, n_ctx=n_ctx,
                       max_tokens=max_tokens)
