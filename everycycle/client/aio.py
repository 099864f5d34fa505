"""The async client over the daemon's socket (and the base the embedded client shares).

``connect`` talks to a running daemon; ``embedded.embedded`` runs the same Supervisor
in this process, so a request gets the same events either way. Routing and the
request lifecycle are the sans-IO ``ClientConnection``'s; this module only moves
bytes and hands each request its events.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from .. import paths
from ..errors import DaemonUnavailableError, EverycycleError, RequestFailedError, unwrap_groups
from ..mailbox import Mailbox
from ..protocol import (
    Auth,
    Cancel,
    DescribeFleet,
    Done,
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
    is_terminal,
)
from ..sockets import wake_reader
from .connection import ClientConnection, Routed, new_request_id

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

    async def _one(self, request: Request) -> ServerEvent:
        last: ServerEvent | None = None
        async for event in self.request(request):
            last = event
        assert last is not None
        if isinstance(last, Error):
            raise RequestFailedError(last.message, kind=last.kind, request_id=last.request_id)
        return last

    def generate(self, model: str, prompt: str | None = None, *,
                 messages: tuple[Message, ...] | None = None, request_id: str | None = None,
                 **options: Any) -> AsyncIterator[ServerEvent]:
        """Events of a Generate request (see protocol.Generate for ``options``)."""
        req = Generate(request_id=request_id or new_request_id(), model=model, prompt=prompt,
                       messages=messages, **options)
        return self.request(req)

    async def embed(self, model: str, texts: Sequence[str], **options: Any
              ) -> list[tuple[float, ...]]:
        """One normalized vector per text, in order. Raises RequestFailedError."""
        event = await self._one(Embed(new_request_id(), model, tuple(texts), **options))
        assert isinstance(event, Embeddings)
        return list(event.vectors)

    async def describe_fleet(self) -> FleetSnapshot:
        """The daemon's FleetSnapshot. Raises RequestFailedError."""
        event = await self._one(DescribeFleet(new_request_id()))
        assert isinstance(event, FleetDescription)
        return event.snapshot

    async def cancel(self, target: str) -> None:
        """Cancel request ``target``. Raises RequestFailedError (Invalid if not active)."""
        await self._one(Cancel(new_request_id(), target))

    async def cancel_if_active(self, target: str) -> None:
        """Cancel ``target`` if it is still running; never raises.

        The request may end on its own just before the cancel arrives (Ctrl-C as the
        last token streams, a reader closing the pipe): the daemon's "no active
        request" answer, or a connection already gone, is then the expected outcome.
        """
        with contextlib.suppress(EverycycleError):
            await self.cancel(target)

    async def load(self, model: str, executor: str | None = None, *,
                   keep_alive_ms: int | None = None) -> None:
        """Make ``model`` resident. Raises RequestFailedError."""
        event = await self._one(Load(new_request_id(), model, executor, keep_alive_ms))
        assert isinstance(event, Done)

    async def unload(self, model: str) -> None:
        """Release ``model``. Raises RequestFailedError."""
        await self._one(Unload(new_request_id(), model))

    async def shutdown(self) -> None:
        """Ask the daemon to stop gracefully. Raises RequestFailedError."""
        await self._one(Shutdown(new_request_id()))


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
