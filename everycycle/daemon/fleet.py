"""The live FleetSnapshot: executors, resident models, active requests.

Asking the hardware for free memory is not free (a GPU driver call per device): it
runs on a worker thread, never on the event loop, and its answer is reused for
``FRESH_S``, so a burst of ``fleet`` calls or ``/v1/models`` costs one query.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import anyio
import anyio.to_thread

from ..hardware import cpukernels
from ..protocol import ActiveRequest, DraftTokens, FleetSnapshot, LoadedModel, PrincipalLoad
from .active import Active
from .events import RequestState
from .lifecycle import Requests
from .lorascales import LoraScales
from .readiness import Readiness
from .residency import Residency, Resident

log = logging.getLogger(__name__)


def rss_bytes() -> int | None:
    """This process's resident set size (Linux: /proc; elsewhere unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _device_layers(model: Resident) -> tuple[int | None, int | None]:
    """(repeating layers on the executor's devices, layers): llama.cpp's own report
    when it made one, else the plan's; (None, None) on the CPU."""
    offload = model.placement.offload if model.placement else None
    if offload is None:
        return None, None
    if model.engine.offloaded is not None:
        on, total = model.engine.offloaded  # the output head counts as a layer there
        return min(on, total - 1), total - 1
    return offload.gpu_layers, offload.n_layer


class FleetView:
    """Builds snapshots from residency and the lifecycle; keeps the executors fresh."""

    FRESH_S = 1.0
    """How long one hardware query answers for."""

    def __init__(self, residency: Residency, requests: Requests,
                 lora_scales: LoraScales | None = None,
                 readiness: Readiness | None = None) -> None:
        self.residency = residency
        self.readiness = readiness
        self.requests = requests
        self.lora_scales = lora_scales or LoraScales()
        self.hostname = socket.gethostname()
        self.http_address: str | None = None
        self.rpc_available: bool | None = None
        self.cpu_kernels: cpukernels.Verdict | None = None
        self._queried = -1e9
        self._lock = anyio.Lock()

    async def refresh(self) -> None:
        """Query the executors again (on a worker thread) unless the last answer is
        fresh; concurrent callers share one query."""
        async with self._lock:
            if time.monotonic() - self._queried < self.FRESH_S:
                return
            try:
                await self.residency.measure()
            except Exception:  # keep the last good view of the executors
                log.exception("executor discovery failed")
            self._queried = time.monotonic()

    async def snapshot(self) -> FleetSnapshot:
        await self.refresh()
        return self.current()

    def current(self) -> FleetSnapshot:
        """The snapshot with the executors as last queried (no hardware query)."""
        residency = self.residency

        def dead(endpoint: str) -> bool:
            using = residency.host_in_use(endpoint)
            return using is not None and bool(using.engine.dead)

        return FleetSnapshot(
            hostname=self.hostname,
            executors=residency.remote.summaries(residency.local, dead),
            loaded_models=(*(self._loaded(m) for m in residency.models.values()),
                           *(LoadedModel(name, load.spec.revision, load.spec.executor,
                                         queued=load.waiters,
                                         state=residency.room_waits.why(name) or "loading",
                                         held_by=residency.room_waits.held_by(name))
                             for name, load in residency.loading.items()
                             if name not in residency.models)),
            active_requests=len(self.requests.active),
            http=self.http_address,
            daemon_rss=rss_bytes(),
            principals=self._principal_loads(),
            rpc=self.rpc_available,
            requests=self._requests(),
            cpu_kernels=self.cpu_kernels.note if self.cpu_kernels else None,
            last_eviction=(residency.last_eviction.describe()
                           if residency.last_eviction else None),
            state=self.readiness.state() if self.readiness is not None else None,
        )

    def _requests(self) -> tuple[ActiveRequest, ...] | None:
        now = time.monotonic()
        shown = sorted(self.requests.active.values(), key=lambda a: a.admitted)[:100]
        etas: dict[Active, int] = {}
        for name in {a.model for a in shown if a.state is RequestState.QUEUED}:
            model = self.residency.models.get(name)
            if model is not None and model.serving:
                etas.update(self.requests.estimates(self.requests.lane(name), model.engine))
        return tuple(ActiveRequest(a.req.request_id, a.model or a.req.model,
                                   a.peer.principal.name, a.state.value,
                                   int((now - a.admitted) * 1000), a.n_out, a.lane,
                                   etas.get(a))
                     for a in shown) or None

    def _loaded(self, m: Resident) -> LoadedModel:
        device_layers, total_layers = _device_layers(m)
        lane = self.requests.lane(m.name)
        left = self.residency.idle_left(m, time.monotonic())
        cache = m.engine.prompt_cache
        return LoadedModel(
            name=m.name,
            revision=m.spec.revision,
            assigned_executor=m.executor,
            slots=m.engine.parallel,
            busy=lane.decoding,
            queued=len(lane.queue),
            weights_bytes=m.engine.weights_bytes,
            kv_bytes=m.engine.kv_bytes,
            device_layers=device_layers,
            total_layers=total_layers,
            unload_in_ms=None if left is None else max(0, int(left * 1000)),
            lookup=m.spec.speculative and m.engine.lookup_exact,
            drafts=tuple(DraftTokens(c.method, c.drafted, c.accepted)
                         for c in m.engine.draft_counts),
            images_encoded=m.engine.images_encoded if m.options.mmproj else None,
            draft_model=m.options.draft_name or None,
            keep_alive_ms=-1 if m.keep_alive < 0 else int(m.keep_alive * 1000),
            engine_pid=m.engine.pid if m.engine.dead is None else None,
            engine_rss=m.engine.rss(),
            engine_restarts=m.restarts or None,
            engine_exit=m.last_exit,
            prompt_cache_bytes=cache.ram_bytes if cache else None,
            prompt_cache_hits=cache.hits if cache else None,
            prompt_cache_evictions=cache.evictions if cache else None,
            state=("failed" if m.failed is not None else "restarting" if m.up is not None
                   else None),
            context=m.options.context,
            lora=tuple(f"{a.name}@{scale:g}" for a, scale in zip(
                m.spec.lora, self.lora_scales.of(m.spec), strict=True)) or None,
        )

    def _principal_loads(self) -> tuple[PrincipalLoad, ...] | None:
        counts: dict[str, int] = {}
        for active in self.requests.active.values():
            name = active.peer.principal.name
            counts[name] = counts.get(name, 0) + 1
        if len(counts) < 2:
            return None
        return tuple(PrincipalLoad(n, c) for n, c in sorted(counts.items()))
