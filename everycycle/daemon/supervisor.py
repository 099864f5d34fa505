"""The supervisor: admission, per-model queues and positions, limits, deadlines,
cancellation, loading and unloading, and the live FleetSnapshot.

It runs on the event loop and owns the engine Runners. Each Runner's decode thread
puts its step outputs on one thread-safe queue (``_notify``, never blocking); a
single pump task takes them off on the event loop in order. Peers (socket
connections, or the embedded client) receive events through ``Peer.emit``, which
must not block. Rules, each upheld here and tested through the daemon:

1. Every request gets exactly one terminal event (``_finish``), and nothing after it.
2. ``Accepted`` precedes any ``Tokens``; a queued request gets a fresh ``Accepted``
   each time its position changes, and ``Accepted{0}`` when its work starts.
3. A cancel (Cancel, deadline, disconnect, unload, shutdown) of a queued request ends
   it at once; of a running one, within one decode step (the engine's promise).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.to_thread

from .. import paths
from ..engine import cpukernels
from ..engine import executors as ex
from ..engine.contract import Engine, LoadOptions, Notify
from ..engine.grammar import check_size as check_grammar_size
from ..engine.grammar import schema_to_gbnf
from ..engine.jobs import EMBED_MAX_TOKENS, Job, Output, Sampling
from ..engine.memory import plan
from ..errors import (
    ErrorKind,
    EverycycleError,
    InternalError,
    InvalidRequestError,
    ModelNotLoadedError,
    RejectedError,
    RequestCancelledError,
)
from ..models.registry import DEFAULT_KEEP_ALIVE, ModelSpec, Registry, local_file
from ..protocol import (
    Accepted,
    ActiveRequest,
    Cancel,
    DescribeFleet,
    Done,
    Embed,
    Embeddings,
    Error,
    ExecutorSummary,
    FleetDescription,
    FleetSnapshot,
    Format,
    Generate,
    Load,
    LoadedModel,
    PrincipalLoad,
    Request,
    ServerEvent,
    Shutdown,
    TokenChunk,
    Tokens,
    Unload,
    Usage,
)
from .audit import AuditLog
from .handoff import Handoff
from .keys import LOCAL, Principal
from .quota import Quotas

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    """Admission bounds; beyond them a request is Rejected (queues) or Invalid (sizes)."""

    max_queue: int = 64
    """Queued (not yet running) requests per model."""
    max_inflight: int = 32
    """Active requests per connection."""
    max_prompt_bytes: int = 512 * 1024
    max_tokens: int = 32768


def _rss_bytes() -> int | None:
    """This process's resident set size (Linux: /proc; elsewhere unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _device_layers(model: _Model) -> tuple[int | None, int | None]:
    """(repeating layers on the executor's devices, layers): llama.cpp's own report
    when it made one, else the plan's; (None, None) on the CPU."""
    offload = model.placement.offload if model.placement else None
    if offload is None:
        return None, None
    if model.engine.offloaded is not None:
        on, total = model.engine.offloaded  # the output head counts as a layer there
        return min(on, total - 1), total - 1
    return offload.gpu_layers, offload.n_layer


def _prompt_bytes(req: Generate | Embed) -> int:
    if isinstance(req, Embed):
        return sum(len(text.encode("utf-8")) for text in req.input)
    if req.messages is not None:
        return sum(len(m.content.encode("utf-8")) for m in req.messages)
    return len((req.prompt or "").encode("utf-8"))


def _sampling(req: Generate, model_defaults: Mapping[str, Any],
              grammar: str | None = None) -> Sampling:
    """The request's options, else the model's (models.toml), else llama.cpp's defaults."""
    values: dict[str, Any] = {**model_defaults, "grammar": grammar}
    for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed"):
        given = getattr(req, name)
        if given is not None:
            values[name] = given
    return Sampling(**values)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a Generate request ended: what the audit log, metrics and HTTP usage report."""

    request_id: str
    model: str
    executor: str | None
    kind: ErrorKind | None
    """None when the request finished; else the kind of its terminal Error."""
    finish_reason: str | None
    """The engine's reason when finished: eos, stop, length or context."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    queue_wait_s: float = 0.0
    ttft_s: float | None = None
    duration_s: float = 0.0
    principal: str = LOCAL.name
    limit: str | None = None
    """The quota that refused it (a Rejected request), e.g. ``requests_per_minute``."""
    retry_after_s: float | None = None
    """When it was refused for a while: in how many seconds to try again."""


class Peer(Protocol):
    """Whoever sent the request: receives its events without blocking."""

    allow_paths: bool

    @property
    def principal(self) -> Principal: ...

    def emit(self, event: ServerEvent) -> None: ...

    def finished(self, outcome: Outcome) -> None:
        """Called just before a Generate request's terminal event is emitted."""


@dataclass(eq=False)
class _Active:
    req: Generate | Embed
    peer: Peer
    admitted: float
    model: str = ""
    home: _Model | None = None
    state: str = "admitting"  # admitting | queued | running
    job: Job | None = None
    started: float | None = None
    cancel_reason: str | None = None
    deadline: anyio.CancelScope | None = None
    first_token: float | None = None
    n_prompt: int = 0
    n_out: int = 0


