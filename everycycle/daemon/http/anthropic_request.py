"""Reading an Anthropic Messages request: ``system``, the ``messages`` with their content
blocks, ``tools``, ``tool_choice``, ``thinking`` and the sampling options, as the fields
of a protocol Generate. Every mistake is an HttpError (400) naming the field.

Content blocks: ``text``; ``tool_use`` (assistant) becomes a tool call; ``tool_result``
(user) becomes a ``tool`` message answering its ``tool_use_id`` (``is_error`` prefixes
its content with ``Error:``); ``thinking``/``redacted_thinking`` in an assistant's history
are dropped, as the models' templates drop earlier thoughts; ``image`` blocks are
taken. Other blocks (documents, server tool results) are refused.

A ``system``-role message inside ``messages`` (Claude Code sends them) joins the system
prompt, which leads the conversation as every template wants it. ``cache_control`` on
any block, tool flags (``defer_loading``, ``cache_control``; ``strict: true`` has the
tool's schema enforced whole or refused), server tools
(``web_search_*``, ``bash_*``, ...: we run none; they are left out of the prompt, with a
debug line) and ``metadata``/``context_management``/``output_config``/``service_tier``
are accepted; ``output_config.effort`` asks a thinking model to think.

Claude Code starts its system prompt with an ``x-anthropic-billing-header:`` line whose
fields change between requests (a build hash, an entry point): it is Anthropic's billing
metadata, not an instruction, and left in it would make every request's prompt differ
from its first token, so no cached prefix could ever be reused. The line is left out.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from starlette.requests import Request as HttpRequest

from ...errors import ProtocolError
from ...protocol import (
    ContentPart,
    Message,
    PartType,
    Role,
    ThinkEffort,
    ToolCall,
    ToolChoice,
    sampling,
)
from .common import HttpError, deadline, image_part, joined_text, priority, sampling_options
from .openai_request import check_types

log = logging.getLogger(__name__)

_BILLING = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)
"""Claude Code's billing line (see the module's doc)."""

_CHOICES = {"auto": ToolChoice.AUTO, "any": ToolChoice.REQUIRED, "none": ToolChoice.NONE}


def _bad(where: str, what: str) -> HttpError:
    return HttpError(400, f"{where}: {what}", "invalid_request")


def _message(where: str, role: Role, content: str | tuple[ContentPart, ...],
             calls: tuple[ToolCall, ...] | None = None,
             call_id: str | None = None) -> Message:
    try:
        return Message(role, content, calls, call_id)
    except ProtocolError as exc:
        raise _bad(where, exc.message) from None


def text_of(where: str, content: object) -> str:
    """A string, or a list of text blocks joined (``system``, a tool result's content)."""
    return joined_text(where, content, ("text",), "text blocks", "invalid_request")


def _call(where: str, block: dict[str, Any]) -> ToolCall:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, dict)):
        raise _bad(where, "a tool_use block is {id, name, input: {...}}")
    try:
        return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))
    except ProtocolError as exc:
        raise _bad(where, exc.message) from None


def _result(where: str, block: dict[str, Any]) -> Message:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise _bad(where, "a tool_result block needs its tool_use_id")
    content = block.get("content")
    text = "" if content is None else text_of(f"{where}.content", content)
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return _message(where, Role.TOOL, text, call_id=call_id)


def _turn(where: str, role: str, blocks: list[Any]) -> list[Message]:
    """One Anthropic message as protocol Messages: a user's tool results come first (as
    Anthropic requires them first), then the rest of its text."""
    text: list[str] = []
    images: list[tuple[int, ContentPart]] = []  # (where in the text, the image)
    calls: list[ToolCall] = []
    out: list[Message] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "image" and role == "user":
            source = block.get("source")
            if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
                raise _bad(f"{at}.source", "must be {type: base64, media_type, data}")
            images.append((len(text), image_part(
                f"{at}.source", source.get("data") if source["type"] == "base64"
                else source.get("url"), source.get("media_type"))))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(at, block))
        elif kind == "tool_result" and role == "user":
            out.append(_result(at, block))
        else:
            raise _bad(at, f"{json.dumps(kind)[:40]} blocks are not supported in a {role} "
                       "message (text, image, tool_use, tool_result, thinking)")
    if role == "assistant" and (text or calls):
        out.append(_message(where, Role.ASSISTANT, "".join(text), tuple(calls) or None))
    elif role == "user" and images:
        parts: list[ContentPart] = []
        for k, piece in enumerate(text + [""]):
            parts.extend(image for at, image in images if at == k)
            if piece:
                parts.append(ContentPart(PartType.TEXT, piece))
        out.append(_message(where, Role.USER, tuple(parts)))
    elif role == "user" and (text or not out):
        out.append(_message(where, Role.USER, "".join(text)))
    return out


def _system_text(where: str, content: object) -> str:
    """A system prompt's text without Claude Code's billing line (a block of its own
    in the requests it sends; a line wherever it is)."""
    text = text_of(where, content)  # (checks every block)
    if "x-anthropic-billing-header:" not in text:
        return text
    log.debug("%s: an x-anthropic-billing-header line is left out of the prompt", where)
    if isinstance(content, list):
        return "".join(_BILLING.sub("", block["text"]) for block in content)
    return _BILLING.sub("", text)


