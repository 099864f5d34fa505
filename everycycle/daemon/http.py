"""The OpenAI-compatible HTTP API, health and Prometheus metrics (Starlette under uvicorn).

It runs inside the daemon's own task group and event loop and maps every HTTP request
onto one protocol request with an id, handled by the same Supervisor as the socket:

    POST /v1/chat/completions   messages → Generate{messages}   (SSE when "stream")
    POST /v1/completions        prompt   → Generate{prompt, format raw}
    POST /v1/embeddings         input    → Embed (float or base64 vectors)
    GET  /v1/models[/{id}]      the registry, with where each model is loaded
    GET  /health                200 while serving
    GET  /metrics               Prometheus text format

What the socket protocol offers stays reachable: the request id comes back in the
``x-request-id`` header (a client may also choose it by sending that header), so
``everycycle cancel ID`` stops it; a queued stream gets ``: queue_position N`` SSE comment
lines, which OpenAI clients ignore; ``x-deadline-ms`` sets the deadline. A client that
disconnects has its request cancelled within one decode step. Errors are OpenAI error
objects: Invalid 400, unknown model 404, Rejected 429 (with Retry-After), Cancelled 499,
ModelNotLoaded 503, Internal 500; a stream that already began ends with an error event
and no ``[DONE]``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.grammar import JSON_OBJECT_SCHEMA
from ..errors import EverycycleError, ProtocolError
from ..mailbox import Mailbox
from ..protocol import (
    Accepted,
    Embed,
    Embeddings,
    Error,
    ErrorKind,
    Format,
    Generate,
    Message,
    Role,
    ServerEvent,
    Tokens,
    validate_request_id,
)
from .keys import LOCAL, KeyStore, Principal
from .metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)
from .supervisor import Outcome, Supervisor

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MAX_BODY_BYTES = 4 << 20

_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.MODEL_NOT_LOADED: 503,
    ErrorKind.REJECTED: 429,
    ErrorKind.CANCELLED: 499,
    ErrorKind.INTERNAL: 500,
}
_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "model_not_loaded",
}
_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER,
          "assistant": Role.ASSISTANT}


class _HttpError(Exception):
    """An HTTP error answer: status, message, OpenAI error code."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": _TYPE.get(status, "error"), "param": None,
                      "code": code}}


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


