"""The Anthropic dialect: the Messages API over the shared exchange with the supervisor.

    POST /v1/messages                system + messages → Generate{messages}  (SSE when "stream")
    POST /v1/messages/count_tokens   the rendered prompt's size → {"input_tokens": N}

``x-api-key`` (or a bearer token) authenticates; ``anthropic-version`` and ``metadata``
are accepted and ignored. The request id is the message's ``id`` and comes back in
``x-request-id`` (``everycycle cancel ID`` stops it). A stream opens with
``message_start`` and then one ``event: ping`` for every queue move, carrying the
request's ``queue_position`` (0 once it runs), as Anthropic's clients skip pings; its
``message_start`` usage is 0 (the prompt is counted as it is read) and the totals come in
``message_delta``. Errors are Anthropic's ``{"type": "error", "error": {type, message}}``:
Invalid 400, unknown model 404, a key's quota 429 (rate_limit_error, with Retry-After),
any other refusal — the model's queue full, a daemon shutting down — 529
(overloaded_error, with Retry-After), Cancelled 499, ModelNotLoaded 503, Internal 500; a
stream that already began ends with ``event: error``.

``count_tokens`` has no protocol request of its own: it runs the request as a Generate of
one token and reports the prompt tokens the supervisor counted (one decode step, queued
like any request, charged to the key's quotas like any request).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from ...errors import ErrorKind
from ...protocol import Accepted, Error, Generate, ServerEvent, Tokens, ToolCalls
from ..keys import Principal
from ..outcome import Outcome
from . import anthropic_request as parse
from .common import protocol_errors, queue_eta, request_id, stream_flag
from .exchange import STATUS, Dialect, Events, Exchange, Send, Spawner, Whole, dumps, sse_event

OVERLOADED = 529

_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}

_STOP_REASON = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens",
                "context": "max_tokens", "tool_calls": "tool_use"}


def _too_long(outcome: Outcome | None) -> str | None:
    """Anthropic's words for a prompt longer than the context (Claude Code compacts the
    conversation when it reads them)."""
    if outcome is None or outcome.context_limit is None:
        return None
    return (f"prompt is too long: {outcome.prompt_tokens} tokens > "
            f"{outcome.context_limit} maximum")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object (``api_error`` for what Anthropic has no type for)."""
    return {"type": "error", "error": {"type": _TYPE.get(status, "api_error"),
                                       "message": message}}


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def status_of(event: Error, outcome: Outcome | None) -> int:
    """The HTTP status of a terminal Error: 529 for a refusal that is no key's quota."""
    if event.kind is ErrorKind.REJECTED and (outcome is None or outcome.limit is None):
        return OVERLOADED
    return STATUS[event.kind]


