"""What the daemon does, told as it happens: typed events on one bus, and the one request
state machine whose transitions publish them.

A request moves through ``RequestState`` by what happens to it (``RequestInput``) only:
``MOVES`` is the whole table, and an input it lacks raises, as h11's state machine does. Residency publishes
models loaded and unloaded (and why), engines that die and restart, and loads that wait
for room. Outside subscribers — ``GET /v1/events`` (Server-Sent Events), the socket's
``Subscribe`` (``fleet --watch``) — read bounded queues: one that falls ``LIMIT`` events
behind is cut off with a last ``cut_off`` event, so a slow reader costs bounded memory
and never slows a decode step. Publishing never blocks and does no I/O.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import anyio

from ..errors import InternalError, InvalidRequestError
from ..mailbox import Mailbox
from ..protocol import Embed, Generate
from .outcome import Outcome

log = logging.getLogger(__name__)

LIMIT = 1024
"""Events a subscriber may fall behind before it is cut off."""


class RequestState(enum.Enum):
    ADMITTING = "admitting"
    WAITING = "waiting"
    """For room: its model gives way to a load that waited for the memory it holds."""
    LOADING = "loading"
    QUEUED = "queued"
    RUNNING = "running"
    PARKED = "parked"
    """A background request whose slot an interactive one took: it resumes where it
    stopped (its engine said so)."""
    FINISHED = "finished"


class RequestInput(enum.Enum):
    """What happens to a request: the inputs of its state machine."""

    GIVE_WAY = "give_way"
    """Its model gives way to a load waiting for room: it waits."""
    LOAD = "load"
    """It waits for its model to load."""
    ADMIT = "admit"
    """Its model is there: it is admitted (tokenized, given a slot or a place)."""
    QUEUE = "queue"
    START = "start"
    """It got a slot on its engine."""
    PARK = "park"
    """Its engine took its slot for an interactive request."""
    RESUME = "resume"
    """Its engine gave it a slot again."""
    FINISH = "finish"


_S, _I = RequestState, RequestInput
MOVES: dict[tuple[RequestState, RequestInput], RequestState] = {
    (_S.ADMITTING, _I.GIVE_WAY): _S.WAITING,
    (_S.WAITING, _I.GIVE_WAY): _S.WAITING,
    (_S.ADMITTING, _I.LOAD): _S.LOADING,
    (_S.WAITING, _I.LOAD): _S.LOADING,
    (_S.ADMITTING, _I.ADMIT): _S.ADMITTING,
    (_S.WAITING, _I.ADMIT): _S.ADMITTING,
    (_S.LOADING, _I.ADMIT): _S.ADMITTING,
    **{(state, _I.QUEUE): _S.QUEUED for state in (_S.ADMITTING, _S.WAITING, _S.LOADING)},
    **{(state, _I.START): _S.RUNNING
       for state in (_S.ADMITTING, _S.WAITING, _S.LOADING, _S.QUEUED)},
    (_S.RUNNING, _I.PARK): _S.PARKED,
    (_S.PARKED, _I.RESUME): _S.RUNNING,
    **{(state, _I.FINISH): _S.FINISHED for state in _S if state is not _S.FINISHED},
}
"""The whole request life: (state, what happened) → its next state; nothing else moves
a request, and an input the table lacks is a bug (``IllegalTransition``)."""

ON_ENGINE = frozenset({_S.RUNNING, _S.PARKED})
"""The states in which its engine holds it (a cancel goes to the engine)."""


class CancelCause(enum.Enum):
    """Why a request was cancelled: typed, so nothing has to read its message."""

    CLIENT = "client"
    """A Cancel for it (the socket's, the console's)."""
    DEADLINE = "deadline"
    DISCONNECT = "disconnect"
    """Its client went away."""
    UNLOAD = "unload"
    """Its model went (unloaded, evicted, idle, failed)."""
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A request's cancel: its cause, and what its client is told (the words users
    have always read)."""

    cause: CancelCause
    message: str

    @classmethod
    def by(cls, who: str) -> Cancelled:
        return cls(CancelCause.CLIENT, f"cancelled by {who}")

    @classmethod
    def deadline(cls, ms: int) -> Cancelled:
        return cls(CancelCause.DEADLINE, f"deadline of {ms} ms passed")

    @classmethod
    def disconnect(cls) -> Cancelled:
        return cls(CancelCause.DISCONNECT, "client disconnected")

    @classmethod
    def shutdown(cls) -> Cancelled:
        return cls(CancelCause.SHUTDOWN, "daemon shutting down")


