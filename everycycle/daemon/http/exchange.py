"""The exchange with the supervisor that every API dialect shares: one HTTP request
runs as one protocol request with an id, on the same supervisor as the socket, with
the same queue positions, deadlines, quotas, audit and metrics.

An ``Exchange`` is the ASGI response: it hands the request to the supervisor, folds the
request's events into answer parts as they come (``answer.fold``), and lets the dialect
shape them: part by part for a stream (``on_text``, ``on_finished``, …), or gathered
whole (``whole``). A client that disconnects (or a write that fails) cancels the request
on the supervisor within one decode step.

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
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread
from starlette.requests import Request as HttpRequest
from starlette.routing import BaseRoute

from ...engine.host.contract import Engine
from ...errors import ErrorKind, EverycycleError
from ...mailbox import Mailbox
from ...models.registry import ModelSpec
from ...protocol import Done, Embed, Error, Generate, Load, ServerEvent, Unload
from ..keys import Principal
from ..outcome import Outcome
from ..supervisor import Supervisor
from .answer import (
    Answer,
    Calls,
    Events,
    Failed,
    Finished,
    Part,
    Prefill,
    Queued,
    Running,
    Text,
    Thinking,
    Vectors,
    fold,
    gather,
)
from .common import HttpError, Reader
from .streams import Session, Sessions, conversation_id

T = TypeVar("T")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_ON: dict[type[Part], str] = {
    Queued: "on_queued", Running: "on_running", Prefill: "on_prefill",
    Thinking: "on_thinking", Text: "on_text", Calls: "on_calls", Finished: "on_finished",
    Failed: "on_failed", Vectors: "on_vectors"}
"""Which method of an Exchange shapes each part of a streamed answer."""

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
    streams: Sessions

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


async def control(api: Spawner, principal: Principal, req: Load | Unload) -> Error | None:
    """Run a Load or Unload on the supervisor; its Error, or None once Done."""
    peer = HttpPeer(principal)
    api.spawn(api.supervisor.handle, peer, req)
    try:
        async for event, _ in peer.events():
            if isinstance(event, Error):
                return event
            if isinstance(event, Done):
                return None
        return None
    finally:
        peer.box.close()


async def on_engine(api: Spawner, request: HttpRequest, model: str,
                    fn: Callable[[Engine], T]) -> tuple[ModelSpec, T]:
    """``fn(engine)`` on a worker thread, with the engine that serves ``model`` (loaded
    first where need be) for the request's principal. Raises HttpError for what the
    supervisor refuses."""
    principal = request.state.principal
    try:
        spec, engine = await api.supervisor.engine_for(principal, model)
        return spec, await anyio.to_thread.run_sync(fn, engine)
    except EverycycleError as exc:
        status = STATUS.get(exc.kind, 500) if exc.kind is not ErrorKind.CANCELLED else 503
        raise HttpError(status, exc.message, exc.kind.value) from None


async def text_biases(api: Spawner, request: HttpRequest, model: str,
                      data: dict[str, Any]) -> None:
    """llama-server's ``logit_bias`` keyed by text (``{"hello": -5}``, ``[["hello",
    false]]``: each of the text's tokens gets the bias; ``false`` bans them) rewritten in
    ``data`` as token ids, with the model's tokenizer. Anything else is left for the
    sampling table to read (and refuse)."""
    raw = data.get("logit_bias")
    pairs = (list(raw.items()) if isinstance(raw, dict) else
             [tuple(p) for p in raw if isinstance(p, list) and len(p) == 2]
             if isinstance(raw, list) else [])
    texts = [k for k, _ in pairs if isinstance(k, str) and not k.isdigit()]
    if not texts and not any(b is False for _, b in pairs):
        return
    _, toks = await on_engine(api, request, model, lambda engine: engine.tokens(texts))
    by_text = dict(zip(texts, toks, strict=True))
    out: list[list[Any]] = []
    for key, bias in pairs:
        value = -100.0 if bias is False else bias  # (-100: as good as banned)
        ids = by_text.get(key, [key]) if isinstance(key, str) else [key]
        out.extend([int(t) if isinstance(t, str) else t, value] for t in ids)
    data["logit_bias"] = out


def retry_after(outcome: Outcome | None) -> str:
    """Whole seconds to wait before trying a refused request again (at least 1)."""
    wait = outcome.retry_after_s if outcome and outcome.retry_after_s else 1.0
    return str(max(1, math.ceil(wait)))


def dumps(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(name: str, fields: dict[str, Any]) -> bytes:
    """One named server-sent event whose data is ``{"type": NAME, **fields}``."""
    return b"event: " + name.encode() + b"\ndata: " + dumps({"type": name, **fields}) + b"\n\n"


class Exchange:
    """One protocol request for one HTTP exchange. A dialect says how its answer looks
    whole (``whole``) and, part by part, streamed (``begin``, ``on_text``, … each
    returning the bytes to write), and how a failure looks (``error_answer``,
    ``on_failed``)."""

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

    content_type = "text/event-stream"
    """What a stream is (NDJSON for Ollama)."""

    async def respond(self, events: Events, send: Send) -> None:
        """Answer the client from the request's events, in the dialect's shape: each
        part as it comes (``chunk``) when streaming, else gathered (``whole``)."""
        parts = fold(events, [r.request_id for r in self.reqs])
        if self.stream:
            await self.answer_stream(parts, send)
            return
        answer = await gather(parts, len(self.reqs))
        if answer.failed is not None:
            await self.fail(send, answer.failed)
        elif answer.ended:
            await self.send_json(send, 200, dumps(self.whole(answer)))

    def whole(self, answer: Answer) -> dict[str, Any]:
        """The answer gathered whole, as the dialect's JSON object."""
        raise NotImplementedError

    async def answer_stream(self, parts: AsyncIterator[Part], send: Send) -> None:
        """Stream the answer as its parts come: a failure before anything else is
        answered whole (``fail``); any other first part begins the stream (``begin``)."""
        async for part in parts:
            if not self.started:
                if isinstance(part, Failed):
                    await self.fail(send, part)
                    return
                if self.holds(part):
                    continue
                await self.start_stream(send, self.content_type)
                self.started = True
                await self.write(send, self.begin(part))
            await self.write(send, getattr(self, _ON[type(part)])(part))
        if self.started:
            await self.end_stream(send)

    def begin(self, part: Part) -> bytes:
        """What a stream writes first, before its first part."""
        return b""

    def holds(self, part: Part) -> bool:
        """Whether the stream waits for a later part to begin (``begin`` needs to know
        what this one does not say)."""
        return False

    # What a stream writes for each part (nothing unless the dialect says).

    def on_queued(self, part: Queued) -> bytes:
        return b""

    def on_running(self, part: Running) -> bytes:
        return b""

    def on_prefill(self, part: Prefill) -> bytes:
        return b""

    def on_thinking(self, part: Thinking) -> bytes:
        return b""

    def on_text(self, part: Text) -> bytes:
        return b""

    def on_calls(self, part: Calls) -> bytes:
        return b""

    def on_finished(self, part: Finished) -> bytes:
        return b""

    def on_failed(self, part: Failed) -> bytes:
        """A failure after the stream began: its last words."""
        raise NotImplementedError

    def on_vectors(self, part: Vectors) -> bytes:
        return b""

    def error_answer(self, event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
        """A terminal Error's HTTP status and body, in the dialect's shape."""
        raise NotImplementedError

    async def fail(self, send: Send, failed: Failed) -> None:
        """A failure as a whole answer (before any stream began)."""
        status, body = self.error_answer(failed.error, failed.outcome)
        await self.send_error(send, failed.error, failed.outcome, body, status)

    def heartbeat(self) -> bytes:
        """What a stream writes after ``heartbeat_s`` of silence: something its clients'
        idle timers count and their parsers skip. An SSE comment unless the dialect
        says."""
        return b": keep-alive\n\n"

    async def _beat(self, send: Send) -> None:
        if self.started and time.monotonic() - self.last_write >= self.api.heartbeat_s:
            await self.write(send, self.heartbeat())

    async def _ticks(self, peer: HttpPeer) -> None:
        """Tick twice a heartbeat period: a stream is never quiet for 1.5 periods."""
        while True:
            await anyio.sleep(self.api.heartbeat_s / 2)
            if self.started and time.monotonic() - self.last_write >= self.api.heartbeat_s:
                peer.box.put(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = HttpPeer(self.principal)
        sup = self.api.supervisor
        conv_id = conversation_id(scope) if self.stream else None
        session: Session | None = None
        for req in self.reqs:
            self.api.spawn(sup.handle, peer, req)
        try:
            async with anyio.create_task_group() as tg:

                def stop() -> None:
                    sup.disconnect(peer)  # cancelled within one decode step
                    tg.cancel_scope.cancel()

                if conv_id is not None:  # (a resumable stream: its bytes kept)
                    session = self.api.streams.open(self.principal, conv_id, stop,
                                                    self.content_type)
                    send = session.tee(send)

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            if session is not None:  # the answer goes on, kept
                                session.client_gone = True
                                return
                            stop()
                            return

                peer.tick = lambda: self._beat(send)
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
            if session is not None:
                session.finish()
                if not self.started:  # (it failed whole: nothing to resume)
                    self.api.streams.forget(self.principal, session.conv_id, session,
                                            stop=False)

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
        if not data:
            return
        self.last_write = time.monotonic()
        await send({"type": "http.response.body", "body": data, "more_body": True})

    @staticmethod
    async def end_stream(send: Send) -> None:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