def _usage(outcome: Outcome | None) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are those prefilled, the cached ones apart."""
    prompt = outcome.prompt_tokens if outcome else 0
    cached = outcome.cached_tokens if outcome else 0
    return {"input_tokens": prompt - cached, "output_tokens":
            outcome.generated_tokens if outcome else 0, "cache_read_input_tokens": cached}


class _Exchange(Exchange):
    """What both routes answer alike: errors in Anthropic's shape."""

    def error_answer(self, event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
        status = status_of(event, outcome)
        return status, dumps(error_body(status, _too_long(outcome) or event.message))


class _Message(_Exchange):
    """A message: SSE events when streaming, else one message object."""

    def __init__(self, api: Spawner, req: Generate, principal: Principal, *,
                 stream: bool) -> None:
        super().__init__(api, req, principal)
        self.gen = req
        self.stream = stream
        self.blocks = -1  # the index of the content block open now, or the last one
        self.open: str | None = None  # its type, while it is open

    def _stop(self, outcome: Outcome | None) -> dict[str, Any]:
        """Why it stopped; the stop sequence where there was only one it could be
        (the engine says a stop string matched, not which)."""
        reason = outcome.finish_reason if outcome else None
        stops = self.gen.stop or ()
        return {"stop_reason": _STOP_REASON.get(reason or "", "end_turn"),
                "stop_sequence": stops[0] if reason == "stop" and len(stops) == 1 else None}

    def _message(self, content: list[dict[str, Any]], outcome: Outcome | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        stop: dict[str, Any] = ({"stop_reason": None, "stop_sequence": None}
                                if outcome is None else self._stop(outcome))
        return {"id": self.req.request_id, "type": "message", "role": "assistant",
                "model": self.gen.model, "content": content, **stop, "usage": usage}

    async def answer(self, send: Send, whole: Whole) -> None:
        content = whole.parts(
            lambda thought: {"type": "thinking", "thinking": thought, "signature": ""},
            lambda text: {"type": "text", "text": text},
            lambda call: {"type": "tool_use", "id": call.id, "name": call.name,
                          "input": json.loads(call.arguments)})
        await self.send_json(send, 200, dumps(self._message(content, whole.outcome,
                                                            _usage(whole.outcome))))

    # ------------------------------------------------------------------ streaming

    async def _block(self, send: Send, kind: str, start: dict[str, Any]) -> None:
        """Close the open block and open one of ``kind``."""
        await self._close(send)
        self.blocks += 1
        self.open = kind
        await self.write(send, sse_event("content_block_start", {
            "index": self.blocks, "content_block": {"type": kind, **start}}))

    async def _delta(self, send: Send, kind: str, delta: dict[str, Any]) -> None:
        await self.write(send, sse_event("content_block_delta", {
            "index": self.blocks, "delta": {"type": kind, **delta}}))

    async def _text(self, send: Send, kind: str, text: str) -> None:
        """Text of a ``text`` or ``thinking`` block, in the open one if it is that kind."""
        if self.open != kind:
            await self._block(send, kind, {kind: "", **({"signature": ""} if kind == "thinking"
                                                        else {})})
        await self._delta(send, f"{kind}_delta", {kind: text})

    async def _close(self, send: Send) -> None:
        if self.open is not None:
            await self.write(send, sse_event("content_block_stop", {"index": self.blocks}))
            self.open = None

    async def begin(self, send: Send, event: ServerEvent) -> None:
        await self.write(send, sse_event("message_start", {"message": self._message(
            [], None, {"input_tokens": 0, "output_tokens": 0})}))

    async def heartbeat(self, send: Send) -> None:
        await self.write(send, sse_event("ping", {}))

    async def answer_stream(self, events: Events, send: Send) -> None:
        async for event, outcome in self.streamed(events, send):
            if isinstance(event, Accepted):
                await self.write(send, sse_event("ping", {
                    "queue_position": event.queue_position, **queue_eta(event)}))
            elif isinstance(event, ToolCalls):
                for call in event.calls:
                    await self._block(send, "tool_use", {"id": call.id, "name": call.name,
                                                         "input": {}})
                    await self._delta(send, "input_json_delta", {"partial_json": call.arguments})
            elif isinstance(event, Tokens):
                if event.chunk.reasoning:
                    await self._text(send, "thinking", event.chunk.reasoning)
                if event.chunk.text:
                    await self._text(send, "text", event.chunk.text)
                if event.finished:
                    await self._close(send)
                    await self.write(send, sse_event("message_delta", {
                        "delta": self._stop(outcome), "usage": _usage(outcome)}))
                    await self.write(send, sse_event("message_stop", {}))
                    break
            elif isinstance(event, Error):
                body = error_body(status_of(event, outcome),
                                  _too_long(outcome) or event.message)
                await self.write(send, sse_event("error", {"error": body["error"]}))
                break
        if self.started:
            await self.end_stream(send)


class _Count(_Exchange):
    """count_tokens: the prompt tokens of a one-token generation."""

    async def answer(self, send: Send, whole: Whole) -> None:
        tokens = whole.outcome.prompt_tokens if whole.outcome else 0
        await self.send_json(send, 200, dumps({"input_tokens": tokens}))


class Anthropic(Dialect):
    """The Anthropic routes over ``api`` (where requests run) and ``reader``."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    def _generate(self, request: HttpRequest, data: dict[str, Any], prefix: str,
                  **fields: Any) -> Generate:
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        messages = parse.messages(data)
        req: Generate = protocol_errors(Generate, request_id(request, prefix), model,
                                        messages=messages, **parse.thinking(data), **fields)
        return req

    async def messages(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        req = self._generate(request, data, "msg", **parse.tools(data),
                             **parse.options(request, data))
        return _Message(self.api, req, request.state.principal, stream=stream_flag(data))

    async def count_tokens(self, request: HttpRequest) -> Any:
        """The prompt's tokens, tools included; the tool choice renders nothing."""
        data = await self.reader.json(request)
        tools = {k: v for k, v in parse.tools(data).items() if k == "tools"}
        req = self._generate(request, data, "count", max_tokens=1, temperature=0.0, **tools,
                             **parse.options(request, data, counting=True))
        return _Count(self.api, req, request.state.principal)
