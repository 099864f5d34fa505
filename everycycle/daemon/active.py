"""One request as the daemon tracks it (``Active``), its model's lane (``Lane``), and its
moves through the request state machine (``events.MOVES``): ``on`` is the only way its
state changes, and each change is published on the daemon's event bus."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from ..chatfmt.chatoutput import ChatOutput
from ..engine.core.jobs import Job
from ..engine.host.contract import Engine
from ..protocol import Embed, Generate, Priority
from .eta import Work
from .events import (
    ON_ENGINE,
    Bus,
    Cancelled,
    RequestInput,
    RequestState,
    RequestStateChanged,
    next_state,
)
from .outcome import Outcome, Peer


@dataclass(eq=False)
class Active:
    """One Generate or Embed request from admission to its terminal event."""

    req: Generate | Embed
    peer: Peer
    admitted: float
    model: str = ""
    """Its model's name once known (the request may name an alias or a path)."""
    state: RequestState = RequestState.ADMITTING
    """Changed by ``on`` only."""
    bus: Bus | None = None
    """Where its moves are told (None: nowhere, as in tests of the lifecycle alone)."""
    job: Job | None = None
    engine: Engine | None = None
    """The engine it runs on, once running."""
    executor: str | None = None
    started: float | None = None
    cancelled: Cancelled | None = None
    """Its cancel, once asked (the first one counts)."""
    deadline: anyio.CancelScope | None = None
    first_token: float | None = None
    n_prompt: int = 0
    n_out: int = 0
    output: ChatOutput | None = None
    """What splits its output into answer, thinking and tool calls (None: all answer)."""
    context_limit: int | None = None
    """The context its prompt did not fit, when it ended so."""
    position: int | None = None
    """The queue position it was last told (None: none yet)."""
    waiting: anyio.CancelScope | None = None
    """While it waits for its model (a load, or room for it): cancelling ends the wait."""
    promoted: bool = False
    """A background request served as an interactive one (its lane starved)."""
    concurrency: float = 0.0
    """Requests running on its model with it: at its start, then the mean of its start's
    and its end's (what its measured rates were measured beside)."""
    eta_ms: int | None = None
    """The start it was last told to expect, while it waits."""

    @property
    def lane(self) -> str:
        """``interactive`` or ``background``: the lane it asked for."""
        return "background" if self.req.priority is Priority.BACKGROUND else "interactive"

    def on(self, happened: RequestInput, outcome: Outcome | None = None) -> None:
        """Move as the table says for what ``happened`` and publish the new state (staying
        is no move). Raises IllegalTransition where the table does not go."""
        state = next_state(self.state, happened)
        if state is self.state:
            return
        self.state = state
        self.told()
        if outcome is not None and self.bus is not None:  # (the last word: how it ended)
            self.bus.publish(RequestStateChanged(
                request_id=self.req.request_id, model=outcome.model,
                principal=outcome.principal, lane=self.lane, state=state.value,
                outcome=outcome.kind.value if outcome.kind else "finished",
                finish_reason=outcome.finish_reason, cause=outcome.cancel_cause, usage={
                    "prompt_tokens": outcome.prompt_tokens,
                    "cached_tokens": outcome.cached_tokens,
                    "output_tokens": outcome.generated_tokens}))

    def told(self) -> None:
        """Publish where it is now (its state, and its place while it waits)."""
        if self.bus is None or self.state is RequestState.FINISHED:
            return
        waits = self.state not in ON_ENGINE
        self.bus.publish(RequestStateChanged(
            request_id=self.req.request_id, model=self.model or self.req.model,
            principal=self.peer.principal.name, lane=self.lane, state=self.state.value,
            position=self.position if waits else None,
            eta_ms=self.eta_ms if waits else None))

    @property
    def background(self) -> bool:
        """Whether it waits behind interactive requests (and gives its slot up to them)."""
        return self.req.priority is Priority.BACKGROUND and not self.promoted

    def work(self) -> Work:
        """What it asks of its engine, for queue estimates."""
        job = self.job
        prompt = len(job.spec.tokens) if job is not None else self.n_prompt
        max_tokens = self.req.max_tokens if isinstance(self.req, Generate) else 1
        if self.state not in ON_ENGINE:
            return Work(prompt, max_tokens, self.lane)
        return Work(prompt, max_tokens, self.lane, self.n_out,
                    prompt if self.first_token is not None else None)


@dataclass(eq=False)
class Lane:
    """One model's requests: running on its engine, queued for a slot, being admitted."""

    running: set[Active] = field(default_factory=set)
    queue: list[Active] = field(default_factory=list)
    admitting: int = 0
    """Requests between admission and a slot or the queue: never unload under them."""
    raising: int = 0
    """Of those, the ones waiting for the model to be loaded with more context."""
    background_moved: float = 0.0
    """When background work last started or ended, or began to wait (monotonic)."""

    @property
    def busy(self) -> bool:
        return bool(self.running or self.queue or self.admitting)

    @property
    def decoding(self) -> int:
        """Its requests in a slot now (a parked one holds none)."""
        return sum(a.state is RequestState.RUNNING for a in self.running)
