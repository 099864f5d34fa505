"""An unbounded single-consumer queue on one event loop, for per-token traffic.

anyio's memory object streams do a lot per item (task bookkeeping on every receive);
a stream of tokens puts one item per decode step per request, so the daemon's
connections, the HTTP handlers and the client's requests use this instead: ``put``
never blocks, and ``take`` hands the consumer everything queued since it last looked.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")

__all__ = ["Mailbox"]


class Mailbox(Generic[T]):
    """``put`` from the event loop (any task); one consumer ``take``s. ``close`` ends it:
    what was queued is still taken, then ``take`` raises anyio.EndOfStream."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: anyio.Event | None = None
        self.closed = False

    def __bool__(self) -> bool:
        """Whether anything is queued."""
        return bool(self._items)

    def put(self, item: T) -> bool:
        """Queue ``item``; False (and nothing queued) once closed."""
        if self.closed:
            return False
        self._items.append(item)
        self._wake()
        return True

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    async def take(self) -> list[T]:
        """Everything queued (at least one item), oldest first; waits while empty.
        Raises anyio.EndOfStream once closed and empty."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while not self._items:
            if self.closed:
                raise anyio.EndOfStream
            self._waiter = waiter = anyio.Event()
            await waiter.wait()
        items = list(self._items)
        self._items.clear()
        return items
