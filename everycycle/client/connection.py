"""The client side of the protocol as a state machine: requests to bytes, bytes to
routed events. No I/O (h11's ``Connection`` is the model); the async client, the
blocking client, the embedded client and the tests' raw helper all drive one.

Rules, each applied here and nowhere else:

1. A request id is active from ``begin`` until its terminal event (``is_terminal``);
   reusing an active id on the same connection is a UsageError (the daemon would
   answer Error{Invalid} and the two streams could not be told apart).
2. An event is routed by its ``request_id``. ``FleetDescription`` carries none: it
   answers the oldest DescribeFleet still waiting for one (the daemon answers a
   connection's DescribeFleet requests in order). An ``Error`` that answers a
   DescribeFleet removes that id from the waiting line, so a later fleet reply is
   never handed to the wrong waiter.
3. An ``Error`` with an empty request id is one the daemon could not attribute (a
   line it could not parse). It goes to the only active request when there is
   exactly one; otherwise it is routed to ``UNATTRIBUTED`` and the caller decides.
4. After ``close`` (end of stream, or a line from the daemon that does not decode)
   the connection is dead:
   ``begin`` raises DaemonUnavailableError with the reason, and every request that
   was active is reported by ``close`` so the caller can fail it.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass

from ..errors import DaemonUnavailableError, ProtocolError, UsageError
from ..protocol import (
    DescribeFleet,
    Error,
    FleetDescription,
    LineFramer,
    Request,
    ServerEvent,
    decode_event,
    encode,
    is_terminal,
)

__all__ = ["UNATTRIBUTED", "ClientConnection", "Routed", "new_request_id"]

UNATTRIBUTED = ""
"""The route of an event that belongs to no known request."""


def new_request_id() -> str:
    """A fresh RequestId (UUID4 hex)."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Routed:
    """An event and the request it belongs to (UNATTRIBUTED when none)."""

    request_id: str
    event: ServerEvent
    terminal: bool


class ClientConnection:
    """One connection's request lifecycle and event routing. No I/O."""

    def __init__(self) -> None:
        self._framer = LineFramer()
        self._active: set[str] = set()
        self._fleet_waiting: deque[str] = deque()
        self._closed: str | None = None

    @property
    def closed(self) -> str | None:
        """Why the connection ended, or None while it is usable."""
        return self._closed

    @property
    def active(self) -> frozenset[str]:
        """Request ids awaiting their terminal event."""
        return frozenset(self._active)

    def begin(self, request: Request) -> None:
        """Start tracking ``request``. Raises DaemonUnavailableError after close,
        UsageError for an id that is already active on this connection."""
        if self._closed is not None:
            raise DaemonUnavailableError(self._closed)
        rid = getattr(request, "request_id", None)
        if rid is None:  # Auth: no answer expected
            return
        if rid in self._active:
            raise UsageError(f"request id '{rid}' is already active on this connection")
        self._active.add(rid)
        if isinstance(request, DescribeFleet):
            self._fleet_waiting.append(rid)

    def send(self, request: Request) -> bytes:
        """``begin`` the request and return its wire line."""
        self.begin(request)
        return encode(request)

    def abandon(self, request_id: str) -> None:
        """The caller stopped waiting for ``request_id``; later events are unattributed."""
        self._active.discard(request_id)
        if request_id in self._fleet_waiting:
            self._fleet_waiting.remove(request_id)

    def receive_data(self, data: bytes | bytearray) -> list[Routed]:
        """Feed bytes from the daemon (``b""`` is end of stream); return the events
        they complete, routed in order.

        A line that is too long or does not decode closes the connection (``closed``
        says why): the stream cannot be trusted after it. Events before it are kept.
        """
        if not data:
            self.close()
            return []
        try:
            lines = self._framer.feed(data)
        except ProtocolError as exc:
            self.close(f"the daemon sent an invalid line: {exc.message}")
            return []
        routed: list[Routed] = []
        for line in lines:
            try:
                event = decode_event(line)
            except ProtocolError as exc:
                self.close(f"the daemon sent an invalid line: {exc.message}")
                break
            routed.append(self.receive_event(event))
        return routed

    def receive_event(self, event: ServerEvent) -> Routed:
        """Route one decoded event (the embedded client hands events over directly)."""
        if isinstance(event, FleetDescription):
            rid = self._fleet_waiting.popleft() if self._fleet_waiting else UNATTRIBUTED
        else:
            rid = event.request_id
            if (not rid and isinstance(event, Error) and len(self._active) == 1):
                (rid,) = self._active
        terminal = is_terminal(event)
        if rid in self._active and terminal:
            self.abandon(rid)
        return Routed(rid, event, terminal)

    def close(self, reason: str = "the daemon closed the connection") -> list[str]:
        """End the connection; returns the ids that never got their terminal event."""
        if self._closed is None:
            self._closed = reason
        lost = sorted(self._active)
        self._active.clear()
        self._fleet_waiting.clear()
        return lost
