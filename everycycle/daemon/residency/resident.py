"""Residency: which models are loaded where, loading (one at a time per model),
unloading, idle unloading, and engines that die (restart with backoff; a crash loop
marks the model failed until ``load``).

A model's requests live in the lifecycle's lanes (``Requests``), by model name: this
module asks them whether a model is busy and tells them when its engine goes or
comes back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread

from ...engine.host.contract import Engine, LoadOptions, Notify
from ...errors import (
    ErrorKind,
    EverycycleError,
    InternalError,
    InvalidRequestError,
    ModelNotLoadedError,
    RejectedError,
    RequestCancelledError,
)
from ...hardware import executors as ex
from ...hardware.memory import plan
from ...models import lookup
from ...models.registry import ModelSpec, Registry, local_file, side_files
from .. import events
from ..eta import LoadTimes
from ..lifecycle import Requests
from . import room
from .loaded import Loading, Resident
from .remote import RemoteHosts

log = logging.getLogger(__name__)

EngineFactory = Callable[[str, Path, LoadOptions, Notify, Callable[[Engine], None]], Engine]
"""(model name, GGUF path, options, notify, on_death) -> a loaded Engine."""


class Residency:
    """The resident models. Their engines' outputs go to ``notify``; a death comes
    back through ``on_death`` (from the engine's thread) and then ``died`` (on the
    event loop)."""

    CRASH_WINDOW_S = 60.0
    CRASH_LIMIT = 3
    """This many engine deaths within the window, and the model is marked failed."""
    RESTART_BACKOFF_S = 0.25
    """The first restart's delay; it doubles with each death in the window."""

    def __init__(self, registry: Registry, requests: Requests, remote: RemoteHosts, *,
                 notify: Notify, on_death: Callable[[Engine], None], isolate: bool,
                 engine_factory: EngineFactory | None, keep_alive: float,
                 max_loaded_models: int | None = None,
                 hang_after: float = 60.0, room_waits: room.RoomWaits | None = None
                 ) -> None:
        self.registry = registry
        """The registry in use (the supervisor's, read again when a name is new)."""
        self.requests = requests
        self.remote = remote
        self._notify = notify
        self._on_death = on_death
        self.isolate = isolate
        """Each model in an engine process of its own (the daemon); off: in this process
        (embedded mode), but for remote models."""
        self.engine_factory = engine_factory
        """Makes every engine when set (tests: a fake engine, a real class)."""
        self.keep_alive = keep_alive
        self.hang_after = hang_after
        """An engine process with work in hand and no progress this long is hung."""
        self.models: dict[str, Resident] = {}
        self.local: list[ex.Executor] = []
        """This machine's executors, as last discovered."""
        self.engine_deaths: dict[tuple[str, str], int] = {}
        """Engine processes that died unasked, by (model, cause: SIGILL, exit, ...)."""
        self.loading: dict[str, Loading] = {}
        """Loads under way, by model name: whoever asks for one of these waits for it."""
        self.loads = 0
        """Loads attempted (each model's load runs once, however many ask)."""
        self.load_times = LoadTimes()
        self.room_waits = room_waits or room.RoomWaits()
        self.max_loaded_models = max_loaded_models
        """At most this many resident; None: as many as memory holds."""
        self.publish: Callable[[events.DaemonEvent], None] = lambda event: None
        """Where what happens here is told (the supervisor's bus)."""
        self.changed: Callable[[float], Awaitable[None]] = anyio.sleep  # (Bus.changed)
        self.evictions: dict[str, int] = {}
        """Models unloaded to make room for another, by reason (memory, max_loaded_models)."""
        self.last_eviction: room.Eviction | None = None
        self._turns: dict[str, anyio.Lock] = {}
        """One lock for this machine's loads (key ""), one per RPC host."""
        self.tasks = requests.tasks
        """The supervisor's task group, as the requests have it."""
        self._reckon: anyio.Event | None = None
        """Set when a model's idle clock changes: the reaper reckons again."""
        self.closing = False

    def host_in_use(self, endpoint: str) -> Resident | None:
        return next((m for m in self.models.values() if m.remote == endpoint), None)

    def spec_for(self, name: str, *, allow_paths: bool) -> ModelSpec:
        """The registry's entry for ``name``, an entry for a model in another tool's
        store (``ollama:…``), or one for an absolute GGUF path of this user's (where
        the connection may name paths). Raises InvalidRequestError."""
        return lookup.spec_for(self.registry, name, allow_paths=allow_paths)

    # ------------------------------------------------------------------ loading

    async def ensure_loaded(self, spec: ModelSpec, executor: str | None, *,
                            allow_load: bool = True, retry_failed: bool = False) -> Resident:
        """``spec``'s resident model, loading it if need be (once, however many ask)."""
        model = self.models.get(spec.name)
        if model is not None and model.engine.dead and model.remote and model.failed is None:
            # Its remote host went away: load it again (or fail, naming the host).
            self.remote.mark_down(model.remote, str(model.engine.dead))
            await self.unload(spec.name, str(model.engine.dead), "gone")
            model = None
        if model is not None and model.failed is not None:
            if not retry_failed:
                raise InternalError(model.failed)
            log.info("loading %s again after it failed", spec.name)
            await self.unload(spec.name, model.failed, "failed")  # (`load` clears it)
            model = None
        if model is not None:
            if executor is not None and executor != model.executor:
                raise InvalidRequestError(
                    f"model '{spec.name}' is loaded on {model.executor}; unload it first")
            return model
        if not allow_load:
            raise ModelNotLoadedError(f"model '{spec.name}' is not loaded")
        if self.closing:
            raise RejectedError("daemon shutting down")
        attempt = self.loading.get(spec.name)
        if attempt is None:  # the first to ask loads it; the rest wait for that load
            if not self.tasks.running:
                raise RejectedError("daemon shutting down")
            attempt = self.loading[spec.name] = Loading(spec)
            self.tasks.start_soon(self._load, attempt, executor)
        attempt.waiters += 1
        try:
            await attempt.done.wait()
        finally:
            attempt.waiters -= 1
        if attempt.error is not None:
            raise attempt.error  # every waiter of a failed load hears the same
        assert attempt.model is not None
        return attempt.model

    async def reload(self, spec: ModelSpec, reason: str) -> None:
        """Unload ``spec``'s model and load it again as ``spec`` says (waiters of the
        model from now on wait for this load: it is registered before the unload)."""
        model = self.models.get(spec.name)
        if model is None or spec.name in self.loading:
            return
        attempt = self.loading[spec.name] = Loading(spec)
        await self.unload(spec.name, reason, "reload")
        self.tasks.start_soon(self._load, attempt, model.executor)

    async def _load(self, attempt: Loading, executor: str | None) -> None:
        """Load ``attempt``'s model and tell its waiters."""
        name = attempt.spec.name
        try:
            model = await self._load_model(attempt.spec, executor)
        except EverycycleError as exc:
            attempt.error = exc
        except Exception as exc:  # a bug must cost this load, never the daemon
            log.exception("loading %s failed", name)
            attempt.error = InternalError(f"loading {name} failed: {exc}")
        else:
            if self.closing:
                await anyio.to_thread.run_sync(model.engine.close)
                attempt.error = RejectedError("daemon shutting down")
            else:
                self.models[name] = attempt.model = model
                log.info("loaded %s on %s", name, model.executor)
                self.publish(events.ModelLoaded(model=name, executor=model.executor))
        finally:
            if attempt.model is None and attempt.error is None:  # cancelled: shutting down
                attempt.error = RejectedError("daemon shutting down")
            self.loads += 1
            del self.loading[name]
            attempt.done.set()

    def load_left(self, spec: ModelSpec) -> float | None:
        """Seconds until ``spec``'s load (under way, or about to be) should end: its
        measured load time (or, never loaded here, its file's size at the rate loads
        went) less what has passed; None when nothing measured says."""
        attempt = self.loading.get(spec.name)
        size = attempt.size if attempt is not None else None
        if size is None and spec.path is not None:
            with contextlib.suppress(OSError):
                size = spec.path.stat().st_size
        expected = self.load_times.expected(spec.name, size)
        if expected is None or attempt is None or attempt.starting is None:
            return expected
        return max(0.0, expected - (time.monotonic() - attempt.starting))

    async def _load_model(self, spec: ModelSpec, executor: str | None) -> Resident:
        """Download if need be, make room, place and start ``spec``'s engine. Loads on
        this machine take turns (they share its host memory, and one GPU can be two
        executors: cuda and vulkan): each measures after the last one's memory is
        taken. Loads on different RPC hosts proceed in parallel."""
        # (an auto-pulled hub model's download is logged)
        path = await anyio.to_thread.run_sync(lambda: local_file(spec, download=True))
        beside = room.Beside(
            await anyio.to_thread.run_sync(lambda: side_files(spec, download=True)),
            await anyio.to_thread.run_sync(
                lambda: lookup.draft_file(self.registry, spec, download=True)))
        wanted = ex.Wanted.parse(executor or spec.executor)
        # (the context chosen now stays the model's for its residency: spec carries it)
        context = await room.context_for(self, spec, path, wanted)
        spec = replace(spec, context=context)
        need = beside.need(plan(path, context=context, parallel=spec.parallel,
                                kv_cache_type=spec.kv_cache_type), spec)
        key = wanted.rpc_host or ""
        if key:
            down = self.remote.down(key)
            if down is not None:
                raise InternalError(down)
        attempt = self.loading.get(spec.name)
        if attempt is not None:
            attempt.size = need.weights
        async with self._turns.setdefault(key, anyio.Lock()):
            placement = await room.make_room(self, spec, need, wanted)
            started = time.monotonic()
            if attempt is not None:
                attempt.starting = started
            try:
                engine, placement, options = await room.start(
                    self, spec, path, need, wanted, placement, beside)
                self.load_times.observe(spec.name, need.weights, time.monotonic() - started)
            except InternalError as exc:
                if placement.executor.remote is not None:  # the host went away: fleet says so
                    self.remote.mark_down(placement.executor.remote, exc.message)
                raise
        keep = spec.keep_alive if spec.keep_alive is not None else self.keep_alive
        return Resident(spec=spec, engine=engine, executor=placement.name, path=path,
                        options=options, placement=placement, keep_alive=keep, need=need)

    async def measure(self) -> list[ex.Executor]:
        """This machine's executors and their free memory now (a hardware query, on a
        worker thread); kept as ``local`` for the fleet."""
        held = room.held_by_all(self.models.values())
        self.local = await anyio.to_thread.run_sync(ex.discover, held)
        return self.local

    async def evict(self, model: Resident, for_model: str, reason: str) -> None:
        idle = time.monotonic() - model.last_used
        log.info("unloading %s (idle %.0f s) to make room for %s (%s)", model.name, idle,
                 for_model, reason)
        self.evictions[reason] = self.evictions.get(reason, 0) + 1
        self.last_eviction = room.Eviction(model.name, for_model, reason, idle, time.time())
        self.publish(events.ModelEvicted(model=model.name, for_model=for_model, reason=reason,
                                  idle_s=round(idle, 3)))
        await self.unload(model.name, f"model '{model.name}' unloaded to make room for "
                                      f"'{for_model}'", "evicted")

    def spawn(self, spec: ModelSpec, path: Path, options: LoadOptions) -> Engine:
        """An engine for ``spec``: a process of its own (the daemon; and a remote model
        anywhere, since ggml-rpc aborts the process that loses its server), else a
        Runner in this process (embedded mode). Blocking: run it on a worker thread."""
        try:
            if self.engine_factory is not None:
                return self.engine_factory(spec.name, path, options, self._notify,
                                           self._on_death)
            if self.isolate or options.rpc_endpoints:
                from ...engine.host.process import EngineProcess

                return EngineProcess(path, options, notify=self._notify, label=spec.name,
                                     on_death=self._on_death, hang_after=self.hang_after,
                                     readable=self.tasks.readable)
            from ...engine.worker.runner import Runner

            return Runner.load(path, options, self._notify)
        except EverycycleError:
            raise
        except Exception as exc:
            raise InternalError(f"loading {spec.name} failed: {exc}") from exc

    async def unload(self, name: str, reason: str, why: str = "unload") -> None:
        """Cancel ``name``'s requests (with ``reason``) and release it (``why``, a word:
        unload, idle, evicted, shutdown, gone, failed)."""
        model = self.models.pop(name, None)
        if model is None:
            return
        self.publish(events.ModelUnloaded(model=name, why=why, message=reason))
        if model.up is not None:  # restarting: its waiters learn it is gone
            model.up.set()
            model.up = None
        self.requests.cancel_model(name, events.Cancelled(
            events.CancelCause.SHUTDOWN if why == "shutdown" else events.CancelCause.UNLOAD,
            reason))
        await anyio.to_thread.run_sync(model.engine.close)
        # Running jobs end through the engine's cancelled outputs; any not delivered yet
        # end here (a late output for them is then ignored).
        self.requests.end_running(name, ErrorKind.CANCELLED, reason, model.engine)

    async def serving(self, model: Resident) -> None:
        """Return once ``model``'s engine serves. Raises InternalError when the model
        failed, RequestCancelledError when it was unloaded meanwhile."""
        while True:
            if self.models.get(model.name) is not model:
                raise RequestCancelledError(f"model '{model.name}' unloaded")
            if model.failed is not None:
                raise InternalError(model.failed)
            if model.up is None and model.engine.exit_cause is not None and not model.remote:
                # It died and the supervisor has not heard yet (the death is on its way
                # through the handoff): its restart is a matter of time.
                model.up = anyio.Event()
            if model.up is None:
                return
            await model.up.wait()

    # ------------------------------------------------------------------ idle

    def touch(self, model: Resident, keep_alive_ms: int | None = None) -> None:
        """A request of ``model`` begins or ends now (its keep_alive, if given, holds
        from now on): its idle clock starts again, and the reaper reckons with it."""
        model.touch(keep_alive_ms)
        if self._reckon is not None:
            self._reckon.set()

    def idle_left(self, model: Resident, now: float) -> float | None:
        """Seconds until ``model`` is unloaded for being idle; None: busy, or never."""
        if self.requests.busy(model.name) or model.keep_alive < 0 or not model.serving:
            return None
        return model.last_used + model.keep_alive - now

    async def reap_idle(self) -> None:
        """Unload each model idle for its keep_alive (never one with requests), when it
        is due: the reaper sleeps until the next model is, or until one is touched."""
        while True:
            self._reckon = anyio.Event()
            delay = 1.0  # a restart or a failure ends a model's busy state untouched
            for name, model in list(self.models.items()):
                left = self.idle_left(model, time.monotonic())
                if left is None:
                    continue
                if left <= 0 and self.models.get(name) is model:
                    log.info("unloading %s: idle for %gs", name, model.keep_alive)
                    await self.unload(name, f"model '{name}' unloaded: idle", "idle")
                else:
                    delay = min(delay, left)
            with anyio.move_on_after(max(0.02, delay)):
                await self._reckon.wait()

    # ------------------------------------------------------------------ deaths

    async def watch_deaths(self, deaths: deque[Engine], due: Callable[[], anyio.Event]
                           ) -> None:
        """Handle each engine death ``deaths`` receives; ``due()`` is set on arrival."""
        while True:
            event = due()
            while deaths:
                self.died(deaths.popleft())
            await event.wait()

    def died(self, engine: Engine) -> None:
        """A model's engine process died: its running requests have had their errors;
        restart it with backoff (its queue waits), or after a crash loop mark it failed."""
        model = next((m for m in self.models.values() if m.engine is engine), None)
        if model is None or not self.tasks.running:
            return  # unloaded meanwhile, or the supervisor has stopped
        name = model.name
        cause = engine.exit_cause or "ended"
        key = (name, cause.split(" ", 1)[0].rstrip(","))
        self.engine_deaths[key] = self.engine_deaths.get(key, 0) + 1
        model.last_exit = cause
        message = engine.dead or f"engine for {name} died: {cause}"
        log.error("%s", message)
        self.publish(events.EngineDied(model=name, cause=cause, message=message))
        # (Their errors normally came first.)
        self.requests.end_running(name, ErrorKind.INTERNAL, message, engine)
        if model.remote:
            # Its host went away: the next request loads it again, or fails naming it.
            self.requests.fail_queue(name, message)
            return
        self._count_death(model, cause)

    def _count_death(self, model: Resident, cause: str) -> None:
        now = time.monotonic()
        model.deaths = [t for t in model.deaths if now - t < self.CRASH_WINDOW_S] + [now]
        name = model.name
        if len(model.deaths) >= self.CRASH_LIMIT:
            model.failed = (f"model '{name}' failed: its engine died {len(model.deaths)} times "
                            f"in {self.CRASH_WINDOW_S:g} s (last: {cause}); "
                            f"`everycycle load {name}` tries again")
            log.error("%s", model.failed)
            self.requests.fail_queue(name, model.failed)
            if model.up is not None:
                model.up.set()
                model.up = None
            return
        if self.closing or not self.tasks.running:
            return
        if model.up is None:
            model.up = anyio.Event()
        delay = self.RESTART_BACKOFF_S * 2 ** (len(model.deaths) - 1)
        self.tasks.start_soon(self._restart, model, delay)

    async def _restart(self, model: Resident, delay: float) -> None:
        await anyio.sleep(delay)
        name = model.name
        if self.models.get(name) is not model or model.failed is not None:
            return
        log.info("restarting the engine for %s", name)
        try:
            engine = await anyio.to_thread.run_sync(self.spawn, model.spec, model.path,
                                                    model.options)
        except EverycycleError as exc:
            if self.models.get(name) is model and model.failed is None:
                model.last_exit = exc.message
                self._count_death(model, exc.message)
            return
        if self.models.get(name) is not model or model.failed is not None:
            await anyio.to_thread.run_sync(engine.close)
            return
        model.engine = engine
        model.restarts += 1
        self.publish(events.EngineRestarted(model=name, restarts=model.restarts, pid=engine.pid))
        up, model.up = model.up, None
        if up is not None:
            up.set()
        self.requests.advance(name, engine)
