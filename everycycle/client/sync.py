"""A blocking client over the daemon's Unix socket: plain sockets, no event loop.

For programs without an event loop and for the CLI's one-shot commands, which must
start fast (no asyncio import). The routing rules are ``ClientConnection``'s.
"""

from __future__ import annotations

import socket as pysocket
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self, TypeVar

from .. import paths
from ..errors import DaemonUnavailableError, EverycycleError
from ..protocol import Auth, Message, Request, ServerEvent
from . import calls
from .connection import ClientConnection, Routed

T = TypeVar("T")

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

    def run(self, call: calls.Call[T]) -> T:
        """Send ``call``'s request; its result. Raises RequestFailedError (unless quiet)."""
        try:
            return call.finish(list(self.request(call.request))[-1])
        except EverycycleError as exc:
            return call.failed(exc)

    def generate(self, model: str, prompt: str | None = None, *,
                 messages: tuple[Message, ...] | None = None, request_id: str | None = None,
                 **options: Any) -> Iterator[ServerEvent]:
        """Events of a Generate request (see protocol.Generate for ``options``)."""
        return self.request(calls.generate_request(model, prompt, messages=messages,
                                                   request_id=request_id, **options))

    embed = calls.blocking(calls.embed)
    rerank = calls.blocking(calls.rerank)
    describe_fleet = calls.blocking(calls.describe_fleet)
    cancel = calls.blocking(calls.cancel)
    cancel_if_active = calls.blocking(calls.cancel_if_active)
    load = calls.blocking(calls.load)
    unload = calls.blocking(calls.unload)
    shutdown = calls.blocking(calls.shutdown)
    list_tools = calls.blocking(calls.list_tools)
    run_tool = calls.blocking(calls.run_tool)
