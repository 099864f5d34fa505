"""The client interface over an in-process Supervisor: ``everycycle run`` with no daemon.

The one place a client reaches down into the daemon layer (lazily: llama_cpp and the
supervisor load only when this is used). Events the supervisor emits are routed by
the same ``ClientConnection`` rules as bytes from a socket.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from ..daemon.keys import LOCAL
from ..errors import unwrap_groups
from ..protocol import Request, ServerEvent
from .aio import BaseClient

if TYPE_CHECKING:
    from ..daemon.supervisor import Outcome, Supervisor

__all__ = ["EmbeddedClient", "embedded"]


class _EmbeddedPeer:
    """The supervisor's view of this client (a ``Peer``)."""

    allow_paths = True

    def __init__(self, client: EmbeddedClient) -> None:
        self._client = client
        self.principal = LOCAL

    def emit(self, event: ServerEvent, outcome: Outcome | None = None) -> None:
        """As over a socket, the terminal event says all a client learns."""
        self._client._deliver(self._client._conn.receive_event(event))


class EmbeddedClient(BaseClient):
    """The client interface over an in-process Supervisor (no daemon)."""

    def __init__(self, tg: anyio.abc.TaskGroup, supervisor: Supervisor) -> None:
        super().__init__()
        self._tg = tg
        self._supervisor = supervisor
        self._peer = _EmbeddedPeer(self)

    async def _send(self, request: Request) -> None:
        self._tg.start_soon(self._supervisor.handle, self._peer, request)

    def disconnect(self) -> None:
        """As a socket client disconnecting: cancel everything this client asked for."""
        self._supervisor.disconnect(self._peer)


@contextlib.asynccontextmanager
async def embedded(models_file: Path | None = None) -> AsyncIterator[EmbeddedClient]:
    """Run a Supervisor in this process and yield a client for it. Raises ConfigError."""
    from ..daemon.supervisor import Supervisor
    from ..models.registry import load_registry

    # In this process, as a library call would: no daemon to protect, and no engine
    # process to start (remote models still get one: ggml-rpc aborts its process).
    supervisor = Supervisor(load_registry(models_file), isolate=False)
    with unwrap_groups():
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            client = EmbeddedClient(tg, supervisor)
            try:
                yield client
            finally:
                tg.cancel_scope.cancel()
