"""Hub URLs a request names (``hf://…``), pulled by the daemon the first time: one pull
a URL at a time, each told on the event bus."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.to_thread

from ..errors import EverycycleError
from ..models import manage
from ..models.registry import Registry
from .events import DaemonEvent, PullProgress


class Pulls:
    """``resolve`` pulls a hub URL and returns its registry name (None: no pulls, as
    with ``--models``)."""

    def __init__(self, resolve: Callable[[str], str] | None,
                 publish: Callable[[DaemonEvent], None]) -> None:
        self.resolve = resolve
        self._publish = publish
        self._locks: dict[str, anyio.Lock] = {}

    def may_pull(self, name: str) -> bool:
        return self.resolve is not None and manage.is_hub_url(name)

    async def pulled(self, name: str, allow_load: bool, registry: Callable[[], Registry]
                     ) -> str:
        """``name``, or a hub URL's registry name once pulled (where loads are allowed)."""
        if self.resolve is None or not allow_load or not manage.is_hub_url(name):
            return name
        async with self._locks.setdefault(name, anyio.Lock()):
            if (known := manage.recorded(name, registry())) is not None:
                return known
            self._publish(PullProgress(model=name, status="pulling"))
            try:
                found = await anyio.to_thread.run_sync(self.resolve, name)
            except EverycycleError as exc:
                self._publish(PullProgress(model=name, status="failed", message=exc.message))
                raise
            self._publish(PullProgress(model=name, status="done"))
            return found
