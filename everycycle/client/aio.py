"""The async client over the daemon's socket (and the base the embedded client shares).

``connect`` talks to a running daemon; ``embedded.embedded`` runs the same Supervisor
in this process, so a request gets the same events either way. Routing and the
request lifecycle are the sans-IO ``ClientConnection``'s; this module only moves
bytes and hands each request its events.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc

from .. import paths
from ..errors import DaemonUnavailableError, EverycycleError, unwrap_groups
from ..mailbox import Mailbox
from ..protocol import Auth, Message, Request, ServerEvent, is_terminal
from ..sockets import wake_reader
from . import calls
from .connection import ClientConnection, Routed

T = TypeVar("T")

__all__ = ["BaseClient", "Client", "connect"]


class BaseClient:
    """Hands routed events to the request that awaits them; subclasses deliver requests."""

    def __init__(self) -> None:
        self._conn = ClientConnection()
        self._boxes: dict[str, Mailbox[ServerEvent]] = {}

    async def _send(self, request: Request) -> None:
        raise NotImplementedError

    def _deliver(self, routed: Routed) -> None:
        box = self._boxes.get(routed.request_id)
        if box is None:
            return  # an abandoned request's late events, or one nobody can claim
        box.put(routed.event)
        if routed.terminal:
            self._boxes.pop(routed.request_id, None)
            box.close()

    def _close_all(self, reason: str) -> None:
        self._conn.close(reason)
        for box in self._boxes.values():
            box.close()
        self._boxes.clear()

    async def request(self, request: Request) -> AsyncIterator[ServerEvent]:
        """Send ``request`` and yield its events up to and including the terminal one.

        Raises DaemonUnavailableError if the connection ends first, UsageError for a
        request id already active on this client.
        """
        self._conn.begin(request)
        rid = getattr(request, "request_id", "")
        box: Mailbox[ServerEvent] = Mailbox()
        self._boxes[rid] = box
        try:
            await self._send(request)
            while True:
                try:
                    events = await box.take()
                except anyio.EndOfStream:
                    break
                for event in events:
                    yield event
                    if is_terminal(event):
                        return  # done, even if the connection closes right after
            raise DaemonUnavailableError(self._conn.closed or "the connection closed")
        finally:
            self._boxes.pop(rid, None)
            self._conn.abandon(rid)

    async def run(self, call: calls.Call[T]) -> T:
        """Send ``call``'s request; its result. Raises RequestFailedError (unless quiet)."""
        try:
            last: ServerEvent | None = None
            async for event in self.request(call.request):
                last = event
            assert last is not None
            return call.finish(last)
        except EverycycleError as exc:
            return call.failed(exc)

    def generate(self, model: str, prompt: str | None = None, *,
                 messages: tuple[Message, ...] | None = None, request_id: str | None = None,
                 **options: Any) -> AsyncIterator[ServerEvent]:
        """Events of a Generate request (see protocol.Generate for ``options``)."""
        return self.request(calls.generate_request(model, prompt, messages=messages,
                                                   request_id=request_id, **options))

    embed = calls.awaiting(calls.embed)
    describe_fleet = calls.awaiting(calls.describe_fleet)
    cancel = calls.awaiting(calls.cancel)
    cancel_if_active = calls.awaiting(calls.cancel_if_active)
    load = calls.awaiting(calls.load)
    unload = calls.awaiting(calls.unload)
    shutdown = calls.awaiting(calls.shutdown)


class Client(BaseClient):
    """A connection to a running daemon; use ``async with connect(...) as client``."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        super().__init__()
        self._stream = stream
        self._lock = anyio.Lock()

    async def _send(self, request: Request) -> None:
        from ..protocol import encode

        try:
            async with self._lock:
                await self._stream.send(encode(request))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._close_all(f"lost the daemon: {exc}")
            raise DaemonUnavailableError(f"lost the daemon: {exc}") from None

    async def _read(self) -> None:
        while self._conn.closed is None:
            try:
                data = await self._stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    OSError):
                data = b""
            for routed in self._conn.receive_data(data):
                self._deliver(routed)
        self._close_all(self._conn.closed or "the daemon closed the connection")


@contextlib.asynccontextmanager
async def connect(socket: Path | None = None, *, tcp: tuple[str, int] | None = None,
                  token: str | None = None) -> AsyncIterator[Client]:
    """Connect to the daemon (Unix socket by default). Raises DaemonUnavailableError."""
    path = socket or paths.socket_path()
    try:
        if tcp is not None:
            stream: anyio.abc.ByteStream = await anyio.connect_tcp(*tcp)
        else:
            stream = await anyio.connect_unix(path)
    except OSError as exc:
        where = f"{tcp[0]}:{tcp[1]}" if tcp else str(path)
        raise DaemonUnavailableError(f"no daemon at {where} ({exc.strerror or exc})") from None
    client = Client(stream)
    with unwrap_groups():
        async with stream, anyio.create_task_group() as tg:
            if token is not None:
                await client._send(Auth(token))
            tg.start_soon(client._read)
            try:
                yield client
            finally:
                wake_reader(stream)  # EOF rather than cancelling the read (anyio#1267)
