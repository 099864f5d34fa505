"""Helpers to run the real daemon in-process and talk raw protocol to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc

from everycycle import paths
from everycycle.daemon import Daemon, DaemonConfig
from everycycle.protocol import LineFramer, ServerEvent, decode_event, is_terminal
from everycycle.sockets import wake_reader

TIMEOUT = 30


@contextlib.asynccontextmanager
async def running_daemon(models_file: Path, **kw: object) -> AsyncIterator[Daemon]:
    """A real daemon on a real Unix socket; stopped by cancelling on exit."""
    config = DaemonConfig(socket=paths.socket_path(), models_file=models_file, **kw)  # type: ignore[arg-type]
    daemon = Daemon(config)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        try:
            yield daemon
        finally:
            daemon.stop()  # a graceful stop, as SIGTERM does


class Raw:
    """A raw socket connection: send bytes, read decoded events."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.framer = LineFramer()
        self.buffer: list[ServerEvent] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, sock: Path | None = None) -> AsyncIterator[Raw]:
        stream = await anyio.connect_unix(sock or paths.socket_path())
        async with stream:
            try:
                yield cls(stream)
            finally:
                wake_reader(stream)

    async def send(self, line: bytes) -> None:
        await self.stream.send(line if line.endswith(b"\n") else line + b"\n")

    async def next(self) -> ServerEvent:
        with anyio.fail_after(TIMEOUT):
            while not self.buffer:
                data = await self.stream.receive(65536)
                self.buffer.extend(decode_event(line) for line in self.framer.feed(data))
        return self.buffer.pop(0)

    async def until_terminal(self, rid: str) -> list[ServerEvent]:
        """Events for ``rid`` up to its terminal one (others stay buffered in order)."""
        got: list[ServerEvent] = []
        others: list[ServerEvent] = []
        with anyio.fail_after(TIMEOUT):
            while True:
                ev = await self.next()
                if getattr(ev, "request_id", None) == rid:
                    got.append(ev)
                    if is_terminal(ev):
                        break
                else:
                    others.append(ev)
        self.buffer[:0] = others
        return got

    async def closed(self) -> bool:
        with anyio.fail_after(TIMEOUT):
            try:
                while True:
                    data = await self.stream.receive()
                    self.buffer.extend(decode_event(line) for line in self.framer.feed(data))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return True
