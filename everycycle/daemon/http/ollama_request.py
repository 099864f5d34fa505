"""Reading an Ollama request: model names with tags, ``options``, ``keep_alive``,
``format``, ``think`` and a chat's messages, as the fields of a protocol Generate.
Every mistake is an HttpError (400) naming the field.

Ollama's options that only tune a llama.cpp load (``num_thread``, ``num_gpu``, ``mirostat``,
…) are ignored, as Ollama ignores options a model does not take; ``num_ctx`` is the
context a slot must hold (Generate's ``context``): a model loaded with less is loaded
again, once, with at least that much; one loaded with more is not reloaded.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request as HttpRequest

from ...chatfmt.constraint import JSON_OBJECT_SCHEMA
from ...models.keepalive import parse_keep_alive
from ...protocol import Message, ThinkEffort, sampling
from ...protocol.validation import CONTEXT
from . import openai_request
from .common import HttpError, Reader, deadline, priority, sampling_options

TAG = ":latest"
"""The one tag every model has: ``NAME`` and ``NAME:latest`` are the same model."""
LISTING = "GET /api/tags"
_THINK_LEVELS = ("low", "medium", "high")


def model(reader: Reader, request: HttpRequest, given: object) -> str:
    """The registry name a request means (``NAME`` or ``NAME:latest``; the default when
    none). Raises HttpError (400, or 404 for an unknown model)."""
    if isinstance(given, str) and given.endswith(TAG) and (
            given not in reader.supervisor.registry.models):
        given = given.removesuffix(TAG)
    return reader.model(request, given, LISTING)


def tagged(name: str) -> str:
    return name if ":" in name else name + TAG


def keep_alive(data: dict[str, Any]) -> dict[str, int]:
    """``keep_alive`` ("5m", seconds, -1 for always, 0 to unload once done) as
    ``keep_alive_ms``. Raises HttpError."""
    raw = data.get("keep_alive")
    if raw is None:
        return {}
    try:
        seconds = parse_keep_alive(raw)
    except ValueError as exc:
        raise HttpError(400, f"keep_alive: {exc}", "invalid_keep_alive") from None
    return {"keep_alive_ms": -1 if seconds < 0 else int(seconds * 1000)}


def response_format(raw: object) -> dict[str, str]:
    """``format``: "json" (any JSON object) or a JSON schema, as ``json_schema``."""
    if raw is None or raw == "":
        return {}
    if raw == "json":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if isinstance(raw, dict):
        return {"json_schema": json.dumps(raw, ensure_ascii=False)}
    raise HttpError(400, '`format` must be "json" or a JSON schema object', "invalid_format")


def options(request: HttpRequest, data: dict[str, Any]) -> dict[str, Any]:
    """``options`` (num_predict, the sampling parameters Ollama takes, stop, num_ctx),
    ``keep_alive``, ``format`` and the deadline header, as Generate's fields."""
    raw = data.get("options")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise HttpError(400, "`options` must be an object", "invalid_options")
    out: dict[str, Any] = sampling_options(sampling.OLLAMA, raw, "options.")
    value = raw.get("num_predict")
    # (num_predict -1 is "no limit" and -2 "fill the context")
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                  and value < 0):
        out["max_tokens"] = value
    stop = raw.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise HttpError(400, "options.stop must be a list of strings", "invalid_options")
        out["stop"] = tuple(stops) or None
    openai_request.check_types(out)
    num_ctx = raw.get("num_ctx")
    if num_ctx is not None:
        if isinstance(num_ctx, bool) or not isinstance(num_ctx, int):
            raise HttpError(400, "options.num_ctx must be an integer", "invalid_options")
        out["context"] = max(num_ctx, CONTEXT[0])  # (a smaller one asks for nothing)
    limit = deadline(request)
    if limit is not None:
        out["deadline_ms"] = limit
    return {**out, **priority(request), **keep_alive(data), **response_format(data.get("format"))}


def think(data: dict[str, Any]) -> dict[str, Any]:
    """``think``: a boolean, or a level (low, medium, high: think, with that effort's
    budget)."""
    raw = data.get("think")
    if raw is None:
        return {}
    if isinstance(raw, bool):
        return {"think": raw}
    if raw in _THINK_LEVELS:
        return {"think": True, "think_effort": ThinkEffort(raw)}
    raise HttpError(400, "`think` must be a boolean or low, medium or high", "invalid_think")


def refuse(data: dict[str, Any], *fields: str) -> None:
    """Refuse fields we cannot honour, when given (their empty values are fine)."""
    for name in fields:
        if data.get(name) not in (None, "", [], False):
            why = {"template": "`template` is not supported: everycycle renders the "
                               "model's own chat template (`raw: true` sends the prompt as is)",
                   "context": "`context` (token arrays) is not supported: send the "
                              "conversation to /api/chat",
                   "logprobs": "`logprobs` is not supported"}[name]
            raise HttpError(400, why, f"unsupported_{name}")


def image_urls(where: str, images: object) -> list[dict[str, Any]]:
    """Ollama's ``images`` (base64, no type given) as OpenAI ``image_url`` parts (the
    engine finds the format from the bytes)."""
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise HttpError(400, f"`{where}` must be a list of base64 strings", "invalid_images")
    return [{"type": "image_url", "image_url": {"url": f"data:image/*;base64,{x}"}}
            for x in images]


def messages(raw: object) -> tuple[Message, ...]:
    """Ollama chat messages as protocol Messages: a tool call's ``arguments`` is an
    object, and a tool's answer names the tool (``tool_name``) rather than the call,
    so each answer is matched to the oldest call of that tool not yet answered."""
    if not isinstance(raw, list):
        return openai_request.messages(raw)  # (its error names the mistake)
    shaped: list[object] = []
    pending: list[tuple[str, str]] = []  # calls not yet answered: (id, tool name)
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            shaped.append(item)
            continue
        item = dict(item)
        if item.get("content") is None:
            item["content"] = ""
        images = item.pop("images", None)
        if images not in (None, []):
            item["content"] = [*image_urls(f"messages[{i}].images", images),
                               {"type": "text", "text": item["content"]}]
        calls = item.get("tool_calls")
        if item.get("role") == "assistant" and isinstance(calls, list):
            item["tool_calls"] = calls = [
                {**c, "id": c.get("id") or f"call_{i}_{j}"} if isinstance(c, dict) else c
                for j, c in enumerate(calls)]
            pending = [(c["id"], str((c.get("function") or {}).get("name")))
                       for c in calls if isinstance(c, dict) and isinstance(c["id"], str)
                       and isinstance(c.get("function") or {}, dict)]
        elif item.get("role") == "tool" and not isinstance(item.get("tool_call_id"), str):
            name = item.get("tool_name")
            match = next((p for p in pending if p[1] == name), pending[0] if pending else None)
            if match is not None:
                pending.remove(match)
            item["tool_call_id"] = match[0] if match else f"call_{i}"
        shaped.append(item)
    return openai_request.messages(shaped)
