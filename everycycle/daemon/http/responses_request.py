"""Reading an OpenAI Responses request: ``instructions`` and ``input`` (a string, or
message, ``function_call`` and ``function_call_output`` items), function ``tools``,
``tool_choice``, ``reasoning``, ``text.format`` and the sampling options, as the fields
of a protocol Generate. Every mistake is an HttpError (400) naming the field.

We store no responses: ``previous_response_id`` (and ``conversation``) are refused, and
the whole conversation comes in ``input`` every time, as with ``store: false``.

What agents send (Codex): ``developer`` and ``system`` messages join the system prompt,
which leads the conversation; ``namespace`` tools offer their functions as
``NAMESPACE.NAME`` (a call comes back as ``{namespace, name}``); a ``custom`` (freeform)
tool is a function taking one string, ``input``, and its call comes back as a
``custom_tool_call``; built-in tools (``web_search``, ``local_shell``, ``file_search``,
``computer_use``, ...) are not run here and are left out of the prompt (a debug line);
``include``, ``store``, ``prompt_cache_key``, ``client_metadata``, ``service_tier`` and
``reasoning.summary`` are accepted and ignored.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request as HttpRequest

from ...errors import ProtocolError
from ...protocol import Message, Role, ToolCall, sampling
from . import openai_request
from .common import HttpError, joined_text

_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER,
          "assistant": Role.ASSISTANT}
_PARTS = ("input_text", "output_text", "text", "refusal")
CUSTOM_INPUT = "input"
"""The one string argument of a custom (freeform) tool offered as a function."""

log = logging.getLogger(__name__)


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
    """A ``function_call`` (or ``custom_tool_call``) item: a call of the assistant turn
    before it, if that is one."""
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if item.get("type") == "custom_tool_call":
        raw = item.get("input", "")
        args = json.dumps({CUSTOM_INPUT: raw}, ensure_ascii=False) if isinstance(
            raw, str) else None
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
        raise _bad(where, "a function_call is {call_id, name, arguments: JSON text}")
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = f"{namespace}.{name}"
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
    systems: list[str] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        if instructions:
            systems.append(instructions)
    raw = data.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise _bad("input", "must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in ("function_call", "custom_tool_call"):
            _call(out, where, item)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id, output = item.get("call_id"), item.get("output")
            # Codex also sends outputs it made itself (a goal's objective), named by
            # `name` and `namespace` with no call before them: a tool result of no call.
            if not isinstance(call_id, str) and not isinstance(item.get("name"), str):
                raise _bad(where, f"a {kind} needs its call_id (or the name of its tool)")
            call_id = call_id if isinstance(call_id, str) else None
            _append(out, where, Role.TOOL, _content(f"{where}.output", output),
                    call_id=call_id)
        elif kind == "message" and item.get("role") in ("system", "developer"):
            if text := _content(f"{where}.content", item.get("content")):
                systems.append(text)  # into the one system prompt, in order
        elif kind == "message" and item.get("role") in _ROLES:
            _append(out, where, _ROLES[item["role"]],
                    _content(f"{where}.content", item.get("content")))
        elif kind == "reasoning":
            continue  # earlier thoughts: the models' templates drop them too
        elif isinstance(kind, str) and kind.endswith("_call") or kind in (
                "item_reference", "compaction"):
            log.debug("%s: a %s item is not ours to replay; left out", where, kind)
        else:
            raise _bad(where, "items are messages {role, content}, function_call, "
                       "function_call_output, custom_tool_call(_output) or reasoning")
    if systems:
        out.insert(0, Message(Role.SYSTEM, "\n\n".join(systems)))
    if not any(m.role is not Role.SYSTEM for m in out):
        raise _bad("input", "needs a user message")
    return tuple(out)


def _function(where: str, tool: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A function or custom tool as a chat completions function (``prefix``: its
    namespace's name and a dot)."""
    if not isinstance(tool.get("name"), str):
        raise _bad(where, "a tool needs its name")
    # (in chat's order, name first: the same tools render the same prompt in either API)
    function: dict[str, Any] = {"name": prefix + tool["name"]}
    function.update((k, tool[k]) for k in ("description", "parameters", "strict") if k in tool)
    if tool.get("type") == "custom":  # freeform: one string
        function["parameters"] = {
            "type": "object", "required": [CUSTOM_INPUT], "additionalProperties": False,
            "properties": {CUSTOM_INPUT: {"type": "string", "description":
                                          "The tool's whole input, as free text."}}}
    return {"type": "function", "function": function}


def _offered(raw: list[Any]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in ("function", "custom"):
            chat.append(_function(where, tool))
        elif kind == "namespace" and isinstance(tool.get("name"), str):
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise _bad(f"{where}.tools", "must be a list of function tools")
            for j, t in enumerate(inner):
                if isinstance(t, dict) and t.get("type", "function") in ("function", "custom"):
                    chat.append(_function(f"{where}.tools[{j}]", t, f"{tool['name']}."))
        elif isinstance(kind, str):
            log.debug("%s: a built-in %s tool is not run here; left out of the prompt",
                      where, kind)
        else:
            raise _bad(where, "a tool is {type: function, name, parameters}")
    return chat


def custom_tools(data: dict[str, Any]) -> frozenset[str]:
    """The names (as offered) of the request's custom tools, whose calls go back as
    ``custom_tool_call`` items."""
    names: set[str] = set()
    for tool in data.get("tools") or ():
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "custom":
            names.add(str(tool.get("name")))
        elif tool.get("type") == "namespace":
            names.update(f"{tool.get('name')}.{t.get('name')}" for t in tool.get("tools") or ()
                         if isinstance(t, dict) and t.get("type") == "custom")
    return frozenset(names)


def tools(data: dict[str, Any]) -> dict[str, Any]:
    """Function, custom and namespace tools and ``tool_choice``, as Generate's fields
    (through the chat completions reader)."""
    raw = data.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise _bad("tools", "must be a list of function tools")
    chat = _offered(raw or [])
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(choice, dict):  # (a built-in tool's type: not run here)
        choice = "auto"
    if not chat and choice in ("auto", "none", None):
        choice = None
    return openai_request.tools({"tools": chat, "tool_choice": choice,
                                 "parallel_tool_calls": data.get("parallel_tool_calls")})


def options(request: HttpRequest, data: dict[str, Any]) -> dict[str, Any]:
    """``max_output_tokens``, ``temperature``, ``top_p``, ``reasoning.effort``,
    ``text.format`` and the deadline header."""
    fields = openai_request.options(request, {
        "max_tokens": data.get("max_output_tokens"), "service_tier": data.get("service_tier"),
        **{k: data[k] for k in sampling.BY_NAME if k in data}}, sampling.RESPONSES)
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
