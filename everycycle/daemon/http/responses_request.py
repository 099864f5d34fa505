"""Reading an OpenAI Responses request: ``instructions`` and ``input`` (a string, or
message, ``function_call`` and ``function_call_output`` items), function ``tools``,
``tool_choice``, ``reasoning``, ``text.format`` and the sampling options, as the fields
of a protocol Generate. Every mistake is an HttpError (400) naming the field.

We store no responses: ``previous_response_id`` (and ``conversation``) are refused, and
the whole conversation comes in ``input`` every time, as with ``store: false``.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request as HttpRequest

from ...errors import ProtocolError
from ...protocol import Message, Role, ToolCall
from . import openai_request
from .common import HttpError, joined_text

_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER,
          "assistant": Role.ASSISTANT}
_PARTS = ("input_text", "output_text", "text", "refusal")


def _bad(where: str, what: str) -> HttpError:
    return HttpError(400, f"{where}: {what}", "invalid_input")


def _content(where: str, content: object) -> str:
    """A message's content: a string, or text parts joined."""
    return joined_text(where, content, _PARTS, "input_text and output_text parts",
                       "invalid_input")


def _append(out: list[Message], where: str, role: Role, content: str,
            calls: tuple[ToolCall, ...] | None = None, call_id: str | None = None) -> None:
    try:
        out.append(Message(role, content, calls, call_id))
    except ProtocolError as exc:
        raise _bad(where, exc.message) from None


def _call(out: list[Message], where: str, item: dict[str, Any]) -> None:
    """A ``function_call`` item: a call of the assistant turn before it, if that is one."""
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
        raise _bad(where, "a function_call is {call_id, name, arguments: JSON text}")
    try:
        call = ToolCall(call_id, name, args)
    except ProtocolError as exc:
        raise _bad(where, exc.message) from None
    last = out[-1] if out else None
    if last is not None and last.role is Role.ASSISTANT:
        out.pop()
        _append(out, where, Role.ASSISTANT, last.text, (*(last.tool_calls or ()), call))
    else:
        _append(out, where, Role.ASSISTANT, "", (call,))


def messages(data: dict[str, Any]) -> tuple[Message, ...]:
    """``instructions`` and ``input`` as protocol Messages. Raises HttpError (400)."""
    for key in ("previous_response_id", "conversation"):
        if data.get(key) is not None:
            raise HttpError(400, f"`{key}`: responses are not stored here (each request is "
                            "answered as with store: false); send the whole conversation "
                            "in `input`", "unsupported_parameter")
    out: list[Message] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        _append(out, "instructions", Role.SYSTEM, instructions)
    raw = data.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise _bad("input", "must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":
            _call(out, where, item)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(where, "a function_call_output needs its call_id")
            _append(out, where, Role.TOOL, _content(f"{where}.output", output),
                    call_id=call_id)
        elif kind == "message" and item.get("role") in _ROLES:
            _append(out, where, _ROLES[item["role"]],
                    _content(f"{where}.content", item.get("content")))
        elif kind == "reasoning":
            continue  # earlier thoughts: the models' templates drop them too
        else:
            raise _bad(where, "items are messages {role, content}, function_call, "
                       "function_call_output or reasoning")
    return tuple(out)


def tools(data: dict[str, Any]) -> dict[str, Any]:
    """Function tools {type: function, name, description, parameters} and
    ``tool_choice``, as Generate's fields (through the chat completions reader)."""
    raw = data.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise _bad("tools", "must be a list of function tools")
    chat: list[dict[str, Any]] = []
    for i, tool in enumerate(raw or ()):
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(tool.get("name"), str)):
            raise _bad(f"tools[{i}]", "only function tools {type: function, name, "
                       "parameters} are supported")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        chat.append({"type": "function", "function": function})
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return openai_request.tools({"tools": chat, "tool_choice": choice,
                                 "parallel_tool_calls": data.get("parallel_tool_calls")})


def options(request: HttpRequest, data: dict[str, Any]) -> dict[str, Any]:
    """``max_output_tokens``, ``temperature``, ``top_p``, ``reasoning.effort``,
    ``text.format`` and the deadline header."""
    fields = openai_request.options(request, {
        "max_tokens": data.get("max_output_tokens"), "temperature": data.get("temperature"),
        "top_p": data.get("top_p")})
    reasoning = data.get("reasoning")
    if isinstance(reasoning, dict):
        fields.update(openai_request.thinking({"reasoning_effort": reasoning.get("effort")}))
    text = data.get("text")
    spec = text.get("format") if isinstance(text, dict) else None
    if isinstance(spec, dict) and spec.get("type") == "json_schema":
        spec = {"type": "json_schema", "json_schema": {"schema": spec.get("schema")}}
    fields.update(openai_request.response_format(spec))
    return fields


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The request's settings as a response object echoes them."""
    return {"instructions": data.get("instructions"),
            "max_output_tokens": data.get("max_output_tokens"),
            "temperature": data.get("temperature"), "top_p": data.get("top_p"),
            "tools": data.get("tools") or [], "tool_choice": data.get("tool_choice", "auto"),
            "parallel_tool_calls": data.get("parallel_tool_calls", False),
            "metadata": data.get("metadata") or {}, "store": False,
            "text": data.get("text") or {"format": {"type": "text"}}}
