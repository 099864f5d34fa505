"""Reading an OpenAI request: a chat's messages (with tool calls and results), its
tools and tool choice, sampling and stopping options, and response formats, as the
fields of a protocol Generate. Every mistake is an HttpError (400) naming the field."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request as HttpRequest

from ...chatfmt.constraint import JSON_OBJECT_SCHEMA
from ...errors import ProtocolError
from ...protocol import (
    ContentPart,
    LoraScale,
    Message,
    PartType,
    Role,
    ThinkEffort,
    ToolCall,
    ToolChoice,
    sampling,
)
from .common import HttpError, deadline, image_part, priority, sampling_options

_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER,
          "assistant": Role.ASSISTANT, "tool": Role.TOOL}


def options(request: HttpRequest, data: dict[str, Any], dialect: str = sampling.OPENAI
            ) -> dict[str, Any]:
    """The sampling and stopping options of a chat or text completion (or of the
    Responses API, ``dialect``)."""
    options: dict[str, Any] = sampling_options(dialect, data)
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    n_predict = data.get("n_predict")  # (llama-server's, which its clients send here too)
    if max_tokens is None and isinstance(n_predict, int) and not isinstance(n_predict, bool):
        # 0: read the prompt only (a warm-up: one token is the least we generate)
        max_tokens = max(1, n_predict) if n_predict >= 0 else None
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    stop = data.get("stop")
    if isinstance(stop, str):
        options["stop"] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        options["stop"] = tuple(stop) or None
    elif stop is not None:
        raise HttpError(400, "`stop` must be a string or a list of strings", "invalid_type")
    ignore_eos = data.get("ignore_eos")  # llama-server's (and vLLM's): a fixed length
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise HttpError(400, "`ignore_eos` must be a boolean", "invalid_type")
        if ignore_eos:
            options["ignore_eos"] = True
    grammar = data.get("grammar")  # llama-server's extension: a GBNF grammar
    if grammar not in (None, ""):  # (an empty one, as SillyTavern sends: none)
        if not isinstance(grammar, str):
            raise HttpError(400, "`grammar` must be a GBNF string", "invalid_type")
        options["grammar"] = grammar
    limit = deadline(request)
    if limit is not None:
        options["deadline_ms"] = limit
    options.update(priority(request, data))
    options.update(lora(data.get("lora")))
    check_types(options)
    return options


def lora(raw: object) -> dict[str, Any]:
    """llama-server's per-request ``lora``: ``[{"id": 0, "scale": 0.5}, …]`` as
    Generate's ``lora``. Raises HttpError."""
    if raw is None:
        return {}
    if not isinstance(raw, list) or not all(
            isinstance(item, dict) and _number(item.get("id"), int)
            and _number(item.get("scale"), int | float) for item in raw):
        raise HttpError(400, '`lora` must be a list of {"id": integer, "scale": number}',
                        "invalid_type")
    try:
        return {"lora": tuple(LoraScale(item.get("id"), item.get("scale")) for item in raw)}
    except ProtocolError as exc:
        raise HttpError(400, f"`lora`: {exc.message}", "invalid_value") from None


def _number(value: object, kind: Any) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def check_types(options: dict[str, Any]) -> None:
    """``max_tokens`` an integer (a bool is none; the sampling parameters' types are
    their table's to check). Raises HttpError."""
    value = options.get("max_tokens")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise HttpError(400, "`max_tokens` must be an integer", "invalid_type")


def response_format(raw: object) -> dict[str, str]:
    """OpenAI's ``response_format`` to Generate's ``json_schema``. Raises HttpError."""
    if raw is None:
        return {}
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema" and isinstance(raw, dict):
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise HttpError(400, "response_format.json_schema.schema must be an object",
                             "invalid_response_format")
        return {"json_schema": json.dumps(schema)}
    raise HttpError(400, "response_format.type must be text, json_object or json_schema",
                     "invalid_response_format")


def _content(i: int, content: object, *, nullable: bool) -> str | tuple[ContentPart, ...]:
    """A message's content: a string, or its parts (text joined; images as image parts,
    from ``image_url`` data URLs), null where allowed."""
    if content is None and nullable:
        return ""
    if isinstance(content, list):
        parts: list[ContentPart] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                if parts and parts[-1].type is PartType.TEXT:
                    parts[-1] = ContentPart(PartType.TEXT, (parts[-1].text or "") + part["text"])
                else:
                    parts.append(ContentPart(PartType.TEXT, part["text"]))
            elif kind == "image_url":
                url = part.get("image_url")
                parts.append(image_part(f"messages[{i}].content[{j}].image_url",
                                        url.get("url") if isinstance(url, dict) else url))
            else:
                raise HttpError(400, f"messages[{i}].content[{j}]: only text and image_url "
                                "parts are supported", "unsupported_content")
        if not any(p.type is PartType.IMAGE for p in parts):
            return "".join(p.text or "" for p in parts)
        return tuple(parts)
    if not isinstance(content, str):
        raise HttpError(400, f"messages[{i}].content must be a string or a list of parts",
                        "invalid_messages")
    return content


