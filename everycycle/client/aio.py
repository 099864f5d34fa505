"""The async client over the daemon's socket (and the base the embedded client shares).

``connect`` talks to a running daemon; ``embedded.embedded`` runs the same Supervisor
in this process, so a request gets the same events either way. Routing and the
request lifecycle are the sans-IO ``ClientConnection``'s; this module only moves
bytes and hands each request its events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import anyio

from .. import paths
from ..errors import DaemonUnavailableError, EverycycleError
from ..mailbox import Mailbox
from ..protocol import Auth, Message, Request, ServerEvent, is_terminal
from . import calls
from .connection import ClientConnection, Routed

T = TypeVar("T")

__all__ = ["BaseClient", "Client", "connect"]

READ_BUFFER_BYTES = 1 << 16


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
    rerank = calls.awaiting(calls.rerank)
    describe_fleet = calls.awaiting(calls.describe_fleet)
    cancel = calls.awaiting(calls.cancel)
    cancel_if_active = calls.awaiting(calls.cancel_if_active)
    load = calls.awaiting(calls.load)
    unload = calls.awaiting(calls.unload)
    shutdown = calls.awaiting(calls.shutdown)
    list_tools = calls.awaiting(calls.list_tools)
    run_tool = calls.awaiting(calls.run_tool)


class _Wire(asyncio.BufferedProtocol):
    """The connection's asyncio protocol: bytes in are routed as they arrive (no reader
    task, and no reader registered and removed for every read, as a raw-socket stream
    does: on the per-token path those cost more than decoding the line). Reads go into
    one buffer: a plain Protocol gets a fresh 256 KiB bytes per read, which the
    allocator maps and unmaps each time (half of a wake-up's cost)."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._buffer = bytearray(READ_BUFFER_BYTES)
        self._view = memoryview(self._buffer)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        self._client._received(self._buffer[:nbytes])

    def eof_received(self) -> bool:
        self._client._ended("the daemon closed the connection")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._client._ended(f"lost the daemon: {exc}" if exc is not None
                            else "the daemon closed the connection")

    def pause_writing(self) -> None:
        self._client._writable.clear()

    def resume_writing(self) -> None:
        self._client._writable.set()


class Client(BaseClient):
    """A connection to a running daemon; use ``async with connect(...) as client``."""

    def __init__(self) -> None:
        super().__init__()
        self._transport: asyncio.Transport | None = None
        self._writable = asyncio.Event()
        self._writable.set()

    async def _send(self, request: Request) -> None:
        from ..protocol import encode

        transport = self._transport
        if transport is None or transport.is_closing() or self._conn.closed is not None:
            reason = self._conn.closed or "the connection closed"
            raise DaemonUnavailableError(reason)
        transport.write(encode(request))
        await self._writable.wait()  # (the daemon reads requests as they come)

    def _received(self, data: bytes | bytearray) -> None:
        for routed in self._conn.receive_data(data):
            self._deliver(routed)
        if self._conn.closed is not None:  # an invalid line: the stream is not trusted
            self._ended(self._conn.closed)

    def _ended(self, reason: str) -> None:
        if self._transport is not None:
            self._transport.close()
        self._writable.set()
        self._close_all(self._conn.closed or reason)


@contextlib.asynccontextmanager
async def connect(socket: Path | None = None, *, tcp: tuple[str, int] | None = None,
                  token: str | None = None) -> AsyncIterator[Client]:
    """Connect to the daemon (Unix socket by default). Raises DaemonUnavailableError."""
    path = socket or paths.socket_path()
    client = Client()
    loop = asyncio.get_running_loop()
    try:
        if tcp is not None:
            transport, _ = await loop.create_connection(lambda: _Wire(client), *tcp)
        else:
            transport, _ = await loop.create_unix_connection(lambda: _Wire(client), str(path))
    except OSError as exc:
        where = f"{tcp[0]}:{tcp[1]}" if tcp else str(path)
        raise DaemonUnavailableError(f"no daemon at {where} ({exc.strerror or exc})") from None
    assert isinstance(transport, asyncio.Transport)
    client._transport = transport
    try:
        if token is not None:
            await client._send(Auth(token))
        yield client
    finally:
        client._ended("the client closed the connection")