@dataclass(eq=False)
class _Model:
    spec: ModelSpec
    engine: Engine
    executor: str
    path: Path
    options: LoadOptions
    """How its engine was loaded (a restart loads it the same way)."""
    placement: ex.Placement | None = None
    running: set[_Active] = field(default_factory=set)
    queue: list[_Active] = field(default_factory=list)
    keep_alive: float = DEFAULT_KEEP_ALIVE
    """Seconds it stays loaded once idle; negative: always."""
    last_used: float = field(default_factory=time.monotonic)
    """When it was loaded, or a request of it began or ended (monotonic)."""
    admitting: int = 0
    """Requests between admission and a slot or the queue: never unload under them."""
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

    @property
    def serving(self) -> bool:
        return self.failed is None and self.up is None and self.engine.dead is None


EngineFactory = Callable[[str, Path, LoadOptions, Notify, Callable[[Engine], None]], Engine]
"""(model name, GGUF path, options, notify, on_death) -> a loaded Engine."""


@dataclass(frozen=True, slots=True)
class _Died:
    """An engine process ended unasked (after its jobs' errors, on the same handoff)."""

    engine: Engine


class Supervisor:
    """Owns resident models and every active request. Start it with ``await tg.start(sup.run)``."""

    def __init__(
        self,
        registry: Registry,
        *,
        limits: Limits | None = None,
        auto_load: bool = True,
        audit: AuditLog | None = None,
        on_shutdown: Callable[[], None] | None = None,
        keep_alive: float = DEFAULT_KEEP_ALIVE,
        rpc: Sequence[str] = (),
        isolate: bool = True,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self.registry = registry
        self.isolate = isolate
        self.engine_factory = engine_factory
        """Makes every engine when set (tests: a fake engine, a real class)."""
        """Each model in an engine process of its own (the daemon); off: in this process
        (embedded mode), but for remote models."""
        self.engine_deaths: dict[tuple[str, str], int] = {}
        """Engine processes that died unasked, by (model, cause: SIGILL, exit, ...)."""
        self.cpu_kernels: cpukernels.Verdict | None = None
        self.rpc_hosts = tuple(dict.fromkeys([*rpc, *registry.rpc]))
        """Remote executors' RPC servers (--rpc and models.toml)."""
        self._remote: dict[str, list[ex.Executor] | str] = {}
        self._rpc_available: bool | None = None
        """Per RPC server: its executors, or why it cannot be reached."""
        self.keep_alive = keep_alive
        """Seconds an idle model stays loaded unless models.toml or a request says."""
        self.limits = limits or Limits()
        self.auto_load = auto_load
        self.audit = audit
        self.quotas = Quotas()
        self.observers: list[Callable[[Outcome], None]] = []
        """Called with every Generate request's Outcome (metrics)."""
        self._on_shutdown = on_shutdown
        self._models: dict[str, _Model] = {}
        self._loading: dict[str, anyio.Lock] = {}
        self._admission: dict[str, anyio.Lock] = {}
        self._active: dict[str, _Active] = {}
        self._executors: list[ex.Executor] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._outputs: Handoff[list[tuple[Job, Output]] | _Died] = Handoff()
        self._deaths: deque[Engine] = deque()
        self._deaths_due: anyio.Event | None = None
        self.hostname = socket.gethostname()
        self.http_address: str | None = None
        self.closing = False
        self._all_ended: anyio.Event | None = None
        """Set when the last request ends while ``close`` waits for them."""

    # ------------------------------------------------------------------ lifetime

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Serve until cancelled; then cancel every request and unload every model."""
        self._executors = await anyio.to_thread.run_sync(ex.discover)
        # Whether the CPU runs its extra kernels, before any model loads (a probe in a
        # child process the first time on this machine and build; then cached).
        self.cpu_kernels = await anyio.to_thread.run_sync(cpukernels.decide, paths.state_dir())
        from ..engine import rpc

        self._rpc_available = await anyio.to_thread.run_sync(rpc.available)
        await self._probe_remote()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._pump)
                tg.start_soon(self._watch_deaths)
                tg.start_soon(self._reap_idle)
                if self.rpc_hosts:
                    tg.start_soon(self._watch_remote)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self.close()

    CLOSE_WAIT_S = 10.0
    """How long ``close`` waits for requests still in admission to end."""

    async def close(self) -> None:
        """Cancel everything ("daemon shutting down") and unload all models; return once
        every request has had its terminal event (or after CLOSE_WAIT_S)."""
        self.closing = True
        for active in list(self._active.values()):
            self._cancel(active, "daemon shutting down")
        for name in list(self._models):
            await self._unload(name, "daemon shutting down")
        # A request still being admitted (tokenizing on a worker thread, or waiting for
        # the one ahead of it) ends when its admission finishes; the listeners close
        # their connections once this returns, so its Cancelled event must come first.
        if self._active:
            self._all_ended = anyio.Event()
            with anyio.move_on_after(self.CLOSE_WAIT_S):
                await self._all_ended.wait()

    # ------------------------------------------------------------------ dispatch

    async def handle(self, peer: Peer, request: Request) -> None:
        """Serve one request from ``peer``; every outcome is an event, never an exception."""
        rid = getattr(request, "request_id", "")
        try:
            if isinstance(request, Generate | Embed):
                await self._generate(peer, request)
            elif isinstance(request, DescribeFleet):
                peer.emit(FleetDescription(self.snapshot()))
            elif isinstance(request, Cancel):
                target = self._active.get(request.target)
                if target is None:
                    raise InvalidRequestError(f"no active request '{request.target}'")
                self._cancel(target, f"cancelled by request {request.request_id}")
                peer.emit(Done(rid))
            elif isinstance(request, Load):
                model = await self._ensure_loaded(request.model, peer, request.executor,
                                                  retry_failed=True)
                self._touch(model, request.keep_alive_ms)
                peer.emit(Done(rid))
            elif isinstance(request, Unload):
                if request.model not in self._models:
                    raise InvalidRequestError(f"model '{request.model}' is not loaded")
                await self._unload(request.model, f"model '{request.model}' unloaded")
                peer.emit(Done(rid))
            elif isinstance(request, Shutdown):
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
        """End ``request`` with Error for ``exc``: through _finish once it is active."""
        rid = getattr(request, "request_id", "")
        active = self._active.get(rid)
        if isinstance(request, Generate | Embed) and active is not None and active.peer is peer:
            if active.cancel_reason is not None:  # cancelled while admitting
                exc = RequestCancelledError(active.cancel_reason)
            self._finish(active, Error(rid, exc.kind, exc.message))
            return
        if not isinstance(request, Generate | Embed):
            peer.emit(Error(rid, exc.kind, exc.message))
            return
        # Refused before admission: the peer, metrics and the audit log still hear of it.
        limit = retry = None
        if isinstance(exc, RejectedError):
            limit, retry = exc.limit, exc.retry_after
        outcome = Outcome(request_id=rid, model=request.model, executor=None, kind=exc.kind,
                          finish_reason=None, principal=peer.principal.name, limit=limit,
                          retry_after_s=retry)
        peer.finished(outcome)
        peer.emit(Error(rid, exc.kind, exc.message))
        self._report(outcome, request)

    def disconnect(self, peer: Peer) -> None:
        """The peer went away: cancel all of its requests."""
        for active in list(self._active.values()):
            if active.peer is peer:
                self._cancel(active, "client disconnected")

    def inflight(self, peer: Peer) -> int:
        return sum(1 for a in self._active.values() if a.peer is peer)

    # ------------------------------------------------------------------ generate

    async def _generate(self, peer: Peer, req: Generate | Embed) -> None:
        rid = req.request_id
        if rid in self._active:
            peer.emit(Error(rid, ErrorKind.INVALID, f"request id '{rid}' is already active"))
            return
        if self.closing:
            raise RejectedError("daemon shutting down")
        if self.inflight(peer) >= self.limits.max_inflight:
            raise RejectedError(
                f"too many requests in flight on this connection ({self.limits.max_inflight})"
            )
        if _prompt_bytes(req) > self.limits.max_prompt_bytes:
            what = ("input" if isinstance(req, Embed) else
                    "prompt" if req.messages is None else "messages")
            raise InvalidRequestError(f"{what} longer than {self.limits.max_prompt_bytes} bytes")
        if (isinstance(req, Generate) and req.max_tokens is not None
                and req.max_tokens > self.limits.max_tokens):
            raise InvalidRequestError(f"max_tokens must be between 1 and {self.limits.max_tokens}")
        self._check_principal(peer, req)
        active = _Active(req=req, peer=peer, admitted=time.monotonic())
        self._active[rid] = active
        if req.deadline_ms is not None:
            # The scope exists before anything can finish the request, so _finish can
            # always cancel it: the deadline task never outlives its request.
            assert self._tg is not None
            active.deadline = anyio.CancelScope(
                deadline=anyio.current_time() + req.deadline_ms / 1000
            )
            self._tg.start_soon(self._deadline, active, active.deadline, req.deadline_ms)
        allow_load = self.auto_load and req.auto_load is not False
        spec = self._spec_for(req.model, peer)
        # Admission is FIFO per model (anyio locks are fair): requests queue in arrival order
        # even though loading and tokenizing yield to the event loop.
        async with self._admission.setdefault(spec.name, anyio.Lock()):
            await self._admit(peer, req, active, allow_load)

    def _check_principal(self, peer: Peer, req: Generate | Embed) -> None:
        """The principal's own limits: which models, how many at once, how fast."""
        principal = peer.principal
        limits = principal.limits
        if limits.models is not None:
            def canonical(name: str) -> str | None:
                try:
                    return self.registry.get(name).name
                except EverycycleError:
                    return None

            wanted = canonical(req.model)
            if wanted is None or wanted not in {canonical(m) for m in limits.models}:
                # The same words whether or not the model exists.
                raise InvalidRequestError(
                    f"model '{req.model}' is not available to key '{principal.name}'")
        inflight = sum(1 for a in self._active.values()
                       if a.peer.principal.name == principal.name)
        self.quotas.admit(principal, prompt_bytes=_prompt_bytes(req), inflight=inflight)

    async def _admit(self, peer: Peer, req: Generate | Embed, active: _Active,
                     allow_load: bool) -> None:
        rid = req.request_id
        model = await self._ensure_loaded(req.model, peer, None, allow_load=allow_load)
        active.model = model.spec.name
        self._touch(model, req.keep_alive_ms)
        model.admitting += 1  # (no await since it was found: the reaper cannot have it)
        try:
            job = await self._job_on(model, req, active)
        finally:
            model.admitting -= 1
        if active.cancel_reason is None and self._models.get(model.spec.name) is not model:
            active.cancel_reason = f"model '{model.spec.name}' unloaded"
        if active.cancel_reason is not None:
            self._finish(active, Error(rid, ErrorKind.CANCELLED, active.cancel_reason))
            return
        active.home = model
        active.job = job
        active.n_prompt = (sum(len(t) for t in job.embed_inputs) if job.embed_inputs is not None
                           else len(job.tokens))
        if model.queue or len(model.running) >= model.engine.parallel or not model.serving:
            if len(model.queue) >= self.limits.max_queue:
                raise RejectedError(f"queue full ({len(model.queue)} waiting)")
            model.queue.append(active)
            active.state = "queued"
            peer.emit(Accepted(rid, len(model.queue)))
        else:
            self._start(model, active)

    @staticmethod
    def _job(model: _Model, runner: Engine, req: Generate | Embed, active: _Active) -> Job:
        """The engine Job for ``req`` (on a worker thread: tokenizing, compiling a grammar).

        Raises InvalidRequestError for what cannot run: too long a prompt or input, a
        schema or grammar that does not compile.
        """
        if isinstance(req, Embed):
            inputs = [runner.tokenize(text, Format.RAW) for text in req.input]
            for i, tokens in enumerate(inputs):
                if len(tokens) > EMBED_MAX_TOKENS:
                    raise InvalidRequestError(
                        f"input[{i}] is {len(tokens)} tokens; at most {EMBED_MAX_TOKENS}")
            return Job(tokens=(), max_tokens=1, embed_inputs=inputs, tag=active)
        if req.messages is not None:
            tokens = runner.tokenize_chat(req.messages)
        else:
            assert req.prompt is not None
            tokens = runner.tokenize(req.prompt, req.format or model.spec.format)
        if len(tokens) >= runner.n_ctx_slot:
            raise InvalidRequestError(
                f"prompt is {len(tokens)} tokens; the context holds {runner.n_ctx_slot}"
            )
        grammar = req.grammar
        if req.json_schema is not None:
            grammar = schema_to_gbnf(req.json_schema)  # (its size checked)
        elif grammar is not None:
            check_grammar_size(grammar)
        if grammar is not None:
            runner.check_grammar(grammar)
        sampling = _sampling(req, model.spec.sampling, grammar)
        # On by default only where a draft's batch cannot change the output (the runner
        # checked at load); asked for explicitly, it runs regardless.
        lookup = (req.speculative if req.speculative is not None
                  else model.spec.speculative and runner.lookup_exact)
        return Job(tokens=tokens, max_tokens=req.max_tokens or runner.n_ctx_slot,
                   sampling=sampling, stop=req.stop or (), tag=active, lookup=lookup)

    def _start(self, model: _Model, active: _Active) -> None:
        assert active.job is not None
        active.state = "running"
        active.started = time.monotonic()
        model.running.add(active)
        active.peer.emit(Accepted(active.req.request_id, 0))
        try:
            model.engine.submit(active.job)
        except EverycycleError as exc:  # e.g. the engine thread died: this request ends here
            self._finish(active, Error(active.req.request_id, exc.kind, exc.message))

    async def _job_on(self, model: _Model, req: Generate | Embed, active: _Active) -> Job:
        """``_job`` on the model's engine once it serves; again on the restarted engine
        when it died meanwhile."""
        for attempt in range(3):
            await self._serving(model)
            engine = model.engine
            try:
                return await anyio.to_thread.run_sync(self._job, model, engine, req, active)
            except InternalError:
                if engine.dead is None or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _serving(self, model: _Model) -> None:
        """Return once ``model``'s engine serves. Raises InternalError when the model
        failed, RequestCancelledError when it was unloaded meanwhile."""
        while True:
            if self._models.get(model.spec.name) is not model:
                raise RequestCancelledError(f"model '{model.spec.name}' unloaded")
            if model.failed is not None:
                raise InternalError(model.failed)
            remote = model.placement is not None and model.placement.executor.remote
            if model.up is None and model.engine.exit_cause is not None and not remote:
                # It died and the supervisor has not heard yet (the death is on its way
                # through the handoff): its restart is a matter of time.
                model.up = anyio.Event()
            if model.up is None:
                return
            await model.up.wait()

    def _advance(self, model: _Model) -> None:
        """Start queued requests in freed slots, then tell the rest their new positions."""
        if not model.serving:
            return  # they wait for the restarted engine
        moved = False
        while model.queue and len(model.running) < model.engine.parallel:
            self._start(model, model.queue.pop(0))
            moved = True
        if moved:
            for i, waiting in enumerate(model.queue):
                waiting.peer.emit(Accepted(waiting.req.request_id, i + 1))

    @staticmethod
    def _touch(model: _Model, keep_alive_ms: int | None) -> None:
        """A request uses ``model`` now; its keep_alive, if any, holds from now on."""
        model.last_used = time.monotonic()
        if keep_alive_ms is not None:
            model.keep_alive = -1.0 if keep_alive_ms < 0 else keep_alive_ms / 1000

    @staticmethod
    def _idle_left(model: _Model, now: float) -> float | None:
        """Seconds until ``model`` is unloaded for being idle; None: busy, or never."""
        if (model.running or model.queue or model.admitting or model.keep_alive < 0
                or not model.serving):
            return None
        return model.last_used + model.keep_alive - now

    async def _reap_idle(self) -> None:
        """Unload each model idle for its keep_alive (never one with requests)."""
        while True:
            delay = 1.0
            for name, model in list(self._models.items()):
                left = self._idle_left(model, time.monotonic())
                if left is None:
                    continue
                if left <= 0 and self._models.get(name) is model:
                    log.info("unloading %s: idle for %gs", name, model.keep_alive)
                    await self._unload(name, f"model '{name}' unloaded: idle")
                else:
                    delay = min(delay, left)
            await anyio.sleep(max(0.02, delay))

    # ------------------------------------------------------------------ remote executors

    def _host_in_use(self, endpoint: str) -> _Model | None:
        return next((m for m in self._models.values() if m.placement is not None
                     and m.placement.executor.remote == endpoint), None)

    async def _probe_remote(self, *, only_down: bool = False) -> None:
        """Ask each RPC server not serving a model now for its devices (in a child
        process: ggml-rpc aborts the process that loses its server); with ``only_down``,
        just those last seen unreachable."""
        from ..engine import rpc

        for endpoint in self.rpc_hosts:
            if only_down and not isinstance(self._remote.get(endpoint), str):
                continue
            if self._host_in_use(endpoint) is not None:
                continue  # a ggml RPC server serves one client at a time
            try:
                found = await anyio.to_thread.run_sync(rpc.probe_in_child, endpoint)
            except EverycycleError as exc:
                if self._remote.get(endpoint) != exc.message:
                    log.warning("%s", exc.message)
                self._remote[endpoint] = exc.message
                continue
            name = rpc.executor_name(endpoint)
            self._remote[endpoint] = [
                ex.Executor(f"{name}/{d.index}", "remote",
                            (ex.Device(f"RPC{d.index}[{endpoint}]", endpoint, d.memory_total,
                                       d.memory_free, True),), remote=endpoint)
                for d in found]

    async def _watch_remote(self) -> None:
        """Hosts that were down: every 15 s; every host's memory: every 2 minutes."""
        for tick in itertools.count(1):
            await anyio.sleep(15)
            await self._probe_remote(only_down=tick % 8 != 0)

    def _all_executors(self) -> list[ex.Executor]:
        remote = [e for found in self._remote.values() if isinstance(found, list)
                  for e in found]
        local = [e for e in self._executors if e.name != "cpu"]
        return local + remote + [e for e in self._executors if e.name == "cpu"]

    def _executor_summaries(self) -> tuple[ExecutorSummary, ...]:
        rows = [ExecutorSummary(e.name, e.vendor, len(e.devices), e.memory_total,
                                e.memory_free) for e in self._executors if e.name != "cpu"]
        for endpoint in self.rpc_hosts:
            found = self._remote.get(endpoint)
            using = self._host_in_use(endpoint)
            dead = using is not None and using.engine.dead
            if isinstance(found, list):
                rows.extend(ExecutorSummary(e.name, e.vendor, len(e.devices), e.memory_total,
                                            e.memory_free,
                                            status="unreachable" if dead else None)
                            for e in found)
            else:
                rows.append(ExecutorSummary(f"rpc:{endpoint}", "remote", 0,
                                            status="unreachable"))
        rows.extend(ExecutorSummary(e.name, e.vendor, len(e.devices), e.memory_total,
                                    e.memory_free) for e in self._executors if e.name == "cpu")
        return tuple(rows)

    def _unload_in_ms(self, model: _Model) -> int | None:
        left = self._idle_left(model, time.monotonic())
        return None if left is None else max(0, int(left * 1000))

    async def _deadline(self, active: _Active, scope: anyio.CancelScope, ms: int) -> None:
        with scope:
            await anyio.sleep_forever()
        # Reached by the deadline, or by _finish cancelling the scope; then the request
        # is gone and _cancel does nothing.
        self._cancel(active, f"deadline of {ms} ms passed")

    def _cancel(self, active: _Active, reason: str) -> None:
        rid = active.req.request_id
        if self._active.get(rid) is not active:
            return
        if active.cancel_reason is None:
            active.cancel_reason = reason
        model = active.home
        if active.state == "running":
            if model is not None and active.job is not None:
                model.engine.cancel(active.job, reason)
        elif active.state == "queued" and model is not None:
            model.queue.remove(active)
            self._finish(active, Error(rid, ErrorKind.CANCELLED, reason))
            for i, waiting in enumerate(model.queue):
                waiting.peer.emit(Accepted(waiting.req.request_id, i + 1))
        # "admitting": checked once admission finishes.

    def _finish(self, active: _Active, event: ServerEvent, reason: str | None = None) -> None:
        """Send the one terminal event of ``active``, report its Outcome, and forget it.

        ``reason`` is the engine's finish reason (eos, stop, length, context) when the
        request finished; the peer hears the Outcome before the event.
        """
        rid = active.req.request_id
        if self._active.get(rid) is not active:
            return
        del self._active[rid]
        if not self._active and self._all_ended is not None:
            self._all_ended.set()
        if active.deadline is not None:
            active.deadline.cancel()
        model = active.home
        now = time.monotonic()
        if model is not None:
            model.running.discard(active)
            model.last_used = now
        started = active.started or now
        outcome = Outcome(
            request_id=rid,
            model=active.model or active.req.model,
            executor=model.executor if model else None,
            kind=event.kind if isinstance(event, Error) else None,
            finish_reason=reason,
            prompt_tokens=active.n_prompt,
            cached_tokens=active.job.n_reused if active.job else 0,
            generated_tokens=active.n_out,
            queue_wait_s=started - active.admitted,
            ttft_s=None if active.first_token is None else active.first_token - active.admitted,
            duration_s=now - active.admitted,
            principal=active.peer.principal.name,
        )
        active.peer.finished(outcome)
        active.peer.emit(event)
        self._report(outcome, active.req)

    def _observe(self, outcome: Outcome) -> None:
        for observe in self.observers:
            try:
                observe(outcome)
            except Exception:  # an observer's bug must not cost the request
                log.exception("outcome observer failed")

    def _report(self, outcome: Outcome, req: Generate | Embed) -> None:
        self._observe(outcome)
        if self.audit is not None:
            record: dict[str, Any] = {
                "request_id": outcome.request_id,
                "principal": outcome.principal,
                "model": outcome.model,
                "executor": outcome.executor,
                "prompt_tokens": outcome.prompt_tokens,
                "cached_tokens": outcome.cached_tokens,
                "output_tokens": outcome.generated_tokens,
                "queue_wait_ms": round(outcome.queue_wait_s * 1000, 1),
                "duration_ms": round(outcome.duration_s * 1000, 1),
                "outcome": outcome.kind.value if outcome.kind else "Finished",
            }
            if outcome.limit is not None:
                record["limit"] = outcome.limit
            if self.audit.include_prompts:
                record["prompt"] = (list(req.input) if isinstance(req, Embed) else
                                    req.prompt if req.messages is None else
                                    [[m.role.value, m.content] for m in req.messages])
            self.audit.write(record)

    # ------------------------------------------------------------------ engine outputs

    def _notify(self, batch: list[tuple[Job, Output]]) -> None:
        """Runs on a decode thread: queue the step's outputs for the event loop (never blocks)."""
        self._outputs.put(batch)

    def _engine_gone(self, engine: Engine) -> None:
        """Runs on an engine proxy's reader thread once its process died unasked."""
        self._outputs.put(_Died(engine))

    async def _pump(self) -> None:
        """Deliver the engines' step outputs (and deaths) on the event loop, in order."""
        await self._outputs.serve(self._on_item)

    def _on_item(self, item: list[tuple[Job, Output]] | _Died) -> None:
        if isinstance(item, _Died):
            # (Runs as a bare event-loop callback: a task does the rest.)
            self._deaths.append(item.engine)
            if self._deaths_due is not None:
                self._deaths_due.set()
        else:
            self._on_outputs(item)

    async def _watch_deaths(self) -> None:
        while True:
            self._deaths_due = anyio.Event()
            while self._deaths:
                self._on_death(self._deaths.popleft())
            await self._deaths_due.wait()

    CRASH_WINDOW_S = 60.0
    CRASH_LIMIT = 3
    """This many engine deaths within the window, and the model is marked failed."""
    RESTART_BACKOFF_S = 0.25
    """The first restart's delay; it doubles with each death in the window."""

    def _on_death(self, engine: Engine) -> None:
        """A model's engine process died: its running requests have had their errors;
        restart it with backoff (its queue waits), or after a crash loop mark it failed."""
        model = next((m for m in self._models.values() if m.engine is engine), None)
        if model is None or self._tg is None:
            return  # unloaded meanwhile, or the supervisor has stopped
        name = model.spec.name
        cause = engine.exit_cause or "ended"
        key = (name, cause.split(" ", 1)[0].rstrip(","))
        self.engine_deaths[key] = self.engine_deaths.get(key, 0) + 1
        model.last_exit = cause
        message = engine.dead or f"engine for {name} died: {cause}"
        log.error("%s", message)
        for active in list(model.running):  # (their errors normally came first)
            self._finish(active, Error(active.req.request_id, ErrorKind.INTERNAL, message))
        if model.placement is not None and model.placement.executor.remote:
            # Its host went away: the next request loads it again, or fails naming it.
            self._fail_queue(model, message)
            return
        self._count_death(model, cause)

    def _count_death(self, model: _Model, cause: str) -> None:
        now = time.monotonic()
        model.deaths = [t for t in model.deaths if now - t < self.CRASH_WINDOW_S] + [now]
        name = model.spec.name
        if len(model.deaths) >= self.CRASH_LIMIT:
            model.failed = (f"model '{name}' failed: its engine died {len(model.deaths)} times "
                            f"in {self.CRASH_WINDOW_S:g} s (last: {cause}); "
                            f"`everycycle load {name}` tries again")
            log.error("%s", model.failed)
            self._fail_queue(model, model.failed)
            if model.up is not None:
                model.up.set()
                model.up = None
            return
        if self.closing or self._tg is None:
            return
        if model.up is None:
            model.up = anyio.Event()
        delay = self.RESTART_BACKOFF_S * 2 ** (len(model.deaths) - 1)
        self._tg.start_soon(self._restart, model, delay)

    def _fail_queue(self, model: _Model, message: str) -> None:
        for active in list(model.queue):
            model.queue.remove(active)
            self._finish(active, Error(active.req.request_id, ErrorKind.INTERNAL, message))

    async def _restart(self, model: _Model, delay: float) -> None:
        await anyio.sleep(delay)
        name = model.spec.name
        if self._models.get(name) is not model or model.failed is not None:
            return
        log.info("restarting the engine for %s", name)
        try:
            engine = await anyio.to_thread.run_sync(self._spawn, model.spec, model.path,
                                                    model.options)
        except EverycycleError as exc:
            if self._models.get(name) is model and model.failed is None:
                model.last_exit = exc.message
                self._count_death(model, exc.message)
            return
        if self._models.get(name) is not model or model.failed is not None:
            await anyio.to_thread.run_sync(engine.close)
            return
        model.engine = engine
        model.restarts += 1
        up, model.up = model.up, None
        if up is not None:
            up.set()
        self._advance(model)

    def _count(self, active: _Active, event: Tokens) -> None:
        """Count the ids a client is sent: what usage, quotas and the audit log charge."""
        n = len(event.chunk.ids)
        if n:
            active.n_out += n
            self.quotas.generated(active.peer.principal, n)

    def _stream(self, active: _Active, event: Tokens) -> None:
        self._count(active, event)
        active.peer.emit(event)

    def _on_outputs(self, batch: list[tuple[Job, Output]]) -> None:
        freed: set[_Model] = set()
        for job, out in batch:
            active: _Active = job.tag
            rid = active.req.request_id
            if self._active.get(rid) is not active:
                continue
            if active.first_token is None and out.ids:
                active.first_token = time.monotonic()
            if not out.finished:
                self._stream(active, Tokens(rid, TokenChunk(out.text, out.ids), False))
                continue
            if active.home is not None:
                freed.add(active.home)
            if out.reason == "cancelled":
                reason = active.cancel_reason or "cancelled"
                self._finish(active, Error(rid, ErrorKind.CANCELLED, reason))
            elif out.reason == "error":
                msg = out.error.message if out.error else "generation failed"
                self._finish(active, Error(rid, out.error.kind if out.error
                                           else ErrorKind.INTERNAL, msg))
            elif out.embeddings is not None:
                vectors = tuple(tuple(v) for v in out.embeddings)
                self._finish(active, Embeddings(rid, vectors), out.reason)
            else:
                last = Tokens(rid, TokenChunk(out.text, out.ids), True)
                self._count(active, last)
                if isinstance(active.req, Generate) and active.req.usage:
                    active.peer.emit(Usage(rid, active.n_prompt, job.n_reused, active.n_out,
                                           out.reason or "eos"))
                self._finish(active, last, out.reason)
        for model in freed:
            if self._models.get(model.spec.name) is model:
                self._advance(model)

    # ------------------------------------------------------------------ models

    def _spec_for(self, name: str, peer: Peer) -> ModelSpec:
        if name in self.registry.models:
            return self.registry.get(name)
        if name.endswith(".gguf") and ("/" in name):
            if not peer.allow_paths:
                raise InvalidRequestError("model paths are not allowed on this connection")
            path = Path(name)
            if not path.is_absolute():
                raise InvalidRequestError("a model path must be absolute")
            try:
                owner = path.stat().st_uid
            except OSError as exc:
                raise InvalidRequestError(f"{path}: {exc.strerror}") from None
            if owner != os.getuid():
                raise InvalidRequestError(f"{path} belongs to another user")
            return ModelSpec(name=name, origin=path, path=path)
        return self.registry.get(name)

    async def _ensure_loaded(self, name: str, peer: Peer, executor: str | None,
                             *, allow_load: bool = True, retry_failed: bool = False) -> _Model:
        spec = self._spec_for(name, peer)
        model = self._models.get(spec.name)
        remote = model.placement.executor.remote if model and model.placement else None
        if model is not None and model.engine.dead and remote and model.failed is None:
            # Its remote host went away: load it again (or fail, naming the host).
            self._remote[remote] = str(model.engine.dead)
            await self._unload(spec.name, str(model.engine.dead))
            model = None
        if model is not None and model.failed is not None:
            if not retry_failed:
                raise InternalError(model.failed)
            log.info("loading %s again after it failed", spec.name)
            await self._unload(spec.name, model.failed)  # `load` clears the failed state
            model = None
        if model is not None:
            if executor is not None and executor != model.executor:
                raise InvalidRequestError(
                    f"model '{name}' is loaded on {model.executor}; unload it first"
                )
            return model
        if not allow_load:
            raise ModelNotLoadedError(f"model '{name}' is not loaded")
        lock = self._loading.setdefault(spec.name, anyio.Lock())
        async with lock:
            model = self._models.get(spec.name)
            if model is not None:
                return model
            if self.closing:
                raise RejectedError("daemon shutting down")
            model = await anyio.to_thread.run_sync(self._load_blocking, spec, executor)
            self._models[spec.name] = model
            log.info("loaded %s on %s", spec.name, model.executor)
            return model

    def _load_blocking(self, spec: ModelSpec, executor: str | None) -> _Model:
        path = local_file(spec, download=True)  # auto-pull a hub model (logged)
        need = plan(path, context=spec.context, parallel=spec.parallel,
                    kv_cache_type=spec.kv_cache_type)
        wanted = executor or spec.executor
        if wanted.startswith("rpc:"):
            down = self._remote.get(wanted.removeprefix("rpc:").rpartition("/")[0])
            if isinstance(down, str):
                raise InternalError(down)
        placement = ex.place(wanted, self._all_executors(), need, max_layers=spec.gpu_layers)
        offload = placement.offload
        remote = placement.executor.remote
        kernels = cpukernels.decide(paths.state_dir())
        common = LoadOptions(context=spec.context, parallel=spec.parallel,
                             n_threads=spec.threads, kv_cache_type=spec.kv_cache_type,
                             extra_bufts=kernels.extra)
        if remote is not None:
            holder = self._host_in_use(remote)
            if holder is not None:
                raise RejectedError(
                    f"RPC host {remote} is serving model '{holder.spec.name}'; a ggml RPC "
                    "server serves one model at a time: unload that one first")
            assert offload is not None
            device = int(placement.executor.name.rpartition("/")[2])
            options = replace(common, rpc_endpoints=(remote,), device_indices=(device,),
                              n_gpu_layers=offload.n_gpu_layers)
        else:
            options = replace(common, executor=placement.executor.name,
                              device_indices=(tuple(placement.device_indices)
                                              if offload is not None else ()),
                              n_gpu_layers=offload.n_gpu_layers if offload else 0,
                              tensor_split=tuple(offload.split) if offload else ())
        try:
            engine = self._spawn(spec, path, options)
        except InternalError as exc:
            if remote is not None:  # the host went away: fleet says so
                self._remote[remote] = exc.message
            raise
        keep = spec.keep_alive if spec.keep_alive is not None else self.keep_alive
        return _Model(spec=spec, engine=engine, executor=placement.name, path=path,
                      options=options, placement=placement, keep_alive=keep)

    def _spawn(self, spec: ModelSpec, path: Path, options: LoadOptions) -> Engine:
        """An engine for ``spec``: a process of its own (the daemon; and a remote model
        anywhere, since ggml-rpc aborts the process that loses its server), else a
        Runner in this process (embedded mode). Blocking: run it on a worker thread."""
        try:
            if self.engine_factory is not None:
                return self.engine_factory(spec.name, path, options, self._notify,
                                           self._engine_gone)
            if self.isolate or options.rpc_endpoints:
                from ..engine.process import EngineProcess

                return EngineProcess(path, options, notify=self._notify, label=spec.name,
                                     on_death=self._engine_gone)
            from ..engine.runner import Runner

            return Runner.load(path, options, self._notify)
        except EverycycleError:
            raise
        except Exception as exc:
            raise InternalError(f"loading {spec.name} failed: {exc}") from exc

    async def _unload(self, name: str, reason: str) -> None:
        model = self._models.pop(name, None)
        if model is None:
            return
        if model.up is not None:  # restarting: its waiters learn it is gone
            model.up.set()
            model.up = None
        for active in list(model.queue) + list(model.running):
            self._cancel(active, reason)
        await anyio.to_thread.run_sync(model.engine.close)
        # Running jobs end through the engine's cancelled outputs; any not delivered yet
        # end here (a late output for them is then ignored).
        for active in list(model.running):
            self._finish(active, Error(active.req.request_id, ErrorKind.CANCELLED, reason))

    # ------------------------------------------------------------------ fleet

    def snapshot(self) -> FleetSnapshot:
        """The live fleet: executors, resident models, active (running + queued) requests."""
        try:
            self._executors = ex.discover()
        except Exception:  # keep the last good view of the executors
            log.exception("executor discovery failed")
        return FleetSnapshot(
            hostname=self.hostname,
            executors=self._executor_summaries(),
            loaded_models=tuple(self._loaded(m) for m in self._models.values()),
            active_requests=len(self._active),
            http=self.http_address,
            daemon_rss=_rss_bytes(),
            principals=self._principal_loads(),
            rpc=self._rpc_available,
            requests=self._requests(),
            cpu_kernels=self.cpu_kernels.note if self.cpu_kernels else None,
        )

    def _requests(self) -> tuple[ActiveRequest, ...] | None:
        now = time.monotonic()
        shown = sorted(self._active.values(), key=lambda a: a.admitted)[:100]
        return tuple(ActiveRequest(a.req.request_id, a.model or a.req.model,
                                   a.peer.principal.name, a.state,
                                   int((now - a.admitted) * 1000), a.n_out)
                     for a in shown) or None

    def _loaded(self, m: _Model) -> LoadedModel:
        device_layers, total_layers = _device_layers(m)
        return LoadedModel(
            name=m.spec.name,
            revision=m.spec.revision,
            assigned_executor=m.executor,
            slots=m.engine.parallel,
            busy=len(m.running),
            queued=len(m.queue),
            weights_bytes=m.engine.weights_bytes,
            kv_bytes=m.engine.kv_bytes,
            device_layers=device_layers,
            total_layers=total_layers,
            unload_in_ms=self._unload_in_ms(m),
            lookup=m.spec.speculative and m.engine.lookup_exact,
            lookup_drafted=m.engine.lookup_drafted,
            lookup_accepted=m.engine.lookup_accepted,
            keep_alive_ms=-1 if m.keep_alive < 0 else int(m.keep_alive * 1000),
            engine_pid=m.engine.pid if m.engine.dead is None else None,
            engine_rss=m.engine.rss(),
            engine_restarts=m.restarts or None,
            engine_exit=m.last_exit,
            state=("failed" if m.failed is not None else "restarting" if m.up is not None
                   else None),
        )

    def _principal_loads(self) -> tuple[PrincipalLoad, ...] | None:
        counts: dict[str, int] = {}
        for active in self._active.values():
            name = active.peer.principal.name
            counts[name] = counts.get(name, 0) + 1
        if len(counts) < 2:
            return None
        return tuple(PrincipalLoad(n, c) for n, c in sorted(counts.items()))