class _HttpPeer:
    """The supervisor's view of one HTTP request: its events, queued for the handler."""

    allow_paths = False

    def __init__(self, principal: Principal) -> None:
        self.principal = principal
        self.box: Mailbox[ServerEvent] = Mailbox()
        self.outcome: Outcome | None = None

    def emit(self, event: ServerEvent) -> None:
        self.box.put(event)

    def finished(self, outcome: Outcome) -> None:
        self.outcome = outcome

    async def events(self) -> AsyncIterator[ServerEvent]:
        """The request's events as they come, until the box is closed."""
        while True:
            try:
                batch = await self.box.take()
            except anyio.EndOfStream:
                return
            for event in batch:
                yield event


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
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Generation:
    """The ASGI response for one generation: waits for admission, then streams (SSE) or
    collects; a disconnect cancels the request on the supervisor."""

    def __init__(self, api: HttpApi, req: Generate | Embed, shape: _Shape, *, stream: bool,
                 include_usage: bool, principal: Principal) -> None:
        self.api = api
        self.principal = principal
        self.req = req
        self.shape = shape
        self.stream = stream
        self.include_usage = include_usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = _HttpPeer(self.principal)
        sup = self.api.supervisor
        self.api.spawn(sup.handle, peer, self.req)
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            sup.disconnect(peer)  # cancelled within one decode step
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                try:
                    if self.stream:
                        await self._stream(peer, send)
                    else:
                        await self._collect(peer, send)
                except OSError:  # the client went away while we wrote
                    sup.disconnect(peer)
                tg.cancel_scope.cancel()
        finally:
            sup.disconnect(peer)
            peer.box.close()

    def _headers(self, content_type: str, length: int | None = None
                 ) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type.encode()),
                   (b"x-request-id", self.req.request_id.encode())]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        return headers

    async def _error(self, send: Send, event: Error, outcome: Outcome | None) -> None:
        status = _STATUS[event.kind]
        body = json.dumps(error_body(status, event.message, event.kind.value)).encode()
        headers = self._headers("application/json", len(body))
        if status == 429:
            wait = outcome.retry_after_s if outcome and outcome.retry_after_s else 1.0
            headers.append((b"retry-after", str(max(1, math.ceil(wait))).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _collect(self, peer: _HttpPeer, send: Send) -> None:
        text: list[str] = []
        async for event in peer.events():
            if isinstance(event, Error):
                await self._error(send, event, peer.outcome)
                return
            if isinstance(event, Embeddings):
                answer = self.shape.embeddings(event, peer.outcome)
            elif isinstance(event, Tokens):
                text.append(event.chunk.text)
                if not event.finished:
                    continue
                answer = self.shape.whole("".join(text), peer.outcome)
            else:
                continue
            body = json.dumps(answer, ensure_ascii=False).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": self._headers("application/json", len(body))})
            await send({"type": "http.response.body", "body": body})
            return

    async def _stream(self, peer: _HttpPeer, send: Send) -> None:
        started = False
        role_sent = False
        usage: dict[str, Any] | None | bool = None if self.include_usage else False

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async for event in peer.events():
            if isinstance(event, Error) and not started:
                await self._error(send, event, peer.outcome)
                return
            if not started:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [*self._headers("text/event-stream"),
                                        (b"cache-control", b"no-cache")]})
                started = True
            if isinstance(event, Accepted):
                if event.queue_position:
                    await write(f": queue_position {event.queue_position}\n\n".encode())
                elif not role_sent and self.shape.chat:
                    await write(_sse(self.shape.chunk("", None, role=True, usage=usage)))
                    role_sent = True
            elif isinstance(event, Tokens):
                if event.chunk.text:
                    await write(_sse(self.shape.chunk(event.chunk.text, None, usage=usage)))
                if event.finished:
                    finish = _finish_reason(peer.outcome)
                    await write(_sse(self.shape.chunk(None if self.shape.chat else "",
                                                      finish, usage=usage)))
                    if self.include_usage:
                        last = self.shape.chunk(None, None, usage=_usage(peer.outcome))
                        last["choices"] = []
                        await write(_sse(last))
                    await write(_sse("[DONE]"))
                    break
            elif isinstance(event, Error):
                status = _STATUS[event.kind]
                await write(_sse(error_body(status, event.message, event.kind.value)))
                break
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class HttpApi:
    """The Starlette app over a Supervisor; ``spawn`` starts request tasks in the daemon's
    task group (a request outlives the HTTP exchange that asked for it only until the
    supervisor ends it)."""

    def __init__(self, supervisor: Supervisor, metrics: Metrics, *, keys: KeyStore,
                 require_key: bool) -> None:
        self.supervisor = supervisor
        self.metrics = metrics
        self.keys = keys
        self.require_key = require_key
        self._tg: anyio.abc.TaskGroup | None = None
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ])
        self.app.add_exception_handler(_HttpError, self._http_error)  # type: ignore[arg-type]
        self.app.add_exception_handler(404, self._not_found)
        self.app.add_exception_handler(405, self._not_allowed)
        self.app.add_exception_handler(Exception, self._internal)

    def bind(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        assert self._tg is not None, "HttpApi.bind was not called"
        self._tg.start_soon(fn, *args)

    # ------------------------------------------------------------------ plumbing

    async def _http_error(self, request: HttpRequest, exc: _HttpError) -> Response:
        headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.message, exc.code, headers)

    async def _internal(self, request: HttpRequest, exc: Exception) -> Response:
        """A bug costs one request an OpenAI-shaped 500, never a plain-text page."""
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    async def _not_found(self, request: HttpRequest, exc: Exception) -> Response:
        return error_response(404, f"no route {request.method} {request.url.path}",
                              "not_found")

    async def _not_allowed(self, request: HttpRequest, exc: Exception) -> Response:
        return error_response(405, f"{request.method} is not allowed on {request.url.path}",
                              "method_not_allowed")

    def _auth(self, request: HttpRequest) -> Principal:
        """Who is asking: the key's principal. Without --http-auth on loopback, a request
        with no key (or one we do not know: OpenAI clients always send some) is "local"."""
        given = request.headers.get("authorization", "")
        scheme, _, secret = given.partition(" ")
        principal = (self.keys.authenticate(secret.strip())
                     if scheme.lower() == "bearer" and secret.strip() else None)
        if principal is None:
            if self.require_key:
                raise _HttpError(401, "a valid bearer token is required "
                                 "(`everycycle daemon --show-token` or `everycycle keys add`)",
                                 "invalid_api_key")
            principal = self.keys.principal(LOCAL.name)
        request.state.principal = principal
        return principal

    async def _json(self, request: HttpRequest) -> dict[str, Any]:
        self._auth(request)
        length = request.headers.get("content-length") or "0"
        size = int(length) if length.isascii() and length.isdigit() else MAX_BODY_BYTES + 1
        if size > MAX_BODY_BYTES:
            raise _HttpError(413, f"request body over {MAX_BODY_BYTES} bytes", "too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise _HttpError(413, f"request body over {MAX_BODY_BYTES} bytes", "too_large")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise _HttpError(400, f"the body is not JSON: {exc}", "invalid_json") from None
        if not isinstance(data, dict):
            raise _HttpError(400, "the body must be a JSON object", "invalid_json")
        return data

    def _model(self, request: HttpRequest, data: dict[str, Any]) -> str:
        name = data.get("model")
        registry = self.supervisor.registry
        restricted = request.state.principal.limits.models is not None
        if name is None or name == "":
            try:
                return registry.default_name()
            except EverycycleError as exc:
                raise _HttpError(400, exc.message, "model_required") from None
        if not isinstance(name, str):
            raise _HttpError(400, "`model` must be a string", "invalid_type")
        if name not in registry.models and not restricted:
            # (A key limited to some models hears the same for every other model,
            # existing or not: the supervisor's Invalid.)
            raise _HttpError(404, f"model '{name}' not found (GET /v1/models lists them)",
                             "model_not_found")
        return name

    def _request_id(self, request: HttpRequest, prefix: str) -> str:
        given = request.headers.get("x-request-id")
        if given is None:
            import uuid

            return f"{prefix}-{uuid.uuid4().hex}"
        try:
            return validate_request_id(given)
        except ProtocolError as exc:
            raise _HttpError(400, f"x-request-id: {exc.message}", "invalid_request_id") from None

    def _options(self, request: HttpRequest, data: dict[str, Any]) -> dict[str, Any]:
        n = data.get("n", 1)
        if n != 1:
            raise _HttpError(400, "only n=1 is supported: send one request per completion",
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
            raise _HttpError(400, "`stop` must be a string or a list of strings", "invalid_type")
        deadline = _deadline(request)
        if deadline is not None:
            options["deadline_ms"] = deadline
        for key, kind in (("max_tokens", int), ("top_k", int), ("seed", int)):
            value = options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise _HttpError(400, f"`{key}` must be an integer", "invalid_type")
        for key in ("temperature", "top_p", "min_p", "repeat_penalty"):
            value = options.get(key)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, int | float)):
                raise _HttpError(400, f"`{key}` must be a number", "invalid_type")
        return options

    def _generation(self, request: HttpRequest, req_fn: Callable[[], Generate], shape: _Shape,
                    data: dict[str, Any]) -> _Generation:
        try:
            req = req_fn()
        except ProtocolError as exc:
            raise _HttpError(400, exc.message, "invalid_value") from None
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise _HttpError(400, "`stream` must be a boolean", "invalid_type")
        opts = data.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        return _Generation(self, req, shape, stream=stream, include_usage=include_usage,
                           principal=request.state.principal)

    # ------------------------------------------------------------------ endpoints

    async def chat_completions(self, request: HttpRequest) -> Any:
        data = await self._json(request)
        model = self._model(request, data)
        messages = _messages(data.get("messages"))
        options = self._options(request, data)
        options.update(_response_format(data.get("response_format")))
        rid = self._request_id(request, "chatcmpl")
        shape = _Shape(chat=True, request_id=rid, model=model)
        return self._generation(
            request, lambda: Generate(rid, model, messages=messages, **options), shape, data)

    async def completions(self, request: HttpRequest) -> Any:
        data = await self._json(request)
        model = self._model(request, data)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _HttpError(400, "`prompt` must be a string (one prompt per request)",
                             "invalid_prompt")
        options = self._options(request, data)
        options.update(_response_format(data.get("response_format")))
        rid = self._request_id(request, "cmpl")
        shape = _Shape(chat=False, request_id=rid, model=model)
        return self._generation(
            request, lambda: Generate(rid, model, prompt, format=Format.RAW, **options), shape, data)

    async def embeddings(self, request: HttpRequest) -> Any:
        data = await self._json(request)
        model = self._model(request, data)
        raw = data.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise _HttpError(400, "`input` must be a string or a list of strings "
                             "(token arrays are not supported)", "invalid_input")
        encoding = data.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise _HttpError(400, "`encoding_format` must be float or base64",
                             "invalid_encoding_format")
        rid = self._request_id(request, "embd")
        shape = _Shape(chat=False, request_id=rid, model=model, encoding=encoding)
        try:
            req = Embed(rid, model, tuple(texts), deadline_ms=_deadline(request))
        except ProtocolError as exc:
            raise _HttpError(400, exc.message, "invalid_value") from None
        return _Generation(self, req, shape, stream=False, include_usage=False,
                           principal=request.state.principal)

    def _model_object(self, name: str) -> dict[str, Any]:
        spec = self.supervisor.registry.models[name]
        loaded = {m.name: m for m in self.supervisor.snapshot().loaded_models}
        here = loaded.get(name)
        return {"id": name, "object": "model", "created": 0, "owned_by": "everycycle",
                "revision": spec.revision, "loaded": here is not None,
                "executor": here.assigned_executor if here else None,
                "default": name == self.supervisor.registry.default}

    def _visible(self, principal: Principal) -> list[str]:
        """The registry's models that ``principal`` may use."""
        registry = self.supervisor.registry
        allowed = principal.limits.models
        if allowed is None:
            return list(registry.models)
        names = set()
        for name in allowed:
            with contextlib.suppress(EverycycleError):
                names.add(registry.get(name).name)
        return [name for name in registry.models if name in names]

    async def list_models(self, request: HttpRequest) -> Response:
        principal = self._auth(request)
        return JSONResponse({"object": "list", "data": [
            self._model_object(name) for name in self._visible(principal)]})

    async def get_model(self, request: HttpRequest) -> Response:
        principal = self._auth(request)
        name = request.path_params["model_id"]
        if name not in self._visible(principal):
            raise _HttpError(404, f"model '{name}' not found", "model_not_found")
        return JSONResponse(self._model_object(name))

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: HttpRequest) -> Response:
        self._auth(request)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def _deadline(request: HttpRequest) -> int | None:
    """The ``x-deadline-ms`` header. Raises _HttpError (400) for a malformed one."""
    value = request.headers.get("x-deadline-ms")
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 12):
        raise _HttpError(400, "x-deadline-ms must be a number of milliseconds (0-999999999999)",
                         "invalid_deadline")
    return int(value)


