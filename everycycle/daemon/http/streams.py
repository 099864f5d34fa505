"""Resumable streams, as llama-server keeps them for its web UI: a streamed answer whose
request carries ``X-Conversation-Id`` survives its client (a reloaded page, a dropped
connection): generation goes on and its bytes are kept here, for resume.py's routes to
replay (``GET /v1/stream?conv_id=ID&from=N``) or stop (``DELETE``).

A session is its key's own: another key's GET finds nothing (404). It keeps the last
``MAX_BYTES`` of its answer (an older offset is "lost", 400) and is forgotten
``TTL_S`` after it ends; a new request with the same id replaces (and stops) it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..keys import Principal

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
HEADER = "x-conversation-id"
TTL_S = 300.0
MAX_BYTES = 4 * 1024 * 1024
MAX_SESSIONS = 64
"""Sessions kept at once; past it the oldest that ended goes first (then the oldest)."""


@dataclass(eq=False)
class Session:
    """One answer's bytes, as its stream wrote them."""

    conv_id: str
    stop: Callable[[], None]
    """Stops the request (DELETE, or a newer request with the same id)."""
    content_type: str = "text/event-stream"
    """What the stream is (NDJSON for Ollama's)."""
    started: float = field(default_factory=time.time)
    completed: float = 0.0
    cancelled: bool = False
    dropped: int = 0
    """Bytes forgotten from the front (past MAX_BYTES)."""
    buffer: bytearray = field(default_factory=bytearray)
    client_gone: bool = False
    """The stream's own client left (the answer goes on, kept here)."""
    _grew: anyio.Event = field(default_factory=anyio.Event)

    @property
    def done(self) -> bool:
        return self.completed > 0

    @property
    def total(self) -> int:
        return self.dropped + len(self.buffer)

    def append(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > MAX_BYTES:
            cut = len(self.buffer) - MAX_BYTES
            del self.buffer[:cut]
            self.dropped += cut
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.completed = time.time()
            self.stop = _nothing  # (nothing left to stop; what it held is let go)
            self._wake()

    def tee(self, send: Send) -> Send:
        """``send``, keeping what the stream writes; once its client is gone, only kept."""
        async def both(message: MutableMapping[str, Any]) -> None:
            if message.get("more_body") and message.get("body"):
                self.append(message["body"])
            if self.client_gone:
                return
            try:
                await send(message)
            except OSError:
                self.client_gone = True
        return both

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.stop()
        self.finish()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = anyio.Event()

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from ``offset`` on, as they come, until the answer ends."""
        while True:
            if offset < self.dropped:
                return  # (forgotten while this reader was slow)
            if offset < self.total:
                chunk = bytes(self.buffer[offset - self.dropped:])
                offset += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            await self._grew.wait()

    def state(self) -> dict[str, Any]:
        return {"conversation_id": self.conv_id, "is_done": self.done,
                "total_bytes": self.total, "started_at": int(self.started),
                "completed_at": int(self.completed)}


def _nothing() -> None:
    pass


class Sessions:
    """The live and recent sessions, by (key name, conversation id)."""

    def __init__(self) -> None:
        self._by: dict[tuple[str, str], Session] = {}

    def open(self, principal: Principal, conv_id: str, stop: Callable[[], None],
             content_type: str) -> Session:
        """A new session for ``conv_id``, stopping the one it replaces."""
        self._prune()
        old = self._by.pop((principal.name, conv_id), None)
        if old is not None:
            old.cancel()
        while len(self._by) >= MAX_SESSIONS:
            oldest = min(self._by, key=lambda k: (not self._by[k].done, self._by[k].started))
            del self._by[oldest]
        session = self._by[(principal.name, conv_id)] = Session(conv_id, stop, content_type)
        return session

    def get(self, principal: Principal, conv_id: str) -> Session | None:
        self._prune()
        return self._by.get((principal.name, conv_id))

    def forget(self, principal: Principal, conv_id: str, only: Session | None = None,
               stop: bool = True) -> None:
        """Forget ``conv_id``'s session (``only`` that one), stopping it (``stop``)."""
        key = (principal.name, conv_id)
        session = self._by.get(key)
        if session is None or (only is not None and session is not only):
            return
        del self._by[key]
        if stop:
            session.cancel()

    def matching(self, principal: Principal, ids: Sequence[str]) -> list[Session]:
        """The caller's sessions named by ``ids`` (an id matches itself and llama-server's
        per-model ``ID::MODEL``)."""
        self._prune()
        mine = [s for (owner, _), s in self._by.items() if owner == principal.name]
        return [s for i in ids for s in mine
                if s.conv_id == i or s.conv_id.startswith(f"{i}::")]

    def _prune(self) -> None:
        now = time.time()
        for k in [k for k, s in self._by.items() if s.done and now - s.completed > TTL_S]:
            del self._by[k]


def conversation_id(scope: MutableMapping[str, Any]) -> str | None:
    """The request's ``X-Conversation-Id`` (None: absent or empty)."""
    for k, v in scope.get("headers", []):
        if k.decode("latin-1").lower() == HEADER:
            value: str = v.decode("latin-1").strip()
            return value or None
    return None
