"""The supervisor's peers that the daemon itself makes: one per socket connection
(its outgoing lines, backpressure, identity) and the daemon's own requests (``--load``,
a drain), whose answers go to the log."""

from __future__ import annotations

import logging
import socket
from typing import Any

import anyio

from ..mailbox import Mailbox
from ..protocol import Error, ServerEvent
from .connection import ServerConnection
from .keys import LOCAL, Principal
from .outcome import Outcome
from .supervisor import Supervisor

log = logging.getLogger(__name__)


MAX_UNSENT_BYTES = 1 << 20
"""Output queued for a connection beyond which the daemon stops reading its requests
(backpressure: a client that does not read is not read)."""
MAX_UNSENT_HARD_BYTES = 16 << 20
"""Output queued beyond which the connection is closed and its requests cancelled (its
streams produce faster than it reads)."""
MAX_PENDING_REQUESTS = 64
"""Requests of one connection being handled at once before the daemon stops reading."""


class SocketPeer:
    """One client connection: its outgoing lines and identity (a supervisor Peer)."""

    def __init__(self, protocol: ServerConnection[Principal], *, allow_paths: bool,
                 sock: socket.socket | None = None) -> None:
        self.protocol = protocol
        self.allow_paths = allow_paths
        self.outgoing: Mailbox[bytes] = Mailbox()
        """Encoded lines for the connection's writer; closed when the connection ends."""
        self._sock = sock
        """The connection's own (non-blocking) socket: a line is written straight to it
        while nothing waits to be written before it (the per-token path: no wake-up of
        the writer task); what does not fit goes to the writer."""
        self.writing = False
        """The writer holds lines taken from ``outgoing`` and not yet all sent."""
        self.unsent = 0
        """Bytes queued for the client and not yet written."""
        self.pending = 0
        """Requests being handled (admission, fleet, load...)."""
        self._room: anyio.Event | None = None
        self.overflowed = False

    @property
    def principal(self) -> Principal:
        """The Unix socket's user is "local"; a TCP connection is whoever its Auth names."""
        return self.protocol.principal or LOCAL

    def emit(self, event: ServerEvent, outcome: Outcome | None = None) -> None:
        """The socket protocol carries no usage report: the terminal event is all."""
        if self.outgoing.closed:
            return
        line = self.protocol.send(event)
        if self._sock is not None and not self.writing and not self.outgoing:
            try:
                n = self._sock.send(line)
            except BlockingIOError:
                n = 0
            except OSError:  # the client is gone: the writer ends the connection
                self.outgoing.close()
                return
            if n == len(line):
                return
            line = line[n:]
        self.unsent += len(line)
        if self.unsent > MAX_UNSENT_HARD_BYTES:
            self.overflowed = True
            self.outgoing.close()  # the writer ends, and with it the connection
            return
        self.outgoing.put(line)

    def sent(self, n: int) -> None:
        self.unsent -= n
        self._wake()

    def _wake(self) -> None:
        if self._room is not None and self.has_room():
            self._room.set()
            self._room = None

    def has_room(self) -> bool:
        return self.unsent <= MAX_UNSENT_BYTES and self.pending < MAX_PENDING_REQUESTS

    async def wait_for_room(self) -> None:
        """Return once the client has read enough, and few enough requests are pending."""
        while not self.has_room() and not self.outgoing.closed:
            self._room = room = anyio.Event()
            await room.wait()

    async def handle(self, supervisor: Supervisor, request: Any) -> None:
        self.pending += 1
        try:
            await supervisor.handle(self, request)
        finally:
            self.pending -= 1
            self._wake()

    def close(self) -> None:
        self.outgoing.close()
        if self._room is not None:
            self._room.set()


class Told:
    """The daemon's own requests (``--load``, a drain): their answer goes to the log."""

    allow_paths = True
    principal = LOCAL

    def __init__(self, what: str) -> None:
        self.what = what

    def emit(self, event: ServerEvent, outcome: Outcome | None = None) -> None:
        if isinstance(event, Error):
            log.error("%s: %s", self.what, event.message)
        else:
            log.info("%s: done", self.what)