def _response_format(raw: object) -> dict[str, str]:
    """OpenAI's ``response_format`` to Generate's ``json_schema``. Raises _HttpError."""
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
            raise _HttpError(400, "response_format.json_schema.schema must be an object",
                             "invalid_response_format")
        return {"json_schema": json.dumps(schema)}
    raise _HttpError(400, "response_format.type must be text, json_object or json_schema",
                     "invalid_response_format")


def _messages(raw: object) -> tuple[Message, ...]:
    """OpenAI chat messages to protocol Messages. Raises _HttpError (400)."""
    if not isinstance(raw, list) or not raw:
        raise _HttpError(400, "`messages` must be a non-empty list", "invalid_messages")
    out: list[Message] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _HttpError(400, f"messages[{i}] must be an object", "invalid_messages")
        given = item.get("role")
        role = _ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise _HttpError(400, f"messages[{i}].role must be system, developer, user or "
                             f"assistant (got {json.dumps(given)[:40]})", "invalid_messages")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise _HttpError(400, f"messages[{i}].content: only text parts are "
                                     "supported", "unsupported_content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _HttpError(400, f"messages[{i}].content must be a string or text parts",
                             "invalid_messages")
        try:
            out.append(Message(role, content))
        except ProtocolError as exc:
            raise _HttpError(400, f"messages[{i}]: {exc.message}", "invalid_messages") from None
    return tuple(out)
