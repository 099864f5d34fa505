"""The supervisor: takes each request from a peer and coordinates the parts that serve
it — admission and limits (here), the request lifecycle (``lifecycle``), residency
(``residency``), remote hosts (``remote``), jobs (``jobbuild``) and the fleet
snapshot (``fleet``).

It runs on the event loop. Engines' decode threads hand their step outputs (and their
deaths) to one ``Handoff``; a single pump task delivers them on the event loop in
order. Peers receive events through ``Peer.emit``, which must not block. Every
outcome of a request is an event, never an exception.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import anyio.to_thread

from .. import paths
from ..chatfmt.callgrammar import CallGrammars
from ..chatfmt.chatoutput import ChatOutput
from ..engine.core.jobs import Job, Output
from ..engine.host.contract import Engine
from ..errors import (
    ContextOverflowError,
    ErrorKind,
    EverycycleError,
    InternalError,
    InvalidRequestError,
    RejectedError,
    RequestCancelledError,
)
from ..hardware import cpukernels, rpc
from ..models import stores
from ..models.keepalive import DEFAULT_KEEP_ALIVE
from ..models.registry import ModelSpec, Registry
from ..protocol import (
    Cancel,
    DescribeFleet,
    Done,
    Embed,
    Error,
    FleetDescription,
    FleetSnapshot,
    Generate,
    ListTools,
    Load,
    Priority,
    Request,
    RunTool,
    Shutdown,
    Subscribe,
    Unload,
)
from . import events, mcptools
from .active import Active
from .audit import AuditLog
from .events import Bus, CancelCause, Cancelled, RequestEnded, RequestInput
from .fleet import FleetView
from .handoff import Handoff
from .jobbuild import build_job
from .keys import ADMINS, Principal, check_may_use, may_act_for
from .lifecycle import Requests
from .lorascales import LoraScales
from .outcome import Limits, Outcome, Peer, prompt_bytes
from .pulls import Pulls
from .quota import Quotas
from .readiness import Readiness
from .residency import EngineFactory, Residency, Resident, context, drafts, room
from .residency.remote import RemoteHosts
from .subscribe import Subscribers
from .tasks import Tasks

__all__ = ["EngineFactory", "Limits", "Outcome", "Peer", "Supervisor"]

log = logging.getLogger(__name__)


class Supervisor:
    """Owns resident models and every active request. Start it with ``await tg.start(sup.run)``."""

    CLOSE_WAIT_S = 10.0
    """How long ``close`` waits for requests still in admission to end."""

    def __init__(
        self,
        registry: Registry,
        *,
        limits: Limits | None = None,
        auto_load: bool = True,
        audit: AuditLog | None = None,
        on_shutdown: Callable[[], None] | None = None,
        keep_alive: float = DEFAULT_KEEP_ALIVE,
        max_loaded_models: int | None = None,
        rpc: Sequence[str] = (),
        isolate: bool = True,
        engine_factory: EngineFactory | None = None,
        reload: Callable[[], Registry] | None = None,
        resolve: Callable[[str], str] | None = None,
    ) -> None:
        self._reload = reload
        """Reads the registry files again: a name the registry does not know may have
        been added since (``models add``, ``run -m hf://…``)."""
        self.limits = limits or Limits()
        self.auto_load = auto_load
        self.audit = audit
        self.quotas = Quotas()
        self._on_shutdown = on_shutdown
        self.tasks = Tasks()
        self.requests = Requests(self.quotas, self._report, self.tasks)
        self.requests.background_age = self.limits.background_age
        self.remote = RemoteHosts([*rpc, *registry.rpc])
        self.call_grammars = CallGrammars()  # (an agent sends the same list every turn)
        self.lora_scales = LoraScales()  # (models.toml's, as POST /lora-adapters sets them)
        self._outputs: Handoff[list[tuple[Job, Output]] | Engine] = Handoff()
        self.residency = Residency(
            registry, self.requests, self.remote, notify=self._outputs.put,
            on_death=self._outputs.put, isolate=isolate, engine_factory=engine_factory,
            keep_alive=keep_alive,
            max_loaded_models=max_loaded_models or registry.max_loaded_models,
            hang_after=self.limits.hang_timeout,
            room_waits=room.RoomWaits(self.limits.swap_after, self.limits.min_residency))
        self.bus = Bus()
        """What happens, told as it happens (GET /v1/events, Subscribe)."""
        self.pulls = Pulls(resolve, self.bus.publish)
        """Hub URLs' registry names, pulled the first time (not with ``--models``)."""
        self.residency.publish = self.bus.publish
        self.residency.changed = self.bus.changed
        if audit is not None:
            self.bus.listen(audit.on_event)
        self.subscribers = Subscribers(self.bus)
        self.readiness = Readiness(self.residency, self.requests, self.bus.publish)
        """Ready, loading or draining: what /health and ``fleet`` say."""
        self.fleet = FleetView(self.residency, self.requests, self.lora_scales,
                               self.readiness)
        self._admission: dict[str, anyio.Lock] = {}
        self._deaths: deque[Engine] = deque()
        self.mcp = mcptools.host()
        """The user's MCP servers (mcp.json), started on first use."""
        self._deaths_due: anyio.Event | None = None

    @property
    def registry(self) -> Registry:
        """The registry in use: the residency's (one copy)."""
        return self.residency.registry

    @property
    def closing(self) -> bool:
        """Shutting down: no new requests, no loads (the residency's flag)."""
        return self.residency.closing

    @property
    def engine_deaths(self) -> dict[tuple[str, str], int]:
        """Engine processes that died unasked, by (model, cause)."""
        return self.residency.engine_deaths

    @property
    def http_address(self) -> str | None:
        return self.fleet.http_address

    @http_address.setter
    def http_address(self, value: str | None) -> None:
        self.fleet.http_address = value

    def forget(self, name: str) -> None:
        """Drop ``name`` from the registry in use (a model deleted over HTTP); the
        registry files are the caller's to change. A resident copy stays until unloaded."""
        reg = self.registry
        self.residency.registry = dataclasses.replace(
            reg, models={k: v for k, v in reg.models.items() if k != name},
            default=None if reg.default == name else reg.default)

    def knows(self, name: str) -> bool:
        """Whether a request may name ``name``: a registry entry (read again if need be),
        a model in another tool's store, or a hub URL the daemon pulls."""
        self._know(name)
        return self.registry.has(name) or stores.has(name) or (
            self.pulls.may_pull(name))

    def _know(self, name: str) -> None:
        """Read the registry files again if they may name ``name`` now (a broken file
        keeps the registry in use, and says why once)."""
        if self.registry.has(name) or self._reload is None:
            return
        try:
            registry = self._reload()
        except EverycycleError as exc:
            log.warning("the registry was not read again: %s", exc.message)
            return
        self.residency.registry = registry

    def snapshot(self) -> FleetSnapshot:
        """The live fleet, with the executors as last queried."""
        return self.fleet.current()

    # ------------------------------------------------------------------ lifetime

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Serve until cancelled; then cancel every request and unload every model."""
        await self.fleet.refresh()
        # The CPU's extra kernels, before any load (probed once per machine and build).
        self.fleet.cpu_kernels = await anyio.to_thread.run_sync(cpukernels.decide,
                                                                paths.state_dir())
        self.fleet.rpc_available = await anyio.to_thread.run_sync(rpc.available)
        await self.remote.probe(self._host_busy)
        try:
            async with anyio.create_task_group() as tg:
                self.tasks.attach(tg)
                self.mcp.group = tg
                tg.start_soon(self._outputs.serve, self._on_item)
                tg.start_soon(self.residency.watch_deaths, self._deaths, self._next_death)
                tg.start_soon(self.residency.reap_idle)
                if self.remote.hosts:
                    tg.start_soon(self.remote.watch, self._host_busy)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self.tasks.attach(None)
            self.mcp.group = None
            with anyio.CancelScope(shield=True):
                await self.close()
                await self.mcp.close()

    def _host_busy(self, endpoint: str) -> bool:
        return self.residency.host_in_use(endpoint) is not None

    async def close(self) -> None:
        """Cancel everything ("daemon shutting down") and unload all models; return once
        every request has had its terminal event (or after CLOSE_WAIT_S)."""
        self.residency.closing = True
        for active in list(self.requests.active.values()):
            self.requests.cancel(active, Cancelled.shutdown())
        for name in list(self.residency.models):
            await self.residency.unload(name, "daemon shutting down", "shutdown")
        # A request still being admitted (tokenizing, or behind another) ends when its
        # admission does; its Cancelled event must come before the listeners close.
        if self.requests.active:
            self.requests.all_ended = anyio.Event()
            with anyio.move_on_after(self.CLOSE_WAIT_S):
                await self.requests.all_ended.wait()

    # ------------------------------------------------------------------ dispatch

    async def handle(self, peer: Peer, request: Request) -> None:
        """Serve one request from ``peer``; every outcome is an event, never an exception."""
        rid = getattr(request, "request_id", "")
        try:
            if isinstance(request, Generate | Embed):
                await self._generate(peer, request)
            elif isinstance(request, DescribeFleet):
                peer.emit(FleetDescription(await self.fleet.snapshot()))
            elif isinstance(request, ListTools | RunTool):
                await mcptools.answer(self.mcp, peer, request)
            elif isinstance(request, Subscribe):
                await self.subscribers.serve(peer, request)
            elif isinstance(request, Cancel):
                target = self.requests.active.get(request.target)
                if target is None and self.subscribers.cancel(request.target, peer.principal):
                    peer.emit(Done(rid))
                elif target is None or not may_act_for(peer.principal, target.peer.principal):
                    raise InvalidRequestError(f"no active request '{request.target}'")
                else:
                    self.requests.cancel(target, Cancelled.by(f"request {rid}"))
                    peer.emit(Done(rid))
            elif isinstance(request, Load):
                self._know(request.model)
                spec = self.residency.spec_for(request.model, allow_paths=peer.allow_paths)
                if request.draft_model is not None:
                    spec = await drafts.with_draft(self.residency, spec, request.draft_model)
                model = await context.loaded(
                    self.residency, self.requests.lane(spec.name), spec, request.context,
                    executor=request.executor, retry_failed=True)
                self.residency.touch(model, request.keep_alive_ms)
                peer.emit(Done(rid))
            elif isinstance(request, Unload):
                if request.model not in self.residency.models:
                    raise InvalidRequestError(f"model '{request.model}' is not loaded")
                await self.residency.unload(request.model,
                                            f"model '{request.model}' unloaded")
                peer.emit(Done(rid))
            elif isinstance(request, Shutdown):
                if peer.principal.name not in ADMINS:
                    raise InvalidRequestError("only the daemon's own user or its token may "
                                              "stop it")
                if request.drain_ms is not None:
                    await self.readiness.drain(request.drain_ms / 1000)
                await self.close()
                peer.emit(Done(rid))
                if self._on_shutdown is not None:
                    self._on_shutdown()
            else:
                raise InvalidRequestError(f"{type(request).__name__} is not expected here")
        except EverycycleError as exc:
            self._fail(peer, request, exc)
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("request %s failed", rid)
            self._fail(peer, request, InternalError(f"internal error: {exc}"))

    def _fail(self, peer: Peer, request: Request, exc: EverycycleError) -> None:
        """End ``request`` with Error for ``exc``: through finish once it is active."""
        rid = getattr(request, "request_id", "")
        active = self.requests.active.get(rid)
        if isinstance(request, Generate | Embed) and active is not None and active.peer is peer:
            if active.cancelled is not None:  # cancelled while admitting
                exc = RequestCancelledError(active.cancelled.message)
            elif isinstance(exc, ContextOverflowError):
                active.n_prompt, active.context_limit = exc.prompt_tokens, exc.context
            self.requests.finish(active, Error(rid, exc.kind, exc.message))
            return
        if not isinstance(request, Generate | Embed):
            peer.emit(Error(rid, exc.kind, exc.message))
            return
        # Refused before admission: the peer, metrics and the audit log still hear of it.
        limit = retry = None
        if isinstance(exc, RejectedError):
            limit, retry = exc.limit, exc.retry_after
        if limit is not None:
            self.bus.publish(events.KeyLimitHit(principal=peer.principal.name, limit=limit,
                                                model=request.model, retry_after_s=retry))
        outcome = Outcome(request_id=rid, model=request.model, executor=None, kind=exc.kind,
                          finish_reason=None, principal=peer.principal.name, limit=limit,
                          retry_after_s=retry)
        peer.emit(Error(rid, exc.kind, exc.message), outcome)
        self._report(outcome, request)

    def disconnect(self, peer: Peer) -> None:
        """The peer went away: cancel all of its requests, end its subscriptions."""
        self.subscribers.disconnect(peer)
        for active in self.requests.of(peer):
            self.requests.cancel(active, Cancelled.disconnect())

    def inflight(self, peer: Peer) -> int:
        return len(self.requests.of(peer))

    # ------------------------------------------------------------------ admission

    async def _generate(self, peer: Peer, req: Generate | Embed) -> None:
        rid = req.request_id
        if rid in self.requests.active:
            peer.emit(Error(rid, ErrorKind.INVALID, f"request id '{rid}' is already active"))
            return
        if self.closing:
            raise RejectedError("daemon shutting down")
        if self.readiness.refusing:
            raise RejectedError(self.readiness.refusal(),
                                retry_after=self.readiness.retry_after())
        if self.inflight(peer) >= self.limits.max_inflight:
            raise RejectedError(
                f"too many requests in flight on this connection ({self.limits.max_inflight})")
        if prompt_bytes(req) > self.limits.max_prompt_bytes:
            what = ("input" if isinstance(req, Embed) else
                    "prompt" if req.messages is None else "messages")
            raise InvalidRequestError(f"{what} longer than {self.limits.max_prompt_bytes} bytes")
        if (isinstance(req, Generate) and req.max_tokens is not None
                and req.max_tokens > self.limits.max_tokens):
            raise InvalidRequestError(f"max_tokens must be between 1 and {self.limits.max_tokens}")
        if peer.principal.limits.background and req.priority is not Priority.BACKGROUND:
            req = dataclasses.replace(req, priority=Priority.BACKGROUND)  # (its key's lane)
        self._check_principal(peer, req)
        active = Active(req=req, peer=peer, admitted=time.monotonic(), bus=self.bus)
        self.requests.track(active)
        allow_load = self.auto_load and req.auto_load is not False
        name = await self.pulls.pulled(req.model, allow_load, lambda: self.registry)
        self._know(name)
        spec = self.residency.spec_for(name, allow_paths=peer.allow_paths)
        active.model = spec.name
        lane = self.requests.lane(spec.name)
        active.waiting = anyio.CancelScope()  # a Cancel or deadline ends these waits
        with active.waiting:
            await room.give_way(self.residency, spec.name, active)
        if active.cancelled is not None:
            raise RequestCancelledError(active.cancelled.message)
        lane.admitting += 1  # (never unloaded under it, from here to a slot or the queue)
        try:
            if spec.name not in self.residency.models and allow_load:
                ahead = lane.admitting - 1 + len(lane.queue)
                if ahead > self.limits.max_queue:
                    raise RejectedError(f"queue full ({ahead} waiting for model "
                                        f"'{spec.name}' to load)")
                active.on(RequestInput.LOAD)  # (with every request waiting for it)
                # Admitted: its place from now on (those ahead of it past the slots).
                at = max(0, ahead - spec.parallel + 1)
                self.requests.tell_position(active, at, self.requests.loading_eta(
                    active, at, spec.parallel, self.residency.load_left(spec)))
            model = None
            active.waiting = anyio.CancelScope()
            with active.waiting:
                model = await context.loaded(self.residency, lane, spec, req.context if
                                             isinstance(req, Generate) else None,
                                             allow_load=allow_load)
            active.waiting = None
            if model is None:  # cancelled while it waited: the load goes on for others
                raise RequestCancelledError(
                    active.cancelled.message if active.cancelled else "cancelled")
            active.on(RequestInput.ADMIT)
            # Admission is FIFO per model (anyio locks are fair, and a load's waiters wake
            # in order): requests queue in arrival order though tokenizing yields.
            async with self._admission.setdefault(spec.name, anyio.Lock()):
                await self._admit(model, active)
        finally:
            lane.admitting -= 1

    async def engine_for(self, principal: Principal, name: str) -> tuple[ModelSpec, Engine]:
        """The engine that serves model ``name`` (loaded first where it is not and loads
        are allowed), for work on its vocabulary alone: tokenizing, detokenizing.
        Raises InvalidRequestError for a model the principal may not use or that is
        unknown, ModelNotLoadedError, and what a load raises."""
        if self.closing:
            raise RejectedError("daemon shutting down")
        check_may_use(principal, name, self.registry)
        name = await self.pulls.pulled(name, self.auto_load, lambda: self.registry)
        self._know(name)
        spec = self.residency.spec_for(name, allow_paths=False)
        lane = self.requests.lane(spec.name)
        for attempt in range(3):
            model = await context.loaded(self.residency, lane, spec, None,
                                         allow_load=self.auto_load)
            await self.residency.serving(model)
            if model.engine.dead is None or attempt == 2:
                self.residency.touch(model)
                return spec, model.engine
        raise AssertionError("unreachable")

    def _check_principal(self, peer: Peer, req: Generate | Embed) -> None:
        """The principal's own limits: which models, how many at once, how fast (a lane's)."""
        principal = peer.principal
        check_may_use(principal, req.model, self.registry)
        lane = "background" if req.priority is Priority.BACKGROUND else "interactive"
        inflight = sum(1 for a in self.requests.active.values()
                       if a.peer.principal.name == principal.name and a.lane == lane)
        self.quotas.admit(principal, lane, prompt_bytes=prompt_bytes(req), inflight=inflight)

    async def _admit(self, model: Resident, active: Active) -> None:
        req = active.req
        self.residency.touch(model, req.keep_alive_ms)
        job, active.output = await self._job_on(model, active)
        if active.cancelled is None and self.residency.models.get(model.name) is not model:
            active.cancelled = Cancelled(CancelCause.UNLOAD, f"model '{model.name}' unloaded")
        if active.cancelled is not None:
            self.requests.finish(active, Error(req.request_id, ErrorKind.CANCELLED,
                                               active.cancelled.message))
            return
        active.job = job
        active.executor = model.executor
        active.n_prompt = (sum(len(t) for t in job.spec.embed_inputs) if job.spec.embed_inputs is not None
                           else len(job.spec.tokens))
        self.requests.place(active, model.engine if model.serving else None,
                            self.limits.max_queue)

    async def _job_on(self, model: Resident, active: Active) -> tuple[Job, ChatOutput | None]:
        """The request's Job on the model's engine once it serves; again on the
        restarted engine when it died meanwhile."""
        for attempt in range(3):
            await self.residency.serving(model)
            engine = model.engine
            try:
                age = self.limits.background_age if active.background else None
                return await anyio.to_thread.run_sync(build_job, model.spec, engine,
                                                      active.req, active, age,
                                                      self.call_grammars, self.lora_scales)
            except InternalError:
                if engine.dead is None or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ outcomes

    def _report(self, outcome: Outcome, req: Generate | Embed) -> None:
        if outcome.executor is not None:
            resident = self.residency.models.get(outcome.model)
            if resident is not None:
                self.residency.touch(resident)
        self.bus.publish(RequestEnded(outcome=outcome, request=req))

    # ------------------------------------------------------------------ engine outputs

    def _next_death(self) -> anyio.Event:
        self._deaths_due = anyio.Event()
        return self._deaths_due

    def _on_item(self, item: list[tuple[Job, Output]] | Engine) -> None:
        """One engine step's outputs, or an engine that died unasked (after its jobs'
        errors, on the same handoff), on the event loop."""
        if not isinstance(item, list):
            # (Runs as a bare event-loop callback: a task does the rest.)
            self._deaths.append(item)
            if self._deaths_due is not None:
                self._deaths_due.set()
            return
        for name in self.requests.on_outputs(item):
            model = self.residency.models.get(name)
            if model is not None and model.serving:
                self.requests.advance(name, model.engine)
