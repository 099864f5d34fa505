"""Hand items from decode threads to the event loop: one wake-up per burst, no thread hop.

A decode step's outputs must reach the event loop within the step, and cheaply: on a
small model a step takes well under a millisecond. Waiting in a worker thread for a
queue (``anyio.to_thread.run_sync(queue.get)``) costs two thread switches per step.
Here a producer appends to a deque and, only when the consumer is not already due to
run, asks the event loop to run it soon (asyncio's ``call_soon_threadsafe``: a write
to the loop's own wake-up pipe); the consumer then delivers
everything queued since it last ran, in one go. A producer on the event loop itself
(an engine process's pipe, read there) delivers at once: no wake-up at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


def _run_soon_from_threads() -> Callable[[Callable[[], None]], object]:
    """The running asyncio loop's thread-safe "call this soon" (the daemon and the
    clients run on anyio's asyncio backend)."""
    return asyncio.get_running_loop().call_soon_threadsafe


class Handoff(Generic[T]):
    """``put`` from any thread; while ``serve`` runs, the event loop calls ``deliver``
    for each item, in order."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._schedule: Callable[[Callable[[], None]], object] | None = None
        self._deliver: Callable[[T], None] | None = None
        # True from a producer's request to run until the consumer runs. Set and
        # cleared under the GIL (single stores); the consumer clears it *before* it
        # drains, so whatever a producer appended before seeing it set is drained in
        # that pass: no wake-up is ever missed.
        self._due = False
        self._loop_thread: int | None = None

    def put(self, item: T) -> None:
        """Queue ``item`` (any thread; never blocks). On the event loop's own thread,
        deliver it now (after anything queued before it)."""
        self._items.append(item)
        if threading.get_ident() == self._loop_thread:
            self._drain()
            return
        if not self._due:
            self._due = True
            schedule = self._schedule
            if schedule is not None:
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    schedule(self._drain)

    def _drain(self) -> None:
        self._due = False
        deliver = self._deliver
        while self._items and deliver is not None:
            deliver(self._items.popleft())

    async def serve(self, deliver: Callable[[T], None]) -> None:
        """Deliver items as they come until cancelled (runs on the event loop)."""
        self._deliver = deliver
        self._schedule = _run_soon_from_threads()
        self._loop_thread = threading.get_ident()
        try:
            self._drain()  # anything queued before serving began
            await anyio.sleep_forever()
        finally:
            self._schedule = self._deliver = None
            self._loop_thread = None
