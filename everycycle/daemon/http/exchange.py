"""The exchange with the supervisor that every API dialect shares: one HTTP request
runs as one protocol request with an id, on the same supervisor as the socket, with
the same queue positions, deadlines, quotas, audit and metrics.

An ``Exchange`` is the ASGI response: it hands the request to the supervisor, then
gives the dialect's ``respond`` the request's events as they come, each terminal
event with its Outcome. A client that disconnects (or a write that fails) cancels
the request on the supervisor within one decode step.

A stream never goes quiet while we work: when nothing was written for ``heartbeat_s``
(waiting in the queue, a model loading, a long prompt's prefill), the dialect's
``heartbeat`` is written — something its clients' idle timers count and their parsers
skip — so an agent with a stream-idle limit (Codex's is 300 s) does not give up on a
request that is only slow to begin.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
from starlette.routing import BaseRoute

from ...errors import ErrorKind
from ...mailbox import Mailbox
from ...protocol import Embed, Error, Generate, ServerEvent, Tokens, ToolCall, ToolCalls
from ..keys import Principal
from ..outcome import Outcome
from ..supervisor import Supervisor
from .common import Reader

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Events = AsyncIterator[tuple[ServerEvent, Outcome | None]]
T = TypeVar("T")

STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.MODEL_NOT_LOADED: 503,
    ErrorKind.REJECTED: 429,
    ErrorKind.CANCELLED: 499,
    ErrorKind.INTERNAL: 500,
}
"""The HTTP status of each terminal error kind, in every dialect."""


class Spawner(Protocol):
    """Where request tasks run (the daemon's task group), the supervisor, and the
    seconds of silence after which a stream gets a heartbeat."""

    supervisor: Supervisor
    heartbeat_s: float

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None: ...


class Dialect:
    """One API dialect's routes over ``api`` (where requests run) and ``reader``."""

    def __init__(self, api: Spawner, reader: Reader) -> None:
        self.api = api
        self.reader = reader

    def routes(self) -> list[BaseRoute]:
        """The dialect's routes, for the app."""
        raise NotImplementedError


class HttpPeer:
    """The supervisor's view of one HTTP request: its events, queued for the handler."""

    allow_paths = False

    def __init__(self, principal: Principal) -> None:
        self.principal = principal
        self.box: Mailbox[tuple[ServerEvent, Outcome | None] | None] = Mailbox()
        """The request's events; None is a tick (time to see whether the stream is quiet)."""
        self.tick: Callable[[], Awaitable[None]] | None = None
        """What a tick does, in the task that reads the events (so writes never overlap)."""

    def emit(self, event: ServerEvent, outcome: Outcome | None = None) -> None:
        self.box.put((event, outcome))

    async def events(self) -> Events:
        """The request's events as they come, until the box is closed."""
        while True:
            try:
                batch = await self.box.take()
            except anyio.EndOfStream:
                return
            for item in batch:
                if item is not None:
                    yield item
                elif self.tick is not None:
                    await self.tick()


def retry_after(outcome: Outcome | None) -> str:
    """Whole seconds to wait before trying a refused request again (at least 1)."""
    wait = outcome.retry_after_s if outcome and outcome.retry_after_s else 1.0
    return str(max(1, math.ceil(wait)))


def dumps(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(name: str, fields: dict[str, Any]) -> bytes:
    """One named server-sent event whose data is ``{"type": NAME, **fields}``."""
    return b"event: " + name.encode() + b"\ndata: " + dumps({"type": name, **fields}) + b"\n\n"


@dataclass
class Whole:
    """A request's answer gathered whole: its text, thoughts and tool calls, and how it
    ended (``error`` set when it failed)."""

    text: str = ""
    reasoning: str = ""
    calls: ToolCalls | None = None
    error: Error | None = None
    outcome: Outcome | None = None

    def parts(self, thought: Callable[[str], T], text: Callable[[str], T],
              call: Callable[[ToolCall], T]) -> list[T]:
        """The answer's parts, each shaped by its function, in the order every dialect
        gives them: the thoughts (if any), the text (even empty, unless there are tool
        calls), then each tool call."""
        out = [thought(self.reasoning)] if self.reasoning else []
        if self.text or not self.calls:
            out.append(text(self.text))
        out.extend(call(c) for c in (self.calls.calls if self.calls else ()))
        return out


async def gather(events: Events) -> Whole:
    """The whole answer of a Generate from its events, up to the terminal one."""
    whole = Whole()
    text: list[str] = []
    thought: list[str] = []
    async for event, outcome in events:
        if isinstance(event, Error):
            whole.error, whole.outcome = event, outcome
            break
        if isinstance(event, ToolCalls):
            whole.calls = event
        elif isinstance(event, Tokens):
            text.append(event.chunk.text)
            thought.append(event.chunk.reasoning or "")
            if event.finished:
                whole.outcome = outcome
                break
    whole.text, whole.reasoning = "".join(text), "".join(thought)
    return whole


class Exchange:
    """One protocol request for one HTTP exchange; a dialect subclasses ``answer`` and
    ``answer_stream`` (or ``collect``)."""

    def __init__(self, api: Spawner, req: Generate | Embed, principal: Principal,
                 more: Sequence[Generate] = ()) -> None:
        """``more``: requests answered in the same response (OpenAI's ``n``), whose
        events come interleaved with ``req``'s."""
        self.api = api
        self.req = req
        self.reqs: list[Generate | Embed] = [req, *more]
        self.principal = principal

    started = False
    """Whether a stream began (its 200 and headers are sent)."""

    stream = False
    """Whether the client asked for a stream (else one whole answer)."""

    last_write = 0.0
    """When the stream last wrote (time.monotonic)."""

    async def respond(self, events: Events, send: Send) -> None:
        """Answer the client from the request's events, in the dialect's shape."""
        if self.stream:
            await self.answer_stream(events, send)
        else:
            await self.collect(events, send)

    async def collect(self, events: Events, send: Send) -> None:
        """The whole answer: the events gathered (``whole``), then sent by ``answer``."""
        if (whole := await self.whole(events, send)) is not None:
            await self.answer(send, whole)

    async def answer(self, send: Send, whole: Whole) -> None:
        """Send the answer gathered whole, in the dialect's shape."""
        raise NotImplementedError

    async def answer_stream(self, events: Events, send: Send) -> None:
        """Stream the answer as its events come, in the dialect's shape."""
        raise NotImplementedError

    def error_answer(self, event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
        """A terminal Error's HTTP status and body, in the dialect's shape."""
        raise NotImplementedError

    async def fail(self, send: Send, event: Error, outcome: Outcome | None) -> None:
        """A terminal Error as a whole answer (before any stream began)."""
        status, body = self.error_answer(event, outcome)
        await self.send_error(send, event, outcome, body, status)

    async def whole(self, events: Events, send: Send) -> Whole | None:
        """The request's whole answer; None once its failure was answered (``fail``)."""
        answer = await gather(events)
        if answer.error is not None:
            await self.fail(send, answer.error, answer.outcome)
            return None
        return answer

    async def begin(self, send: Send, event: ServerEvent) -> None:
        """What a stream writes first, before its first event (``event``)."""

    async def heartbeat(self, send: Send) -> None:
        """What a stream writes after ``heartbeat_s`` of silence: something its clients'
        idle timers count and their parsers skip. An SSE comment unless the dialect
        says."""
        await self.write(send, b": keep-alive\n\n")

    async def _beat(self, send: Send) -> None:
        if self.started and time.monotonic() - self.last_write >= self.api.heartbeat_s:
            await self.heartbeat(send)

    async def _ticks(self, peer: HttpPeer) -> None:
        """Tick twice a heartbeat period: a stream is never quiet for 1.5 periods."""
        while True:
            await anyio.sleep(self.api.heartbeat_s / 2)
            if self.started and time.monotonic() - self.last_write >= self.api.heartbeat_s:
                peer.box.put(None)

    async def streamed(self, events: Events, send: Send) -> Events:
        """The request's events for a stream: an Error before any other event is answered
        whole (``fail``); any other first event begins the stream (SSE, ``begin``)."""
        async for event, outcome in events:
            if not self.started:
                if isinstance(event, Error):
                    await self.fail(send, event, outcome)
                    return
                await self.start_stream(send, "text/event-stream")
                self.started = True
                await self.begin(send, event)
            yield event, outcome

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = HttpPeer(self.principal)
        peer.tick = lambda: self._beat(send)
        sup = self.api.supervisor
        for req in self.reqs:
            self.api.spawn(sup.handle, peer, req)
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
                if self.stream and self.api.heartbeat_s > 0:
                    tg.start_soon(self._ticks, peer)
                try:
                    await self.respond(peer.events(), send)
                except OSError:  # the client went away while we wrote
                    sup.disconnect(peer)
                tg.cancel_scope.cancel()
        finally:
            sup.disconnect(peer)
            peer.box.close()

    # ------------------------------------------------------------------ writing

    def headers(self, content_type: str, length: int | None = None
                ) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type.encode()),
                   (b"x-request-id", self.req.request_id.encode())]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        return headers

    async def send_json(self, send: Send, status: int, body: bytes,
                        extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """A whole JSON answer."""
        headers = self.headers("application/json", len(body)) + (extra or [])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def send_error(self, send: Send, event: Error, outcome: Outcome | None,
                         body: bytes, status: int | None = None) -> None:
        """A terminal Error as a whole answer with its status (``STATUS`` unless the
        dialect says) and, when it was refused (429, or 529 overloaded), Retry-After."""
        status = status or STATUS[event.kind]
        extra = ([(b"retry-after", retry_after(outcome).encode())] if status in (429, 529)
                 else [])
        await self.send_json(send, status, body, extra)

    async def start_stream(self, send: Send, content_type: str) -> None:
        self.last_write = time.monotonic()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*self.headers(content_type), (b"cache-control", b"no-cache")]})

    async def write(self, send: Send, data: bytes) -> None:
        self.last_write = time.monotonic()
        await send({"type": "http.response.body", "body": data, "more_body": True})

    @staticmethod
    async def end_stream(send: Send) -> None:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
