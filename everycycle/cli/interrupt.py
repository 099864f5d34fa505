"""Ctrl-C while a request runs: cancel it on the daemon, and remember that it happened."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import anyio
import anyio.abc

if TYPE_CHECKING:
    from ..client.aio import BaseClient


class Interrupt:
    """Run ``watch`` in a task group beside a request; ``pressed`` tells the outcome apart
    from a cancel by someone else (exit 130 rather than 5)."""

    def __init__(self) -> None:
        self.pressed = False
        self.target = ""
        """The request a Ctrl-C cancels (the next one, after a tool round)."""

    async def watch(self, client: BaseClient, request_id: str, *,
                    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        """Until cancelled: each SIGINT cancels ``request_id`` (quietly if it just ended).
        Start it with ``tg.start``: it is listening once that returns, so a Ctrl-C while
        the model still loads cancels the request too."""
        self.target = request_id
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                self.pressed = True
                await client.cancel_if_active(self.target)
