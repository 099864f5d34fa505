"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/embeddings and
/v1/models, over the shared exchange with the supervisor.

    POST /v1/chat/completions   messages → Generate{messages}   (SSE when "stream")
    POST /v1/completions        prompt   → Generate{prompt, format raw}
    POST /v1/embeddings         input    → Embed (float or base64 vectors)
    GET  /v1/models[/{id}]      the registry, with where each model is loaded

What the socket protocol offers stays reachable: the request id comes back in the
``x-request-id`` header (a client may also choose it by sending that header), so
``everycycle cancel ID`` stops it; a queued stream gets ``: queue_position N`` SSE comment
lines, which OpenAI clients ignore; ``x-deadline-ms`` sets the deadline. Errors are
OpenAI error objects: Invalid 400, unknown model 404, Rejected 429 (with Retry-After),
Cancelled 499, ModelNotLoaded 503, Internal 500; a stream that already began ends
with an error event and no ``[DONE]``.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ...engine.grammar import JSON_OBJECT_SCHEMA
from ...errors import ProtocolError
from ...protocol import (
    Accepted,
    Embed,
    Embeddings,
    Error,
    Format,
    Generate,
    Message,
    Role,
    Tokens,
)
from ..outcome import Outcome
from .common import HttpError, Reader, deadline, protocol_errors, request_id
from .exchange import STATUS, Events, Exchange, Send, Spawner, dumps

_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "model_not_loaded",
}
_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER,
          "assistant": Role.ASSISTANT}


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": _TYPE.get(status, "error"), "param": None,
                      "code": code}}


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


def _finish_reason(outcome: Outcome | None) -> str:
    if outcome is not None and outcome.finish_reason in ("length", "context"):
        return "length"
    return "stop"


def _usage(outcome: Outcome | None) -> dict[str, Any]:
    prompt = outcome.prompt_tokens if outcome else 0
    generated = outcome.generated_tokens if outcome else 0
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens if outcome else 0}}


@dataclass
class _Shape:
    """How one endpoint's objects look (chat.completion vs text_completion)."""

    chat: bool
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    encoding: str = "float"

    def chunk(self, text: str | None, finish: str | None, *, role: bool = False,
              usage: dict[str, Any] | None | bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": obj, "created": self.created,
                                "model": self.model, "choices": [choice]}
        if usage is not False:
            body["usage"] = usage
        return body

    def embeddings(self, event: Embeddings, outcome: Outcome | None) -> dict[str, Any]:
        """OpenAI's embeddings list; ``base64`` packs little-endian float32s."""
        data = []
        for i, vector in enumerate(event.vectors):
            value: Any = list(vector)
            if self.encoding == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = outcome.prompt_tokens if outcome else 0
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def whole(self, text: str, outcome: Outcome | None) -> dict[str, Any]:
        finish = _finish_reason(outcome)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": [choice], "usage": _usage(outcome)}


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else dumps(obj).decode()
    return f"data: {data}\n\n".encode()


class _Generation(Exchange):
    """An OpenAI answer: SSE chunks when streaming, else one object."""

    def __init__(self, api: Spawner, req: Generate | Embed, principal: Any, shape: _Shape, *,
                 stream: bool, include_usage: bool) -> None:
        super().__init__(api, req, principal)
        self.shape = shape
        self.stream = stream
        self.include_usage = include_usage

    def _error_body(self, event: Error) -> bytes:
        return dumps(error_body(STATUS[event.kind], event.message, event.kind.value))

    async def respond(self, events: Events, send: Send) -> None:
        if self.stream:
            await self._stream(events, send)
        else:
            await self._collect(events, send)

    async def _collect(self, events: Events, send: Send) -> None:
        text: list[str] = []
        async for event, outcome in events:
            if isinstance(event, Error):
                await self.send_error(send, event, outcome, self._error_body(event))
                return
            if isinstance(event, Embeddings):
                answer = self.shape.embeddings(event, outcome)
            elif isinstance(event, Tokens):
                text.append(event.chunk.text)
                if not event.finished:
                    continue
                answer = self.shape.whole("".join(text), outcome)
            else:
                continue
            await self.send_json(send, 200, json.dumps(answer, ensure_ascii=False).encode())
            return

    async def _stream(self, events: Events, send: Send) -> None:
        started = False
        role_sent = False
        usage: dict[str, Any] | None | bool = None if self.include_usage else False
        async for event, outcome in events:
            if isinstance(event, Error) and not started:
                await self.send_error(send, event, outcome, self._error_body(event))
                return
            if not started:
                await self.start_stream(send, "text/event-stream")
                started = True
            if isinstance(event, Accepted):
                if event.queue_position:
                    await self.write(send, f": queue_position {event.queue_position}\n\n"
                                     .encode())
                elif not role_sent and self.shape.chat:
                    await self.write(send, _sse(self.shape.chunk("", None, role=True,
                                                                 usage=usage)))
                    role_sent = True
            elif isinstance(event, Tokens):
                if event.chunk.text:
                    await self.write(send, _sse(self.shape.chunk(event.chunk.text, None,
                                                                 usage=usage)))
                if event.finished:
                    finish = _finish_reason(outcome)
                    await self.write(send, _sse(self.shape.chunk(
                        None if self.shape.chat else "", finish, usage=usage)))
                    if self.include_usage:
                        last = self.shape.chunk(None, None, usage=_usage(outcome))
                        last["choices"] = []
                        await self.write(send, _sse(last))
                    await self.write(send, _sse("[DONE]"))
                    break
            elif isinstance(event, Error):
                await self.write(send, b"data: " + self._error_body(event) + b"\n\n")
                break
        await self.end_stream(send)


