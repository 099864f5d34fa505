"""A blocking client over the daemon's Unix socket: plain sockets, no event loop.

For programs without an event loop and for the CLI's one-shot commands, which must
start fast (no asyncio import). The routing rules are ``ClientConnection``'s.
"""

from __future__ import annotations

import socket as pysocket
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

from .. import paths
from ..errors import DaemonUnavailableError, RequestFailedError
from ..protocol import (
    Auth,
    Cancel,
    DescribeFleet,
    Embed,
    Embeddings,
    Error,
    FleetDescription,
    FleetSnapshot,
    Generate,
    Load,
    Message,
    Request,
    ServerEvent,
    Shutdown,
    Unload,
)
from .connection import ClientConnection, Routed, new_request_id

__all__ = ["SyncClient"]


class SyncClient:
    """``with SyncClient() as c: print(c.describe_fleet())``. Raises DaemonUnavailableError."""

    def __init__(self, socket: Path | None = None, *, tcp: tuple[str, int] | None = None,
                 token: str | None = None, timeout: float | None = None) -> None:
        self.path = socket or paths.socket_path()
        self.tcp = tcp
        self._token = token
        self._timeout = timeout
        self._sock: pysocket.socket | None = None
        self._conn = ClientConnection()
        self._pending: deque[Routed] = deque()

    def __enter__(self) -> Self:
        where = f"{self.tcp[0]}:{self.tcp[1]}" if self.tcp else str(self.path)
        try:
            if self.tcp is not None:
                sock = pysocket.create_connection(self.tcp, timeout=self._timeout or 30)
                sock.settimeout(self._timeout)
            else:
                sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
                sock.settimeout(self._timeout)
                try:
                    sock.connect(str(self.path))
                except OSError:
                    sock.close()
                    raise
        except OSError as exc:
            raise DaemonUnavailableError(f"no daemon at {where} ({exc.strerror or exc})"
                                         ) from None
        self._sock = sock
        if self._token is not None:
            try:
                sock.sendall(self._conn.send(Auth(self._token)))
            except OSError as exc:
                sock.close()
                raise DaemonUnavailableError(f"lost the daemon at {where}: {exc}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._conn.close("the client closed the connection")

    def _next(self) -> Routed:
        assert self._sock is not None
        while not self._pending:
            if self._conn.closed is not None:
                raise DaemonUnavailableError(self._conn.closed)
            try:
                data = self._sock.recv(65536)
            except OSError as exc:
                self._conn.close(f"lost the daemon: {exc}")
                continue
            self._pending.extend(self._conn.receive_data(data))
        return self._pending.popleft()

    def request(self, request: Request) -> Iterator[ServerEvent]:
        """Send ``request``; yield its events through the terminal one."""
        if self._sock is None:
            raise DaemonUnavailableError("not connected (use `with SyncClient() as c`)")
        rid = getattr(request, "request_id", "")
        line = self._conn.send(request)
        try:
            self._sock.sendall(line)
        except OSError as exc:
            self._conn.close(f"lost the daemon: {exc}")
            raise DaemonUnavailableError(f"lost the daemon: {exc}") from None
        try:
            while True:
                routed = self._next()
                if routed.request_id != rid:
                    continue  # an abandoned earlier request's late events
                yield routed.event
                if routed.terminal:
                    return
        finally:
            self._conn.abandon(rid)

    def _one(self, request: Request) -> ServerEvent:
        last = list(self.request(request))[-1]
        if isinstance(last, Error):
            raise RequestFailedError(last.message, kind=last.kind, request_id=last.request_id)
        return last

    def generate(self, model: str, prompt: str | None = None, *,
                 messages: tuple[Message, ...] | None = None, request_id: str | None = None,
                 **options: Any) -> Iterator[ServerEvent]:
        """Events of a Generate request (see protocol.Generate for ``options``)."""
        return self.request(Generate(request_id or new_request_id(), model, prompt,
                                     messages=messages, **options))

    def embed(self, model: str, texts: Sequence[str], **options: Any
              ) -> list[tuple[float, ...]]:
        """One normalized vector per text, in order. Raises RequestFailedError."""
        event = self._one(Embed(new_request_id(), model, tuple(texts), **options))
        assert isinstance(event, Embeddings)
        return list(event.vectors)

    def describe_fleet(self) -> FleetSnapshot:
        """The daemon's FleetSnapshot. Raises RequestFailedError."""
        event = self._one(DescribeFleet(new_request_id()))
        assert isinstance(event, FleetDescription)
        return event.snapshot

    def cancel(self, target: str) -> None:
        """Cancel request ``target``. Raises RequestFailedError (Invalid if not active)."""
        self._one(Cancel(new_request_id(), target))

    def load(self, model: str, executor: str | None = None, *,
             keep_alive_ms: int | None = None) -> None:
        """Make ``model`` resident. Raises RequestFailedError."""
        self._one(Load(new_request_id(), model, executor, keep_alive_ms))

    def unload(self, model: str) -> None:
        """Release ``model``. Raises RequestFailedError."""
        self._one(Unload(new_request_id(), model))

    def shutdown(self) -> None:
        """Ask the daemon to stop gracefully. Raises RequestFailedError."""
        self._one(Shutdown(new_request_id()))
