"""`tools` / `tool_choice` in OpenAI's shape, accepted where llama-cpp-python's chat handler for the
model can call them, and refused with a 400 that says why elsewhere.

What the handlers do (llama_cpp/llama_chat_format.py, 0.3.36):
- "chatml-function-calling" (`chatml_function_calling`): tool_choice "auto" (a grammar that lets the
  model answer or call one of the tools), a named function (its parameters' grammar), "none".
  Without tool_choice it ignores the tools; "required" fails an assertion.
- every handler made from a chat template or a chat format (`chat_formatter_to_chat_completion_handler`):
  only a named function, which it forces with its parameters' grammar; with "auto" the tools reach
  at most the template, and no tool call is ever parsed out of the answer.
- other handlers (functionary, llava, ...): not offered here.
Legacy `functions` / `function_call` become tools / tool_choice, as the handlers convert them.
"""

from __future__ import annotations

from .http_errors import reject
from .json_schema import check_schema, compile_schema
from .output import Expected

AUTO_HANDLERS = {"chatml-function-calling"}  # handlers that can choose between answering and calling


def _handler_name(llm) -> str | None:
    """The chat format whose handler answers, or None for a handler llama-cpp-python was given."""
    return None if llm.chat_handler is not None else llm.chat_format


def _generic(llm, name: str | None) -> bool:
    from llama_cpp import llama_chat_format

    if name is None:
        return False
    if name in llm._chat_handlers:  # the GGUF's own templates (Jinja2ChatFormatter)
        return True
    registry = llama_chat_format.LlamaChatCompletionHandlerRegistry()._chat_handlers
    handler = registry.get(name)
    return handler is not None and handler.__qualname__.startswith("chat_formatter_to_chat_completion_handler")


def _bad(message: str, param: str = "tools"):
    return reject(400, message, param=param, code="invalid_value")


def check_tools(llm, data: dict) -> Expected | None:
    """None without tools; else what a tool call must be (its arguments against its parameters)."""
    if data.get("functions") and not data.get("tools"):
        data["tools"] = [{"type": "function", "function": f} for f in data.pop("functions")]
    call = data.pop("function_call", None)
    if call is not None and data.get("tool_choice") is None:
        data["tool_choice"] = {"type": "function", "function": {"name": call["name"]}} \
            if isinstance(call, dict) and "name" in call else call
    tools, choice = data.get("tools"), data.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise _bad("`tool_choice` names a tool but `tools` is missing or empty", "tool_choice")
        data.pop("tool_choice", None)
        return None
    if choice == "none":
        return None
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or tool.get("type", "function") != "function":
            raise _bad(f"`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        check_schema(params)
        compile_schema(params)  # a 400 naming a keyword the grammar cannot honour
        functions[fn["name"]] = params
    name = _handler_name(llm)
    forced = isinstance(choice, dict)
    if forced:
        wanted = (choice.get("function") or {}).get("name")
        if wanted not in functions:
            raise _bad(f"`tool_choice` names `{wanted}`, which is not among the tools", "tool_choice")
        functions = {wanted: functions[wanted]}
    if name in AUTO_HANDLERS:
        if choice == "required" or (choice is not None and choice != "auto" and not forced):
            raise _bad(f"tool_choice {choice!r}: the chat handler `{name}` takes \"auto\", \"none\" or a named "
                       "function", "tool_choice")
        data.setdefault("tool_choice", "auto")  # it ignores tools without one; OpenAI's default is auto
    elif not (forced and _generic(llm, name)):
        how = "calls a tool only when `tool_choice` names one ({\"type\": \"function\", \"function\": " \
              "{\"name\": ...}})" if _generic(llm, name) else "does not call tools"
        raise _bad(f"this model's chat handler (`{name or 'custom'}`) {how}; tool_choice \"auto\" and \"required\" "
                   "need a function-calling chat format (ctxq serve --chat-format chatml-function-calling)",
                   "tool_choice" if _generic(llm, name) else "tools")
    return Expected(tools=functions, max_tokens=data.get("max_tokens"))
