"""The request lifecycle: active requests, each model's lane (running, queued,
admitting), queue positions, cancellation, deadlines and the one terminal event.

Rules, each upheld here and nowhere else:

1. Every request gets exactly one terminal event (``finish``), and nothing after it;
   a Generate or Embed's terminal event carries its Outcome to the peer.
2. ``Accepted`` precedes any ``Tokens``; a queued request hears a fresh ``Accepted``
   each time its position changes (``_announce``), and ``Accepted{0}`` when it starts.
3. A cancel (Cancel, deadline, disconnect, unload, shutdown) of a queued request ends
   it at once; of a running one, within one decode step (the engine's promise); of
   one still being admitted, once its admission finishes.

A request knows its model by name and the engine it runs on; lanes are kept by model
name, so nothing here points back at residency.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import anyio
import anyio.abc

from ..engine.core.jobs import Job, Output
from ..engine.host.contract import Engine
from ..errors import ErrorKind, EverycycleError, RejectedError
from ..protocol import (
    Accepted,
    Embed,
    Embeddings,
    Error,
    Generate,
    Priority,
    Progress,
    ServerEvent,
    TokenChunk,
    TokenLogprob,
    Tokens,
    ToolCalls,
    TopLogprob,
    Usage,
)
from .active import Active, Lane
from .eta import Rates, starts
from .events import ON_ENGINE, Cancelled, RequestInput, RequestState
from .outcome import Outcome, Peer
from .quota import Quotas
from .tasks import Tasks

log = logging.getLogger(__name__)

Report = Callable[[Outcome, Generate | Embed], None]


class Requests:
    """Every active request and every model's lane."""

    def __init__(self, quotas: Quotas, report: Report, tasks: Tasks) -> None:
        self.quotas = quotas
        self._report = report
        self.active: dict[str, Active] = {}
        self.lanes: dict[str, Lane] = {}
        self.tasks = tasks
        """Where deadline tasks run (the supervisor's task group)."""
        self.all_ended: anyio.Event | None = None
        """Set when the last request ends, once someone waits for that."""
        self.rates: dict[str, Rates] = {}
        """Each model's measured rates, for queue estimates."""
        self.background_age = 120.0
        """Seconds background work may wait with none of it moving (every slot kept by
        interactive work) before its oldest request is served as an interactive one."""

    def lane(self, model: str) -> Lane:
        lane = self.lanes.get(model)
        if lane is None:
            lane = self.lanes[model] = Lane()
        return lane

    def busy(self, model: str) -> bool:
        lane = self.lanes.get(model)
        return lane is not None and lane.busy

    def of(self, peer: Peer) -> list[Active]:
        return [a for a in self.active.values() if a.peer is peer]

    def track(self, active: Active) -> None:
        """``active`` is admitted from now on; its deadline, if any, starts now."""
        req = active.req
        self.active[req.request_id] = active
        if req.deadline_ms is not None:
            # The scope exists before anything can finish the request, so finish can
            # always cancel it: the deadline task never outlives its request.
            active.deadline = anyio.CancelScope(
                deadline=anyio.current_time() + req.deadline_ms / 1000)
            self.tasks.start_soon(self._deadline, active, active.deadline, req.deadline_ms)

    async def _deadline(self, active: Active, scope: anyio.CancelScope, ms: int) -> None:
        with scope:
            await anyio.sleep_forever()
        # Reached by the deadline, or by finish cancelling the scope; then the request
        # is gone and cancel does nothing.
        self.cancel(active, Cancelled.deadline(ms))

    # ------------------------------------------------------------------ slots and queue

    def place(self, active: Active, engine: Engine | None, max_queue: int) -> None:
        """Start ``active`` on ``engine`` if its lane has room and nobody of its lane (or
        before it) waits, else queue it: interactive requests before background ones
        (``engine`` None: the model does not serve now; it waits for its restart).
        Raises RejectedError when the queue is full."""
        lane = self.lane(active.model)
        behind = active.background
        waits = any(behind or not a.background for a in lane.queue)
        if waits or engine is None or not self._fits(lane, active, engine):
            if len(lane.queue) >= max_queue:
                raise RejectedError(f"queue full ({len(lane.queue)} waiting)")
            if behind and not any(a.background for a in lane.queue):
                lane.background_moved = time.monotonic()  # (its wait starts now)
            at = len(lane.queue) if behind else next(
                (i for i, a in enumerate(lane.queue) if a.background), len(lane.queue))
            lane.queue.insert(at, active)
            active.on(RequestInput.QUEUE)
            self._announce(lane, engine)
        else:
            self._start(active, engine)

    @staticmethod
    def _fits(lane: Lane, active: Active, engine: Engine) -> bool:
        """Whether ``active`` may start now: a background request in a free slot; an
        interactive one while fewer interactive ones run than there are slots (the
        engine parks a background one to make room)."""
        if active.background:
            return len(lane.running) < engine.parallel
        return sum(not a.background for a in lane.running) < engine.parallel

    def _promote_starved(self, lane: Lane) -> None:
        """Serve the oldest queued background request as an interactive one when no
        background work has moved for ``background_age`` seconds (one at a time: the
        next waits as long again)."""
        now = time.monotonic()
        if now - lane.background_moved < self.background_age:
            return
        oldest = next((a for a in lane.queue if a.background), None)
        if oldest is not None:
            oldest.promoted = True
            if oldest.job is not None:  # (not parked by its engine either)
                oldest.job.spec = replace(oldest.job.spec, background_age=None)
            lane.background_moved = now

    @staticmethod
    def tell_position(active: Active, position: int, eta: int | None = None) -> None:
        """Send ``active`` an Accepted with ``position`` (and, while it waits, ``eta``:
        its estimated start in ms) unless that is what it was told last: the first from
        admission on (also while its model loads), then each move, or an estimate off
        by more than a second. Once its prompt is read into tokens, each says how many."""
        if active.position != position or (eta is not None and active.eta_ms is not None
                                           and abs(eta - active.eta_ms) > 1000):
            active.position, active.eta_ms = position, eta
            active.peer.emit(Accepted(active.req.request_id, position, eta,
                                      active.n_prompt or None))
            active.told()

    def loading_eta(self, active: Active, position: int, parallel: int,
                    load_left: float | None) -> int | None:
        """Milliseconds until ``active``, waiting at ``position`` for its model to load,
        should start: the load's time left (``Residency.load_left``), then, past the
        ``parallel`` slots, the requests ahead of it at the model's measured rates (each
        taken to be as long as its own ``max_tokens`` says: no prompt is read yet).
        None when nothing measured says."""
        if load_left is None:
            return None
        if position == 0:
            return int(1000 * load_left)
        rates = self.rates.get(active.model)
        if rates is None:
            return None
        ahead = [active.work()] * (position + parallel)
        return int(1000 * (load_left + starts(rates, parallel, [], ahead)[-1]))

    def estimates(self, lane: Lane, engine: Engine) -> dict[Active, int]:
        """Milliseconds until each queued request of ``lane`` should start (``starts``;
        interactive ones wait only for interactive work: background work is parked)."""
        if not lane.queue:
            return {}
        rates = self.rates.setdefault(lane.queue[0].model, Rates())
        out: dict[Active, int] = {}
        for background in (False, True):
            running = [a.work() for a in lane.running if background or not a.background]
            waiting = [a for a in lane.queue if background or not a.background]
            for active, seconds in zip(waiting, starts(
                    rates, engine.parallel, running, [a.work() for a in waiting],
                    engine.step_seconds), strict=True):
                if active.background == background:
                    out[active] = int(1000 * seconds)
        return out

    def _start(self, active: Active, engine: Engine) -> None:
        assert active.job is not None
        active.on(RequestInput.START)
        active.started = time.monotonic()
        active.engine = engine
        lane = self.lane(active.model)
        lane.running.add(active)
        active.concurrency = len(lane.running)
        if active.req.priority is Priority.BACKGROUND:
            lane.background_moved = active.started
        self.tell_position(active, 0)
        try:
            engine.submit(active.job)
        except EverycycleError as exc:  # e.g. the engine thread died: this request ends here
            self.finish(active, Error(active.req.request_id, exc.kind, exc.message))

    def advance(self, model: str, engine: Engine) -> None:
        """Start queued requests of ``model`` that fit, interactive ones (and background
        ones past their age) first."""
        lane = self.lane(model)
        self._promote_starved(lane)
        lane.queue.sort(key=lambda a: (a.background, a.admitted))  # (in arrival order)
        moved = False
        for active in list(lane.queue):
            if self._fits(lane, active, engine):
                lane.queue.remove(active)
                self._start(active, engine)
                moved = True
            elif active.background:
                break  # (the background requests after it do not fit either)
        if moved:
            self._announce(lane, engine)

    def _announce(self, lane: Lane, engine: Engine | None = None) -> None:
        """Tell every queued request its position, and its estimated start when its
        model serves on ``engine`` (after the queue moved)."""
        etas = self.estimates(lane, engine) if engine is not None else {}
        for i, waiting in enumerate(lane.queue):
            self.tell_position(waiting, i + 1, etas.get(waiting))

    # ------------------------------------------------------------------ endings

    def cancel(self, active: Active, why: Cancelled) -> None:
        rid = active.req.request_id
        if self.active.get(rid) is not active:
            return
        if active.cancelled is None:
            active.cancelled = why
        reason = active.cancelled.message
        if active.state in ON_ENGINE:
            if active.engine is not None and active.job is not None:
                active.engine.cancel(active.job, reason)
        elif active.state is RequestState.QUEUED:
            lane = self.lane(active.model)
            lane.queue.remove(active)
            self.finish(active, Error(rid, ErrorKind.CANCELLED, reason))
            self._announce(lane, next((a.engine for a in lane.running if a.engine), None))
        elif active.waiting is not None:
            active.waiting.cancel()

    def cancel_model(self, model: str, why: Cancelled) -> None:
        lane = self.lane(model)
        for active in list(lane.queue) + list(lane.running):
            self.cancel(active, why)

    def end_running(self, model: str, kind: ErrorKind, message: str,
                    engine: Engine | None = None) -> None:
        """End the running requests of ``model`` (of ``engine`` only, when given) now."""
        for active in list(self.lane(model).running):
            if engine is None or active.engine is engine:
                self.finish(active, Error(active.req.request_id, kind, message))

    def fail_queue(self, model: str, message: str) -> None:
        lane = self.lane(model)
        for active in list(lane.queue):
            lane.queue.remove(active)
            self.finish(active, Error(active.req.request_id, ErrorKind.INTERNAL, message))

    def finish(self, active: Active, event: ServerEvent, reason: str | None = None) -> None:
        """Send the one terminal event of ``active`` with its Outcome, report it, and
        forget the request. ``reason`` is the engine's finish reason when it finished."""
        rid = active.req.request_id
        if self.active.get(rid) is not active:
            return
        del self.active[rid]
        if not self.active and self.all_ended is not None:
            self.all_ended.set()
        if active.deadline is not None:
            active.deadline.cancel()
        now = time.monotonic()
        if active.model:
            lane = self.lane(active.model)
            if active in lane.running:
                active.concurrency = (active.concurrency + len(lane.running)) / 2
                lane.running.discard(active)
                if active.req.priority is Priority.BACKGROUND:
                    lane.background_moved = now
        started = active.started or now
        outcome_kind = event.kind if isinstance(event, Error) else None
        for problem in active.output.invalid if active.output else ():
            log.warning("request %s: a call of %s; returned as the model wrote it", rid,
                        problem)
        outcome = Outcome(
            request_id=rid,
            model=active.model or active.req.model,
            executor=active.executor,
            kind=outcome_kind,
            finish_reason=reason,
            prompt_tokens=active.n_prompt,
            cached_tokens=active.job.n_reused if active.job else 0,
            generated_tokens=active.n_out,
            reasoning_tokens=(active.job.n_thought if active.job is not None
                              and active.job.spec.think is not None else None),
            draft_tokens=active.job.n_drafted if active.job is not None else 0,
            draft_accepted=active.job.n_draft_accepted if active.job is not None else 0,
            queue_wait_s=started - active.admitted,
            ttft_s=None if active.first_token is None else active.first_token - active.admitted,
            duration_s=now - active.admitted,
            principal=active.peer.principal.name,
            tool_calls=len(active.output.calls) if active.output else 0,
            malformed_calls=active.output.malformed if active.output else 0,
            invalid_calls=len(active.output.invalid) if active.output else 0,
            context_limit=active.context_limit,
            lane=active.lane,
            cancel_cause=(active.cancelled.cause.value if active.cancelled is not None
                          and outcome_kind is ErrorKind.CANCELLED else None),
        )
        if outcome.kind is None and active.job is not None and active.model:
            self._learn(active, now)
        # Reported (audit, metrics) before the client hears of it: with a line written
        # straight to the socket, a client that reads the audit log after its answer
        # finds the request's record there.
        try:
            self._report(outcome, active.req)
        finally:
            active.on(RequestInput.FINISH, outcome)
            active.peer.emit(event, outcome)

    def _learn(self, active: Active, now: float) -> None:
        """Its model's rates, from a request that finished."""
        job = active.job
        assert job is not None
        first, started = active.first_token, active.started or now
        slots = active.engine.parallel if active.engine is not None else 1
        self.rates.setdefault(active.model, Rates()).observe(
            lane=active.lane, read=job.n_prompt - job.n_reused, generated=active.n_out,
            beside=min(slots, max(1, round(active.concurrency))),
            max_tokens=active.req.max_tokens if isinstance(active.req, Generate) else 1,
            prefill_s=None if first is None or job.n_parked else first - started,
            decode_s=0.0 if first is None or job.n_parked else now - first)

    # ------------------------------------------------------------------ engine outputs

    def _count(self, active: Active, event: Tokens) -> None:
        """Count the ids a client is sent: what usage, quotas and the audit log charge."""
        n = len(event.chunk.ids)
        if n:
            active.n_out += n
            self.quotas.generated(active.peer.principal, n, active.lane)

    def on_outputs(self, batch: list[tuple[Job, Output]]) -> set[str]:
        """Deliver one decode step's outputs; returns the models whose slots freed."""
        freed: set[str] = set()
        for job, out in batch:
            active: Active = job.tag
            rid = active.req.request_id
            if self.active.get(rid) is not active:
                continue
            if active.first_token is None and out.ids:
                active.first_token = time.monotonic()
            if out.parked is not None:  # (no text: its slot went, or came back)
                active.on(RequestInput.PARK if out.parked else RequestInput.RESUME)
                continue
            if out.progress is not None and not out.finished:
                active.peer.emit(Progress(rid, job.n_prompt, job.n_reused, out.progress, int(
                    (time.monotonic() - active.admitted) * 1000)))
                continue
            if not out.finished:
                event = Tokens(rid, self._chunk(active, out), False)
                self._count(active, event)
                active.peer.emit(event)
                continue
            freed.add(active.model)
            if out.reason == "cancelled":
                reason = active.cancelled.message if active.cancelled else "cancelled"
                self.finish(active, Error(rid, ErrorKind.CANCELLED, reason))
            elif out.reason == "error":
                error = out.error
                self.finish(active, Error(rid, error.kind if error else ErrorKind.INTERNAL,
                                          error.message if error else "generation failed"))
            elif out.embeddings is not None:
                vectors = tuple(tuple(v) for v in out.embeddings)
                self.finish(active, Embeddings(rid, vectors), out.reason)
            else:
                last = Tokens(rid, self._chunk(active, out, final=True), True)
                self._count(active, last)
                reason = out.reason or "eos"
                if active.output is not None and active.output.calls:
                    active.peer.emit(ToolCalls(rid, tuple(active.output.calls)))
                    reason = "tool_calls"
                if isinstance(active.req, Generate) and active.req.usage:
                    active.peer.emit(Usage(
                        rid, active.n_prompt, job.n_reused, active.n_out, reason,
                        job.n_thought if job.spec.think is not None else None,
                        job.n_drafted or None, job.n_draft_accepted if job.n_drafted else None))
                self.finish(active, last, reason)
        return freed

    @staticmethod
    def _chunk(active: Active, out: Output, *, final: bool = False) -> TokenChunk:
        """The chunk for the engine's output: split into answer and thinking (and its
        tool calls kept back) when the request's output needs it."""
        logprobs = (tuple(TokenLogprob(t, lp, tuple(TopLogprob(a, alp, aid)
                                                     for a, alp, aid in top))
                          for t, lp, top in out.logprobs) if out.logprobs else None)
        if active.output is None:
            return TokenChunk(out.text, out.ids, None, logprobs)
        answer, thought = active.output.feed(out.text)
        if final:
            more, more_thought = active.output.finish()
            answer, thought = answer + more, thought + more_thought
        return TokenChunk(answer, out.ids, thought or None, logprobs)
