"""The supervisor's task group and event loop while it runs, as one holder everything
that starts tasks (request deadlines, residency loads and restarts) or reads a pipe on
the loop (engine processes) shares."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import anyio.abc

from ..errors import RejectedError


class Tasks:
    """The supervisor's task group and event loop while it runs: one holder, shared by
    everything that starts tasks in it (the requests' deadlines, the residency's loads
    and restarts) or reads a pipe on the loop (engine processes)."""

    def __init__(self) -> None:
        self.group: anyio.abc.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, group: anyio.abc.TaskGroup | None) -> None:
        """The group to start tasks in (on its event loop); None once it has stopped."""
        self.group = group
        self._loop = asyncio.get_running_loop() if group is not None else None

    @property
    def running(self) -> bool:
        return self.group is not None

    def readable(self, fd: int, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` on the event loop whenever ``fd`` is readable, from now on
        (from any thread); returns what stops that (on the loop). Raises RejectedError
        once the group has stopped."""
        loop = self._loop
        if loop is None:
            raise RejectedError("daemon shutting down")
        loop.call_soon_threadsafe(loop.add_reader, fd, callback)

        def stop() -> None:
            loop.remove_reader(fd)

        return stop

    def start_soon(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start ``func(*args)`` in the group. Raises RejectedError once it has stopped."""
        if self.group is None:
            raise RejectedError("daemon shutting down")
        self.group.start_soon(func, *args)
