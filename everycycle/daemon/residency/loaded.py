"""A model loaded on an executor (its engine and how it got there), and a load under
way: what the residency holds, and what making room (room.py) reads of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from ...engine.host.contract import Engine, LoadOptions
from ...errors import EverycycleError
from ...hardware import executors as ex
from ...hardware.memory import MemoryPlan
from ...models.keepalive import DEFAULT_KEEP_ALIVE
from ...models.registry import ModelSpec


@dataclass(eq=False)
class Loading:
    """One load of a model under way, and what its waiters get: the model or the error."""

    spec: ModelSpec
    done: anyio.Event = field(default_factory=anyio.Event)
    model: Resident | None = None
    error: EverycycleError | None = None
    waiters: int = 0
    size: int | None = None
    """Bytes of weights it places, once planned."""
    starting: float | None = None
    """When its engine began to start (monotonic; None: downloading or making room)."""


@dataclass(eq=False)
class Resident:
    """A loaded model: its engine and how it got there."""

    spec: ModelSpec
    engine: Engine
    executor: str
    path: Path
    options: LoadOptions
    """How its engine was loaded (a restart loads it the same way)."""
    placement: ex.Placement | None = None
    keep_alive: float = DEFAULT_KEEP_ALIVE
    """Seconds it stays loaded once idle; negative: always."""
    last_used: float = field(default_factory=time.monotonic)
    """When it was loaded, or a request of it began or ended (monotonic)."""
    restarts: int = 0
    """Times its engine was started again after dying."""
    deaths: list[float] = field(default_factory=list)
    """When its engine died (monotonic), within the crash window."""
    last_exit: str | None = None
    """How its engine last died: ``SIGILL (illegal instruction)``, ..."""
    failed: str | None = None
    """Set after a crash loop: why its requests are refused until ``load``."""
    up: anyio.Event | None = None
    """Set while its engine restarts: waiters wait for it."""
    need: MemoryPlan | None = None
    """What it was placed by (what it is counted as holding)."""
    loaded: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def remote(self) -> str | None:
        """The RPC endpoint it runs on, if any."""
        return self.placement.executor.remote if self.placement else None

    @property
    def serving(self) -> bool:
        return self.failed is None and self.up is None and self.engine.dead is None

    def touch(self, keep_alive_ms: int | None = None) -> None:
        """A request uses it now; its keep_alive, if any, holds from now on."""
        self.last_used = time.monotonic()
        if keep_alive_ms is not None:
            self.keep_alive = -1.0 if keep_alive_ms < 0 else keep_alive_ms / 1000
