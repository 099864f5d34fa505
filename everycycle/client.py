"""Clients: async over the daemon's socket, and embedded (in-process).

All three speak the protocol's request and event objects. ``connect`` talks to a
running daemon; ``embedded`` runs the same Supervisor in this process, so a request
gets the same events either way. Neither imports llama_cpp until a model loads.
``syncclient.SyncClient`` is the blocking equivalent for programs without a loop.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from . import paths
from .errors import DaemonUnavailableError, ProtocolError, RequestFailedError
from .protocol import (
    Auth,
    Cancel,
    DescribeFleet,
    Done,
    Error,
    FleetDescription,
    FleetSnapshot,
    Generate,
    LineFramer,
    Load,
    Request,
    ServerEvent,
    Shutdown,
    Unload,
    decode_event,
    encode,
    is_terminal,
)
from .sockets import wake_reader

__all__ = ["BaseClient", "Client", "EmbeddedClient", "connect", "embedded", "new_request_id"]


def new_request_id() -> str:
    """A fresh RequestId (UUID4 hex)."""
    return uuid.uuid4().hex


class BaseClient:
    """Routes events to the request that awaits them; subclasses deliver requests."""

    def __init__(self) -> None:
        self._streams: dict[str, MemoryObjectSendStream[ServerEvent]] = {}
        self._fleet: deque[str] = deque()
        self._closed: str | None = None

    async def _send(self, request: Request) -> None:
        raise NotImplementedError

    def _route(self, event: ServerEvent) -> None:
        rid = "" if isinstance(event, FleetDescription) else event.request_id
        if isinstance(event, FleetDescription) and self._fleet:
            rid = self._fleet.popleft()
        elif isinstance(event, Error) and not rid and len(self._streams) == 1:
            rid = next(iter(self._streams))  # an error the daemon could not attribute
        stream = self._streams.get(rid)
        if stream is None:
            return
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            stream.send_nowait(event)
        if is_terminal(event):
            self._streams.pop(rid, None)
            stream.close()

    def _close_all(self, reason: str) -> None:
        self._closed = reason
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    async def request(self, request: Request) -> AsyncIterator[ServerEvent]:
        """Send ``request`` and yield its events up to and including the terminal one.

        Raises DaemonUnavailableError if the connection ends first.
        """
        if self._closed is not None:
            raise DaemonUnavailableError(self._closed)
        rid = getattr(request, "request_id", "")
        send, recv = anyio.create_memory_object_stream[ServerEvent](math.inf)
        self._streams[rid] = send
        if isinstance(request, DescribeFleet):
            self._fleet.append(rid)
        try:
            await self._send(request)
            async with recv:
                async for event in recv:
                    yield event
                    if is_terminal(event):
                        return
            raise DaemonUnavailableError(self._closed or "the daemon closed the connection")
        finally:
            self._streams.pop(rid, None)

    async def _one(self, request: Request) -> ServerEvent:
        last: ServerEvent | None = None
        async for event in self.request(request):
            last = event
        assert last is not None
        if isinstance(last, Error):
            raise RequestFailedError(last.message, kind=last.kind, request_id=last.request_id)
        return last

    def generate(self, model: str, prompt: str, *, request_id: str | None = None,
                 **options: Any) -> AsyncIterator[ServerEvent]:
        """Events of a Generate request (see protocol.Generate for ``options``)."""
        req = Generate(request_id=request_id or new_request_id(), model=model, prompt=prompt,
                       **options)
        return self.request(req)

    async def describe_fleet(self) -> FleetSnapshot:
        """The daemon's FleetSnapshot. Raises RequestFailedError."""
        event = await self._one(DescribeFleet(new_request_id()))
        assert isinstance(event, FleetDescription)
        return event.snapshot

    async def cancel(self, target: str) -> None:
        """Cancel request ``target``. Raises RequestFailedError (Invalid if not active)."""
        await self._one(Cancel(new_request_id(), target))

    async def load(self, model: str, executor: str | None = None) -> None:
        """Make ``model`` resident. Raises RequestFailedError."""
        event = await self._one(Load(new_request_id(), model, executor))
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
        try:
            async with self._lock:
                await self._stream.send(encode(request))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise DaemonUnavailableError(f"lost the daemon: {exc}") from None

    async def _read(self) -> None:
        framer = LineFramer()
        try:
            while True:
                data = await self._stream.receive(65536)
                for line in framer.feed(data):
                    try:
                        self._route(decode_event(line))
                    except ProtocolError:
                        continue
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                OSError, ProtocolError):
            pass
        self._close_all("the daemon closed the connection")


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
    async with stream, anyio.create_task_group() as tg:
        if token is not None:
            await client._send(Auth(token))
        tg.start_soon(client._read)
        try:
            yield client
        finally:
            wake_reader(stream)  # EOF rather than cancelling the read (anyio#1267)


class _EmbeddedPeer:
    allow_paths = True

    def __init__(self, client: BaseClient) -> None:
        self.id = 0
        self._client = client

    def emit(self, event: ServerEvent) -> None:
        self._client._route(event)


class EmbeddedClient(BaseClient):
    """The client interface over an in-process Supervisor (no daemon)."""

    def __init__(self, tg: anyio.abc.TaskGroup, supervisor: Any) -> None:
        super().__init__()
        self._tg = tg
        self._supervisor = supervisor
        self._peer = _EmbeddedPeer(self)

    async def _send(self, request: Request) -> None:
        self._tg.start_soon(self._supervisor.handle, self._peer, request)

    def disconnect(self) -> None:
        self._supervisor.disconnect(self._peer)


@contextlib.asynccontextmanager
async def embedded(models_file: Path | None = None) -> AsyncIterator[EmbeddedClient]:
    """Run a Supervisor in this process and yield a client for it. Raises ConfigError."""
    from .registry import load_registry
    from .supervisor import Supervisor

    supervisor = Supervisor(load_registry(models_file))
    async with anyio.create_task_group() as tg:
        await tg.start(supervisor.run)
        client = EmbeddedClient(tg, supervisor)
        try:
            yield client
        finally:
            tg.cancel_scope.cancel()