def _calls(i: int, raw: object) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list) or not raw:
        raise HttpError(400, f"{where} must be a non-empty list", "invalid_messages")
    out = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise HttpError(400, f"{where}[{j}] must be {{id, type: function, function: "
                            "{name, arguments}}", "invalid_messages")
        args = function.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call_id = call.get("id") or f"call_{i}_{j}"
        try:
            out.append(ToolCall(str(call_id), function["name"], args))
        except ProtocolError as exc:
            raise HttpError(400, f"{where}[{j}]: {exc.message}", "invalid_messages") from None
    return tuple(out)


def messages(raw: object) -> tuple[Message, ...]:
    """OpenAI chat messages to protocol Messages. Raises HttpError (400)."""
    if not isinstance(raw, list) or not raw:
        raise HttpError(400, "`messages` must be a non-empty list", "invalid_messages")
    out: list[Message] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise HttpError(400, f"messages[{i}] must be an object", "invalid_messages")
        given = item.get("role")
        role = _ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise HttpError(400, f"messages[{i}].role must be system, developer, user, "
                            f"assistant or tool (got {json.dumps(given)[:40]})",
                            "invalid_messages")
        calls = (_calls(i, item["tool_calls"]) if role is Role.ASSISTANT
                 and item.get("tool_calls") else None)
        content = _content(i, item.get("content"), nullable=calls is not None)
        call_id = item.get("tool_call_id") if role is Role.TOOL else None
        if role is Role.TOOL and not isinstance(call_id, str):
            raise HttpError(400, f"messages[{i}].tool_call_id must be a string",
                            "invalid_messages")
        try:
            out.append(Message(role, content, calls, call_id))
        except ProtocolError as exc:
            raise HttpError(400, f"messages[{i}]: {exc.message}", "invalid_messages") from None
    return tuple(out)


def tools(data: dict[str, Any]) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as Generate's fields."""
    raw = data.get("tools")
    choice = data.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise HttpError(400, "`tool_choice` needs `tools`", "invalid_tools")
        return {}
    if not isinstance(raw, list):
        raise HttpError(400, "`tools` must be a list of tool objects", "invalid_tools")
    fields: dict[str, Any] = {"tools": json.dumps(raw, ensure_ascii=False)}
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        fields["tool_choice"] = ToolChoice(choice)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and isinstance(
            choice["function"].get("name"), str):
        fields["tool_name"] = choice["function"]["name"]
    elif choice is not None:
        raise HttpError(400, "`tool_choice` must be auto, none, required or "
                        '{"type": "function", "function": {"name": ...}}', "invalid_tools")
    parallel = data.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise HttpError(400, "`parallel_tool_calls` must be a boolean", "invalid_type")
        fields["parallel_tool_calls"] = parallel
    return fields


def thinking(data: dict[str, Any]) -> dict[str, Any]:
    """Whether a thinking model thinks, and how much: ``reasoning_effort`` (``none`` or
    ``minimal``: no; low, medium, high: that effort's budget), llama-server's
    ``thinking_budget_tokens``, or the extension ``think`` (a boolean), as Generate's
    ``think``, ``think_effort`` and ``think_budget``."""
    fields: dict[str, Any] = {}
    budget = data.get("thinking_budget_tokens")
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise HttpError(400, "`thinking_budget_tokens` must be a whole number of tokens "
                            "(0 or more)", "invalid_value")
        fields["think_budget"] = budget
    think = data.get("think")
    if think is not None:
        if not isinstance(think, bool):
            raise HttpError(400, "`think` must be a boolean", "invalid_type")
        return {**fields, "think": think}
    effort = data.get("reasoning_effort")
    if effort is None:
        return fields
    if effort not in ("none", "minimal", "low", "medium", "high"):
        raise HttpError(400, "`reasoning_effort` must be none, minimal, low, medium or high",
                        "invalid_value")
    if effort in ("none", "minimal"):
        return {**fields, "think": False}
    return {**fields, "think": True, "think_effort": ThinkEffort(effort)}


def logprobs(data: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """Chat's ``logprobs: true`` with ``top_logprobs: N``, or a completion's ``logprobs: N``,
    as Generate's ``logprobs`` (the number of alternatives)."""
    given = data.get("logprobs")
    if given is None or given is False:
        if chat and data.get("top_logprobs") is not None:
            raise HttpError(400, "`top_logprobs` needs `logprobs: true`", "invalid_value")
        return {}
    top = data.get("top_logprobs", 0) if chat else given
    if chat and given is not True:
        raise HttpError(400, "`logprobs` must be a boolean", "invalid_type")
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise HttpError(400, f"`{'top_logprobs' if chat else 'logprobs'}` must be an "
                        "integer from 0 to 20", "invalid_value")
    return {"logprobs": top}