def messages(data: dict[str, Any]) -> tuple[Message, ...]:
    """``system`` and ``messages`` as protocol Messages. Raises HttpError (400)."""
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "must be a non-empty list")
    out: list[Message] = []
    systems: list[str] = []
    system = data.get("system")
    if system is not None and (text := _system_text("system", system)):
        systems.append(text)
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        role = item.get("role") if isinstance(item, dict) else None
        if role == "system":  # (Claude Code's): into the one system prompt, in order
            if text := _system_text(f"{where}.content", item.get("content")):
                systems.append(text)
            continue
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role", "must be user, assistant or system")
        content = item.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _bad(f"{where}.content", "must be a string or a list of content blocks")
        out.extend(_turn(where, role, blocks))
    if systems:
        out.insert(0, _message("system", Role.SYSTEM, "\n\n".join(systems)))
    if not any(m.role is not Role.SYSTEM for m in out):
        raise _bad("messages", "needs a user or assistant message")
    return tuple(out)


def _tool(i: int, tool: object) -> dict[str, Any] | None:
    """An Anthropic tool {name, description, input_schema} as an OpenAI function tool;
    None for a server tool (``web_search_20250305``, ...), which we do not run."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise _bad(where, "a tool is {name, description?, input_schema: {...}}")
    kind = tool.get("type", "custom")
    if kind != "custom" and tool.get("input_schema") is None:
        log.debug("%s: a %r server tool is not run here; left out of the prompt", where,
                  kind)
        return None
    name, schema = tool.get("name"), tool.get("input_schema")
    description = tool.get("description", "")
    if not (isinstance(name, str) and isinstance(schema, dict)
            and isinstance(description, str)):
        raise _bad(where, "a tool is {name, description?, input_schema: {...}}")
    function: dict[str, Any] = {"name": name, "description": description, "parameters": schema}
    if tool.get("strict") is True:  # (enforced whole, or refused)
        function["strict"] = True
    return {"type": "function", "function": function}


def tools(data: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as Generate's tools, tool_choice, tool_name and
    parallel_tool_calls (``any`` is ``required``; ``disable_parallel_tool_use``)."""
    raw, choice = data.get("tools"), data.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice", 'must be {"type": "auto" | "any" | "tool" | "none"}')
    if not raw:
        if kind in ("any", "tool"):
            raise _bad("tool_choice", "needs `tools`")
        return {}
    if not isinstance(raw, list):
        raise _bad("tools", "must be a list of tools")
    offered = [tool for i, t in enumerate(raw) if (tool := _tool(i, t)) is not None]
    if not offered:
        return {}
    fields: dict[str, Any] = {"tools": json.dumps(offered, ensure_ascii=False)}
    if isinstance(choice, dict):
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise _bad("tool_choice.name", "must name one of the tools")
            fields["tool_name"] = choice["name"]
        else:
            fields["tool_choice"] = _CHOICES[str(kind)]
        disable = choice.get("disable_parallel_tool_use")
        if disable is not None:
            if not isinstance(disable, bool):
                raise _bad("tool_choice.disable_parallel_tool_use", "must be a boolean")
            fields["parallel_tool_calls"] = not disable
    return fields


def thinking(data: dict[str, Any]) -> dict[str, Any]:
    """``thinking`` {type: enabled | adaptive | disabled} as Generate's ``think``
    (``adaptive``: as the model does by default, unless ``output_config.effort`` asks)."""
    raw = data.get("thinking")
    config = data.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None
    if effort is not None and not isinstance(effort, str):
        raise _bad("output_config.effort", "must be a string (low, medium, high)")
    # (an effort we have no budget for, "max" say, still thinks: the model's default)
    known = effort in ("low", "medium", "high")
    asked = ({"think": True, "think_effort": ThinkEffort(effort)} if known
             else {"think": True} if effort else {})
    if raw is None:
        return asked
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise _bad("thinking", 'must be {"type": "enabled" | "adaptive" | "disabled"}')
    if kind == "adaptive":
        return asked
    if kind == "disabled":
        return {"think": False}
    budget = raw.get("budget_tokens")
    if budget is None:
        return {**asked, "think": True}
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise _bad("thinking.budget_tokens", "must be a whole number of tokens")
    return {**asked, "think": True, "think_budget": budget}


def options(request: HttpRequest, data: dict[str, Any], *, counting: bool = False
            ) -> dict[str, Any]:
    """``max_tokens`` (required, as Anthropic requires it, unless ``counting``),
    ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` and the deadline header."""
    if data.get("max_tokens") is None and not counting:
        raise _bad("max_tokens", "is required")
    fields = {} if counting else sampling_options(sampling.ANTHROPIC, data)
    if data.get("max_tokens") is not None and not counting:
        fields["max_tokens"] = data["max_tokens"]
    stops = data.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise _bad("stop_sequences", "must be a list of strings")
        if stops and not counting:
            fields["stop"] = tuple(stops)
    limit = deadline(request)
    if limit is not None:
        fields["deadline_ms"] = limit
    if not counting:
        fields.update(priority(request))
    check_types(fields)
    return fields
