"""The Anthropic dialect: the Messages API over the shared exchange with the supervisor.

    POST /v1/messages                system + messages → Generate{messages}  (SSE when "stream")
    POST /v1/messages/count_tokens   the rendered prompt's size → {"input_tokens": N}

``x-api-key`` (or a bearer token) authenticates; ``anthropic-version`` and ``metadata``
are accepted and ignored. The request id is the message's ``id`` and comes back in
``x-request-id`` (``everycycle cancel ID`` stops it). A stream opens with
``message_start`` and then one ``event: ping`` for every queue move, carrying the
request's ``queue_position`` (0 once it runs), as Anthropic's clients skip pings; its
``message_start`` usage has the prompt's tokens (the stream begins once they are known:
its place in the queue says, or the first report of its prompt's reading) and the totals come in ``message_delta``. Errors are Anthropic's ``{"type": "error", "error": {type, message}}``:
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
from ...protocol import Error, Generate
from ..keys import Principal
from ..outcome import Outcome
from . import anthropic_request as parse
from .answer import (
    Answer,
    Calls,
    Failed,
    Finished,
    FinishReason,
    Part,
    Prefill,
    Queued,
    Running,
    Text,
    Thinking,
    Usage,
)
from .common import protocol_errors, request_id, stream_flag
from .exchange import STATUS, Dialect, Exchange, Spawner, dumps, sse_event

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

_STOP_REASON = {FinishReason.EOS: "end_turn", FinishReason.STOP: "stop_sequence",
                FinishReason.LENGTH: "max_tokens", FinishReason.CONTEXT: "max_tokens",
                FinishReason.TOOL_CALLS: "tool_use"}


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


def _usage(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are those prefilled, the cached ones apart."""
    return {"input_tokens": usage.prefilled, "output_tokens": usage.generated,
            "cache_read_input_tokens": usage.cached}


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

    def _stop(self, reason: FinishReason) -> dict[str, Any]:
        """Why it stopped; the stop sequence where there was only one it could be
        (the engine says a stop string matched, not which)."""
        stops = self.gen.stop or ()
        return {"stop_reason": _STOP_REASON[reason],
                "stop_sequence": stops[0] if reason is FinishReason.STOP and len(stops) == 1
                else None}

    def _message(self, content: list[dict[str, Any]], reason: FinishReason | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        stop: dict[str, Any] = ({"stop_reason": None, "stop_sequence": None}
                                if reason is None else self._stop(reason))
        return {"id": self.req.request_id, "type": "message", "role": "assistant",
                "model": self.gen.model, "content": content, **stop, "usage": usage}

    def whole(self, answer: Answer) -> dict[str, Any]:
        content = answer.first.parts(
            lambda thought: {"type": "thinking", "thinking": thought, "signature": ""},
            lambda text: {"type": "text", "text": text},
            lambda call: {"type": "tool_use", "id": call.id, "name": call.name,
                          "input": json.loads(call.arguments)})
        return self._message(content, answer.first.reason, _usage(answer.usage))

    # ------------------------------------------------------------------ streaming

    def _block(self, kind: str, start: dict[str, Any]) -> bytes:
        """Close the open block and open one of ``kind``."""
        out = self._close()
        self.blocks += 1
        self.open = kind
        return out + sse_event("content_block_start", {
            "index": self.blocks, "content_block": {"type": kind, **start}})

    def _delta(self, kind: str, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"index": self.blocks,
                                                 "delta": {"type": kind, **delta}})

    def _text(self, kind: str, text: str) -> bytes:
        """Text of a ``text`` or ``thinking`` block, in the open one if it is that kind."""
        out = b""
        if self.open != kind:
            out = self._block(kind, {kind: "", **({"signature": ""} if kind == "thinking"
                                                  else {})})
        return out + self._delta(f"{kind}_delta", {kind: text})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return sse_event("content_block_stop", {"index": self.blocks})

    def holds(self, part: Part) -> bool:
        """``message_start`` reports the prompt's tokens, as Anthropic's does (its clients
        read them there): not begun while the model loads, when they are not known."""
        return isinstance(part, Queued | Running) and part.prompt is None

    def begin(self, part: Part) -> bytes:
        prompt = (part.prompt if isinstance(part, Queued | Running)
                  else part.total if isinstance(part, Prefill) else None)
        return sse_event("message_start", {"message": self._message(
            [], None, {"input_tokens": prompt or 0, "output_tokens": 0})})

    def heartbeat(self) -> bytes:
        return sse_event("ping", {})

    def on_queued(self, part: Queued) -> bytes:
        return sse_event("ping", {"queue_position": part.position, **part.eta()})

    def on_running(self, part: Running) -> bytes:
        return sse_event("ping", {"queue_position": 0})

    def on_calls(self, part: Calls) -> bytes:
        out = b""
        for call in part.calls:
            out += self._block("tool_use", {"id": call.id, "name": call.name, "input": {}})
            out += self._delta("input_json_delta", {"partial_json": call.arguments})
        return out

    def on_thinking(self, part: Thinking) -> bytes:
        return self._text("thinking", part.text)

    def on_text(self, part: Text) -> bytes:
        return self._text("text", part.text) if part.text else b""

    def on_finished(self, part: Finished) -> bytes:
        return (self._close()
                + sse_event("message_delta", {"delta": self._stop(part.reason),
                                              "usage": _usage(part.usage)})
                + sse_event("message_stop", {}))

    def on_failed(self, part: Failed) -> bytes:
        body = error_body(status_of(part.error, part.outcome),
                          _too_long(part.outcome) or part.error.message)
        return sse_event("error", {"error": body["error"]})


class _Count(_Exchange):
    """count_tokens: the prompt tokens of a one-token generation."""

    def whole(self, answer: Answer) -> dict[str, Any]:
        return {"input_tokens": answer.usage.prompt}


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
        stream = stream_flag(data)
        # (a stream asks for the prompt's progress: its first report, or a place in the
        # queue, says the prompt's size before message_start is written)
        req = self._generate(request, data, "msg", **parse.tools(data),
                             **parse.options(request, data), **({"progress": True}
                                                                if stream else {}))
        return _Message(self.api, req, request.state.principal, stream=stream)

    async def count_tokens(self, request: HttpRequest) -> Any:
        """The prompt's tokens, tools included; the tool choice renders nothing."""
        data = await self.reader.json(request)
        tools = {k: v for k, v in parse.tools(data).items() if k == "tools"}
        req = self._generate(request, data, "count", max_tokens=1, temperature=0.0, **tools,
                             **parse.options(request, data, counting=True))
        return _Count(self.api, req, request.state.principal)