class OpenAI:
    """The OpenAI routes over ``api`` (where requests run) and ``reader``."""

    def __init__(self, api: Spawner, reader: Reader) -> None:
        self.api = api
        self.reader = reader

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
        ]

    def _generation(self, request: HttpRequest, data: dict[str, Any], req: Generate,
                    shape: _Shape) -> _Generation:
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError(400, "`stream` must be a boolean", "invalid_type")
        opts = data.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        return _Generation(self.api, req, request.state.principal, shape, stream=stream,
                           include_usage=include_usage)

    async def chat_completions(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        return self._completion(request, data, "chatcmpl",
                                messages=_messages(data.get("messages")))

    async def completions(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise HttpError(400, "`prompt` must be a string (one prompt per request)",
                            "invalid_prompt")
        return self._completion(request, data, "cmpl", prompt=prompt, format=Format.RAW)

    def _completion(self, request: HttpRequest, data: dict[str, Any], prefix: str,
                    **fields: Any) -> _Generation:
        """A chat completion (``messages``) or a text completion (``prompt``)."""
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        options = _options(request, data)
        options.update(_response_format(data.get("response_format")))
        rid = request_id(request, prefix)
        req = protocol_errors(Generate, rid, model, **fields, **options)
        shape = _Shape(chat="messages" in fields, request_id=rid, model=model)
        return self._generation(request, data, req, shape)

    async def embeddings(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        raw = data.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise HttpError(400, "`input` must be a string or a list of strings "
                            "(token arrays are not supported)", "invalid_input")
        encoding = data.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise HttpError(400, "`encoding_format` must be float or base64",
                            "invalid_encoding_format")
        rid = request_id(request, "embd")
        shape = _Shape(chat=False, request_id=rid, model=model, encoding=encoding)
        req = protocol_errors(Embed, rid, model, tuple(texts), deadline_ms=deadline(request))
        return _Generation(self.api, req, request.state.principal, shape, stream=False,
                           include_usage=False)

    def _model_objects(self, names: list[str]) -> list[dict[str, Any]]:
        sup = self.api.supervisor
        loaded = {m.name: m for m in sup.snapshot().loaded_models}  # (one snapshot)
        out = []
        for name in names:
            spec = sup.registry.models[name]
            here = loaded.get(name)
            out.append({"id": name, "object": "model", "created": 0, "owned_by": "everycycle",
                        "revision": spec.revision, "loaded": here is not None,
                        "executor": here.assigned_executor if here else None,
                        "default": name == sup.registry.default})
        return out

    async def list_models(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        return JSONResponse({"object": "list",
                             "data": self._model_objects(self.reader.visible(principal))})

    async def get_model(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        name = request.path_params["model_id"]
        if name not in self.reader.visible(principal):
            raise HttpError(404, f"model '{name}' not found", "model_not_found")
        return JSONResponse(self._model_objects([name])[0])


def _options(request: HttpRequest, data: dict[str, Any]) -> dict[str, Any]:
    """The sampling and stopping options of a chat or text completion."""
    n = data.get("n", 1)
    if n != 1:
        raise HttpError(400, "only n=1 is supported: send one request per completion",
                        "unsupported_n")
    options: dict[str, Any] = {}
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed"):
        if data.get(key) is not None:
            options[key] = data[key]
    stop = data.get("stop")
    if isinstance(stop, str):
        options["stop"] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        options["stop"] = tuple(stop) or None
    elif stop is not None:
        raise HttpError(400, "`stop` must be a string or a list of strings", "invalid_type")
    limit = deadline(request)
    if limit is not None:
        options["deadline_ms"] = limit
    check_types(options)
    return options


def check_types(options: dict[str, Any]) -> None:
    """Integers and numbers where Generate wants them (a bool is neither). Raises HttpError."""
    for key, kind in (("max_tokens", int), ("top_k", int), ("seed", int)):
        value = options.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise HttpError(400, f"`{key}` must be an integer", "invalid_type")
    for key in ("temperature", "top_p", "min_p", "repeat_penalty"):
        value = options.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise HttpError(400, f"`{key}` must be a number", "invalid_type")


def _response_format(raw: object) -> dict[str, str]:
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


def _messages(raw: object) -> tuple[Message, ...]:
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
            raise HttpError(400, f"messages[{i}].role must be system, developer, user or "
                             f"assistant (got {json.dumps(given)[:40]})", "invalid_messages")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise HttpError(400, f"messages[{i}].content: only text parts are "
                                     "supported", "unsupported_content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise HttpError(400, f"messages[{i}].content must be a string or text parts",
                             "invalid_messages")
        try:
            out.append(Message(role, content))
        except ProtocolError as exc:
            raise HttpError(400, f"messages[{i}]: {exc.message}", "invalid_messages") from None
    return tuple(out)
