"""Hand items from decode threads to the event loop: one wake-up per burst, no thread hop.

A decode step's outputs must reach the event loop within the step, and cheaply: on a
small model a step takes well under a millisecond. Waiting in a worker thread for a
queue (``anyio.to_thread.run_sync(queue.get)``) costs two thread switches per step;
here a producer appends to a deque and writes one byte to a socket pair only when the
consumer is not already due to wake, and the consumer drains everything queued since
its last wake-up at once.
"""

from __future__ import annotations

import contextlib
import socket
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class Handoff(Generic[T]):
    """``put`` from any thread; ``drain`` on the event loop calls ``deliver`` for each
    item, in order, for as long as it runs (it owns the wake-up sockets)."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._writer: socket.socket | None = None
        # True from a producer's wake-up byte until the consumer has read it. Set and
        # cleared under the GIL (single stores); the consumer clears it *before* it
        # drains, so whatever a producer appended before seeing it set is drained in
        # that pass: no wake-up is ever missed.
        self._due = False

    def put(self, item: T) -> None:
        """Queue ``item`` (any thread; never blocks)."""
        self._items.append(item)
        if not self._due:
            self._due = True
            writer = self._writer
            # A full buffer (BlockingIOError) already holds a wake-up; a closed one
            # (OSError) means the consumer has gone.
            if writer is not None:
                with contextlib.suppress(OSError):
                    writer.send(b"\0")

    async def drain(self, deliver: Callable[[T], None]) -> None:
        """Deliver items as they come until cancelled (runs on the event loop)."""
        reader, writer = socket.socketpair()
        try:
            reader.setblocking(False)
            writer.setblocking(False)
            self._writer = writer
            while True:
                self._due = False
                while self._items:
                    deliver(self._items.popleft())
                await anyio.wait_readable(reader)
                with contextlib.suppress(BlockingIOError):
                    reader.recv(4096)
        finally:
            self._writer = None
            reader.close()
            writer.close()
