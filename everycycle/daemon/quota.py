"""Rate limits per principal: token buckets refilled continuously.

A bucket holds at most one minute's worth (its capacity) and refills at the
configured rate per minute, so over any window of T seconds it grants at most
``capacity + rate * T``. Requests and prompt bytes are taken all-or-nothing at
admission. Generated tokens cannot be known in advance: they are charged as they
stream, which may take a bucket below zero (a running request is never cut), and a
new request is admitted only while the bucket holds at least one token; so a burst
is bounded by the capacity plus what the requests admitted at that moment generate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RejectedError
from .keys import KeyLimits, Principal


@dataclass(slots=True)
class TokenBucket:
    rate: float
    """Units per second."""
    capacity: float
    level: float
    updated: float

    @classmethod
    def per_minute(cls, amount: float, now: float) -> TokenBucket:
        return cls(rate=amount / 60.0, capacity=float(amount), level=float(amount), updated=now)

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (0: now; inf: never, it exceeds the capacity)."""
        if amount > self.capacity:
            return math.inf
        self._refill(now)
        if self.level >= amount:
            return 0.0
        return (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        """Take ``amount`` whether or not it is there (the level may go below zero)."""
        self._refill(now)
        self.level -= amount


def _per_minute(value: float, unit: str) -> str:
    return f"{value:g} {unit} per minute"


@dataclass(slots=True)
class _Buckets:
    limits: KeyLimits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    prompt_bytes: TokenBucket | None


class Quotas:
    """Every principal's buckets, one set per lane (``interactive``, ``background``): a
    key's batch work never spends what its person at a terminal may use. The supervisor
    asks before admitting a request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Buckets] = {}

    def _for(self, principal: Principal, lane: str, now: float) -> _Buckets:
        limits = principal.limits
        found = self._buckets.get((principal.name, lane))
        if found is None or found.limits != limits:  # new, or its limits were changed
            def bucket(amount: float | None) -> TokenBucket | None:
                return None if amount is None else TokenBucket.per_minute(amount, now)

            found = _Buckets(limits, bucket(limits.requests_per_minute),
                             bucket(limits.tokens_per_minute),
                             bucket(limits.prompt_bytes_per_minute))
            self._buckets[(principal.name, lane)] = found
        return found

    def admit(self, principal: Principal, lane: str = "interactive", *, prompt_bytes: int,
              inflight: int) -> None:
        """Count one request of ``principal`` in ``lane`` or raise RejectedError naming
        the limit.

        ``inflight``: its requests in that lane already running or queued.
        """
        limits = principal.limits
        who = f"key '{principal.name}'" + (" (background lane)" if lane == "background"
                                           else "")
        if limits.concurrent is not None and inflight >= limits.concurrent:
            raise RejectedError(
                f"{who} has {inflight} requests in flight, its limit; "
                "retry when one finishes", limit="concurrent", retry_after=1.0)
        now = self._clock()
        state = self._for(principal, lane, now)
        waits: list[tuple[float, str]] = []
        if state.tokens is not None:
            waits.append((state.tokens.wait(1, now), "tokens_per_minute"))
        if state.requests is not None:
            waits.append((state.requests.wait(1, now), "requests_per_minute"))
        if state.prompt_bytes is not None:
            wait = state.prompt_bytes.wait(prompt_bytes, now)
            if math.isinf(wait):
                raise RejectedError(
                    f"{who} may send {_per_minute(state.prompt_bytes.capacity, 'prompt bytes')}"
                    f"; this prompt is {prompt_bytes} bytes", limit="prompt_bytes_per_minute")
            waits.append((wait, "prompt_bytes_per_minute"))
        wait, limit = max(waits, default=(0.0, ""))
        if wait > 0:
            words = {"tokens_per_minute": (limits.tokens_per_minute, "generated tokens"),
                     "requests_per_minute": (limits.requests_per_minute, "requests"),
                     "prompt_bytes_per_minute": (limits.prompt_bytes_per_minute,
                                                 "prompt bytes")}
            value, unit = words[limit]
            assert value is not None
            raise RejectedError(
                f"{who} is over its limit of {_per_minute(value, unit)}; "
                f"retry in {math.ceil(wait * 10) / 10:g} s", limit=limit, retry_after=wait)
        if state.requests is not None:
            state.requests.take(1, now)
        if state.prompt_bytes is not None:
            state.prompt_bytes.take(prompt_bytes, now)

    def generated(self, principal: Principal, n: int, lane: str = "interactive") -> None:
        """Charge ``n`` streamed tokens to ``principal``'s ``lane``."""
        if principal.limits.tokens_per_minute is None or n <= 0:
            return
        now = self._clock()
        state = self._for(principal, lane, now)
        assert state.tokens is not None
        state.tokens.take(n, now)
