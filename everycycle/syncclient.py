"""A blocking client over the daemon's Unix socket: plain sockets, no event loop.

For programs without an event loop and for the CLI's one-shot commands, which must
start fast (no asyncio import). One request at a time per client.
"""

from __future__ import annotations

import socket as pysocket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from . import paths
from .errors import DaemonUnavailableError, RequestFailedError
from .protocol import (
    Cancel,
    DescribeFleet,
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


def _rid() -> str:
    import uuid

    return uuid.uuid4().hex


class SyncClient:
    """``with SyncClient() as c: print(c.describe_fleet())``. Raises DaemonUnavailableError."""

    def __init__(self, socket: Path | None = None, *, timeout: float | None = None) -> None:
        self.path = socket or paths.socket_path()
        self._timeout = timeout
        self._sock: pysocket.socket | None = None
        self._framer = LineFramer()
        self._pending: list[bytes] = []

    def __enter__(self) -> Self:
        sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        sock.settimeout(self._timeout)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise DaemonUnavailableError(
                f"no daemon at {self.path} ({exc.strerror or exc})"
            ) from None
        self._sock = sock
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _next_event(self) -> ServerEvent:
        assert self._sock is not None
        while not self._pending:
            try:
                data = self._sock.recv(65536)
            except OSError as exc:
                raise DaemonUnavailableError(f"lost the daemon: {exc}") from None
            if not data:
                raise DaemonUnavailableError("the daemon closed the connection")
            self._pending.extend(self._framer.feed(data))
        return decode_event(self._pending.pop(0))

    def request(self, request: Request) -> Iterator[ServerEvent]:
        """Send ``request``; yield its events through the terminal one."""
        if self._sock is None:
            raise DaemonUnavailableError("not connected (use `with SyncClient() as c`)")
        rid = getattr(request, "request_id", "")
        try:
            self._sock.sendall(encode(request))
        except OSError as exc:
            raise DaemonUnavailableError(f"lost the daemon: {exc}") from None
        while True:
            event = self._next_event()
            mine = isinstance(event, FleetDescription) or event.request_id in (rid, "")
            if not mine:
                continue
            yield event
            if is_terminal(event):
                return

    def _one(self, request: Request) -> ServerEvent:
        last = list(self.request(request))[-1]
        if isinstance(last, Error):
            raise RequestFailedError(last.message, kind=last.kind, request_id=last.request_id)
        return last

    def generate(self, model: str, prompt: str, **options: Any) -> Iterator[ServerEvent]:
        """Events of a Generate request (see protocol.Generate for ``options``)."""
        return self.request(Generate(_rid(), model, prompt, **options))

    def describe_fleet(self) -> FleetSnapshot:
        event = self._one(DescribeFleet(_rid()))
        assert isinstance(event, FleetDescription)
        return event.snapshot

    def cancel(self, target: str) -> None:
        self._one(Cancel(_rid(), target))

    def load(self, model: str, executor: str | None = None) -> None:
        self._one(Load(_rid(), model, executor))

    def unload(self, model: str) -> None:
        self._one(Unload(_rid(), model))

    def shutdown(self) -> None:
        self._one(Shutdown(_rid()))
