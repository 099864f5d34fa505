"""Whether the daemon takes new work, as routers, load balancers and ``fleet`` ask:
``ready``; ``loading`` while no model serves and one loads (llama-server's 503 "Loading
model"); ``draining`` once a Shutdown with ``drain_ms`` (``everycycle drain``, SIGTERM)
came: after the notice (``--drain-notice``: seconds it still admits work while its
503s tell routers to stop sending it any) nothing new is admitted, running and queued
requests finish within the grace, then the daemon stops."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import anyio

from .events import DaemonDraining, DaemonEvent
from .lifecycle import Requests
from .residency import Residency

log = logging.getLogger(__name__)

READY, LOADING, DRAINING = "ready", "loading", "draining"

RETRY_AFTER_MAX_S = 5
"""The longest Retry-After a refusal while draining advises: a router retries elsewhere
at once; a client with only this address finds the daemon's successor soon."""


class Readiness:
    """The daemon's state for admission and health checks; ``drain`` runs a drain."""

    def __init__(self, residency: Residency, requests: Requests,
                 publish: Callable[[DaemonEvent], None]) -> None:
        self._residency = residency
        self._requests = requests
        self._publish = publish
        self.drain_ends: float | None = None
        """When the drain's grace ends (monotonic); None: not draining."""
        self.notice_s = 0.0
        """Seconds a drain still admits work, while /health says 503 (a router's health
        checks take it out of rotation meanwhile; routes it does not retry lose nothing)."""
        self.refuse_from: float | None = None
        """When a drain starts refusing work (monotonic); None: not draining."""
        self.preloading = 0
        """``--load`` models not yet loaded (or failed): ``loading`` until one serves."""

    @property
    def draining(self) -> bool:
        return self.drain_ends is not None

    @property
    def refusing(self) -> bool:
        """Draining and past the notice: new work is refused."""
        return self.refuse_from is not None and time.monotonic() >= self.refuse_from

    def state(self) -> str:
        if self.draining:
            return DRAINING
        residency = self._residency
        if (residency.loading or self.preloading) and not any(m.serving for m in residency.models.values()):
            return LOADING
        return READY

    def retry_after(self) -> int:
        """Whole seconds a refused client should wait (1 to RETRY_AFTER_MAX_S)."""
        left = (self.drain_ends or 0.0) - time.monotonic()
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(left)))

    def refusal(self) -> str:
        return "the daemon is draining: it takes no new requests and stops once its " \
            "work is done; send this to another"

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting, and return once every active request has ended (True) or the
        grace has passed (False: the caller cancels what is left). A second drain keeps
        the earlier end."""
        now = time.monotonic()
        first = self.drain_ends is None
        ends = now + self.notice_s + grace_s
        self.drain_ends = ends if first else min(self.drain_ends or ends, ends)
        if first:
            self.refuse_from = now + self.notice_s
        requests = self._requests
        log.info("draining: new requests %s; stopping once the active end (at most %g s)",
                 f"admitted for {self.notice_s:g} s more" if self.notice_s and first else
                 "refused", self.notice_s + grace_s)
        self._publish(DaemonDraining(grace_s=grace_s, active=len(requests.active)))
        if self.refuse_from is not None and self.refuse_from > now:
            await anyio.sleep(self.refuse_from - now)
        while requests.active:
            left = (self.drain_ends or 0.0) - time.monotonic()
            if left <= 0:
                return False
            requests.all_ended = ended = anyio.Event()
            with anyio.move_on_after(left):
                await ended.wait()
        return True