class IllegalTransition(InternalError):
    """A request asked to move where the table does not go: a bug, said as one."""


def next_state(state: RequestState, happened: RequestInput) -> RequestState:
    """Where a request in ``state`` goes when ``happened``. Raises IllegalTransition
    where the table does not go."""
    new = MOVES.get((state, happened))
    if new is None:
        raise IllegalTransition(f"a request cannot {happened.value} while {state.value}")
    return new


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonEvent:
    """One thing that happened; ``wire`` is what subscribers read."""

    TYPE: ClassVar[str] = ""
    INTERNAL: ClassVar[bool] = False
    """Heard by the daemon's own listeners only (audit, metrics), never by subscribers."""
    at: float = field(default_factory=time.time)

    def wire(self) -> dict[str, Any]:
        """``{"type", "at", …fields}``, fields that are None left out."""
        return {"type": self.TYPE, **{k: v for k, v in asdict(self).items() if v is not None}}


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestStateChanged(DaemonEvent):
    TYPE: ClassVar[str] = "request"
    request_id: str
    model: str
    principal: str
    lane: str
    state: str
    position: int | None = None
    """Its queue position, while it waits."""
    eta_ms: int | None = None
    outcome: str | None = None
    """How it finished: ``finished`` (with ``finish_reason``) or an error kind."""
    finish_reason: str | None = None
    cause: str | None = None
    """Why it was cancelled (``CancelCause``), when it was."""
    usage: dict[str, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLoaded(DaemonEvent):
    TYPE: ClassVar[str] = "model_loaded"
    model: str
    executor: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelUnloaded(DaemonEvent):
    TYPE: ClassVar[str] = "model_unloaded"
    model: str
    why: str
    """``idle``, ``evicted``, ``unload``, ``shutdown``, ``crash``…, said as a sentence in
    ``message``."""
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelEvicted(DaemonEvent):
    TYPE: ClassVar[str] = "model_evicted"
    model: str
    for_model: str
    reason: str
    idle_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineDied(DaemonEvent):
    TYPE: ClassVar[str] = "engine_died"
    model: str
    cause: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRestarted(DaemonEvent):
    TYPE: ClassVar[str] = "engine_restarted"
    model: str
    restarts: int
    pid: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RoomWait(DaemonEvent):
    TYPE: ClassVar[str] = "room_wait"
    model: str
    waited_s: float
    outcome: str
    held_by: str | None = None
    """Who held the memory it waited for: ``'b' (300 MiB, busy)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PullProgress(DaemonEvent):
    """A download from a hub: ``pulling`` (``completed`` of ``total`` bytes), then
    ``done`` or ``failed`` (with ``message``)."""

    TYPE: ClassVar[str] = "pull"
    model: str
    status: str
    completed: int | None = None
    total: int | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyLimitHit(DaemonEvent):
    """A key's quota refused a request: which key, which limit, and when to try again."""

    TYPE: ClassVar[str] = "key_limit"
    principal: str
    limit: str
    model: str
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonDraining(DaemonEvent):
    """The daemon stopped taking new work: it stops once its ``active`` requests end,
    or when ``grace_s`` has passed (what is left then is cancelled)."""

    TYPE: ClassVar[str] = "draining"
    grace_s: float
    active: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestEnded(DaemonEvent):
    """A Generate or Embed request ended (or was refused before admission): how."""

    TYPE: ClassVar[str] = "request_ended"
    INTERNAL: ClassVar[bool] = True
    outcome: Outcome
    request: Generate | Embed


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthRefused(DaemonEvent):
    """A socket connection presented a key we do not know (or none, where one is needed)."""

    TYPE: ClassVar[str] = "auth_refused"
    INTERNAL: ClassVar[bool] = True
    outcome: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CutOff(DaemonEvent):
    TYPE: ClassVar[str] = "cut_off"
    dropped: int
    message: str


TYPES = {c.TYPE: c for c in (RequestStateChanged, ModelLoaded, ModelUnloaded, ModelEvicted,
                             EngineDied, EngineRestarted, RoomWait, PullProgress, KeyLimitHit,
                             DaemonDraining)}
"""What a subscriber may ask for by name (``cut_off`` always comes)."""


def types_of(names: Iterable[str] | None) -> frozenset[str] | None:
    """The event types a subscriber asked for (None: all). Raises InvalidRequestError
    naming one that does not exist."""
    if names is None:
        return None
    wanted = frozenset(n.strip() for n in names if n.strip())
    unknown = sorted(wanted - set(TYPES))
    if unknown:
        raise InvalidRequestError(f"no event type {', '.join(map(repr, unknown))} (types: "
                                  f"{', '.join(TYPES)})")
    return wanted or None


class Subscription:
    """One outside reader's events: ``box`` holds what it has not read yet."""

    def __init__(self, bus: Bus, types: frozenset[str] | None, limit: int) -> None:
        self.bus = bus
        self.types = types
        self.limit = limit
        self.box: Mailbox[DaemonEvent] = Mailbox()
        self.queued = 0

    def offer(self, event: DaemonEvent) -> None:
        if event.INTERNAL or (self.types is not None and event.TYPE not in self.types):
            return
        if self.queued >= self.limit:  # (it has read nothing for LIMIT events)
            self.box.put(CutOff(dropped=1, message=f"cut off: {self.limit} events unread"))
            self.close()
            return
        self.queued += 1
        self.box.put(event)

    async def next(self) -> list[DaemonEvent]:
        """What came since the last call (at least one event). Raises anyio.EndOfStream
        once it is closed and read."""
        events = await self.box.take()
        self.queued = max(0, self.queued - len(events))
        return events

    def close(self) -> None:
        self.bus.unsubscribe(self)
        self.box.close()


class Bus:
    """The daemon's events: ``publish`` from the event loop. Listeners (audit, metrics)
    are called at once, in order, before ``publish`` returns; subscribers read theirs
    from their own bounded queues."""

    def __init__(self) -> None:
        self._subs: list[Subscription] = []
        self._listeners: list[Callable[[DaemonEvent], None]] = []
        self._waiting: list[anyio.Event] = []
        self.published = 0

    def listen(self, listener: Callable[[DaemonEvent], None]) -> None:
        """Call ``listener`` with every event as it is published (it must not block)."""
        self._listeners.append(listener)

    def publish(self, event: DaemonEvent) -> None:
        self.published += 1
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not cost the request
                log.exception("event listener failed on %s", event.TYPE)
        for sub in list(self._subs):
            sub.offer(event)
        woken, self._waiting = self._waiting, []
        for waiter in woken:
            waiter.set()

    async def changed(self, within: float = 1.0) -> None:
        """Return once the next event is published (a request moved or ended, a model
        came or went, a wait for room ended): what the daemon's waits look again on,
        instead of a timer. ``within``: a safety net for a change that publishes
        nothing (a count going down after the event that caused it)."""
        waiter = anyio.Event()
        self._waiting.append(waiter)
        try:
            with anyio.move_on_after(within):
                await waiter.wait()
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)

    def subscribe(self, types: frozenset[str] | None = None, limit: int = LIMIT
                  ) -> Subscription:
        sub = Subscription(self, types, limit)
        self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)


def dumps(event: DaemonEvent) -> str:
    """An event as one line of JSON."""
    return json.dumps(event.wire(), separators=(",", ":"), ensure_ascii=False)
