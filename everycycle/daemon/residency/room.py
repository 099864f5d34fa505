"""Making room for a model: what the resident models hold on each executor, which of
them may go (idle, least recently used first), and what to say when none may; and
starting it, again on fewer GPU layers when llama.cpp cannot allocate what the fit chose.

A load that needs memory held by busy models waits (``RoomWaits``) instead of being
refused: it is refused only when nothing could ever make room (the holders are pinned,
or it does not fit at all) or when nobody waits for it any more. So that it gets its
turn, a model it has waited on for ``SWAP_AFTER_S`` (resident for at least
``MIN_RESIDENCY_S``) takes no new requests until the load is done: it finishes those it
has, goes idle and makes room; its newcomers then wait for it to load again.

The residency measures, unloads and loads; this decides. It sees the residency only
through ``Host``: the members it reads and the steps it asks for, declared here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.to_thread

from ... import paths
from ...engine.host.contract import Engine, LoadOptions
from ...engine.kvcache import promptcache
from ...errors import AllocationError, EverycycleError, RejectedError, RequestCancelledError
from ...hardware import cpukernels
from ...hardware import executors as ex
from ...hardware.memory import MemoryPlan, fit_context, plan, trained_context
from ...models import adapters
from ...models.registry import ModelSpec
from ..events import DaemonEvent, RequestInput, RoomWait
from .remote import in_order

if TYPE_CHECKING:
    from ..active import Active
    from ..lifecycle import Requests
    from .loaded import Loading, Resident
    from .remote import RemoteHosts

log = logging.getLogger("everycycle.daemon.residency")

SWAP_AFTER_S = 2.0
"""How long a load waits for busy models before they stop taking new requests."""
MIN_RESIDENCY_S = 2.0
"""How long a model stays resident, taking requests, before it gives way to a load."""
WAKE_S = 1.0
"""A wait for room looks again when an event is published (a request ended, a model
went), or after this long at most (a count that went down without an event)."""


class Host(Protocol):
    """What making room reads of the residency, and asks it to do."""

    models: dict[str, Resident]
    loading: dict[str, Loading]
    max_loaded_models: int | None
    room_waits: RoomWaits
    requests: Requests
    remote: RemoteHosts

    changed: Callable[[float], Awaitable[None]]
    """Returns once something is published, or the seconds pass (``Bus.changed``)."""

    def publish(self, event: DaemonEvent) -> None: ...

    async def measure(self) -> list[ex.Executor]:
        """This machine's executors and their free memory, now."""

    async def evict(self, model: Resident, for_model: str, reason: str) -> None:
        """Unload ``model`` to make room for ``for_model``."""


    def host_in_use(self, endpoint: str) -> Resident | None:
        """The model an RPC host serves now, if any."""

    def spawn(self, spec: ModelSpec, path: Path, options: LoadOptions) -> Engine:
        """Start ``spec``'s engine (blocking: on a worker thread)."""


@dataclass
class RoomWaits:
    """The loads waiting for memory that busy models hold, since when, and why."""

    swap_after: float = SWAP_AFTER_S
    min_residency: float = MIN_RESIDENCY_S
    waiting: dict[str, tuple[float, str, frozenset[str]]] = field(default_factory=dict)
    """Each waiting load: since when, who holds the memory (``'b' (300 MiB, busy)``),
    and the busy models it waits on."""
    total: dict[str, float] = field(default_factory=dict)
    """Seconds each model's loads have waited, in all (``/metrics``)."""

    def why(self, name: str) -> str | None:
        """``waiting for memory: held by 'b' (300 MiB, busy)``, while ``name`` waits."""
        found = self.waiting.get(name)
        return f"waiting for memory: held by {found[1]}" if found else None

    def held_by(self, name: str) -> str | None:
        """Who holds the memory ``name``'s load waits for, while it waits."""
        found = self.waiting.get(name)
        return found[1] if found else None

    def yields(self, model: Resident, now: float) -> bool:
        """Whether ``model`` gives way: a load has waited on it long enough, and it has
        been resident long enough not to thrash."""
        return now - model.loaded >= self.min_residency and any(
            model.name in on and now - since >= self.swap_after
            for since, _, on in self.waiting.values())


def held(model: Resident) -> dict[str, int]:
    """Bytes ``model`` is counted as holding, by executor name: its devices' share on
    its GPU executor, the rest on the host (``cpu``)."""
    need: MemoryPlan | None = model.need
    if need is None or model.remote is not None:
        return {}
    cache = model.engine.prompt_cache
    cached = cache.ram_bytes if cache is not None else 0  # (host RAM, like any model's)
    offload = model.placement.offload if model.placement is not None else None
    if offload is None:
        return {"cpu": need.total + cached}
    assert model.placement is not None
    return {model.placement.executor.name: sum(offload.device_bytes),
            "cpu": offload.cpu_bytes + cached}


def held_by_all(models: Iterable[Resident]) -> dict[str, int]:
    """What the resident models hold, by executor name."""
    total: dict[str, int] = {}
    for m in models:
        for name, n in held(m).items():
            total[name] = total.get(name, 0) + n
    return total


async def shrink_caches(res: Host) -> int:
    """Have every resident model give back its prompt cache's RAM; the bytes."""
    freed = 0
    for m in list(res.models.values()):
        if m.engine.prompt_cache is not None and m.engine.dead is None:
            with contextlib.suppress(EverycycleError):
                freed += await anyio.to_thread.run_sync(m.engine.drop_prompt_cache)
    if freed:
        log.info("prompt caches gave back %d MiB of RAM for a load", freed >> 20)
    return freed


def why_kept(model: Resident, busy: Callable[[str], bool]) -> str | None:
    """Why ``model`` may not be unloaded to make room (None: it may)."""
    if model.remote is not None:
        return "on an RPC host"
    if busy(model.name):
        return "busy"
    if model.spec.pin or model.keep_alive < 0:
        return "pinned"
    if model.up is not None:
        return "restarting"
    return None


def victim(models: Iterable[Resident], busy: Callable[[str], bool],
           on: str | None = None) -> Resident | None:
    """The least recently used model that may go; with ``on``, only one holding memory
    on that executor."""
    free_to_go = [m for m in models if why_kept(m, busy) is None
                  and (on is None or held(m).get(on))]
    return min(free_to_go, key=lambda m: m.last_used, default=None)


def holders(models: Iterable[Resident], busy: Callable[[str], bool]) -> str:
    """The resident models and why each stays: ``'a' (300 MiB, busy), 'b' (pinned)``."""
    parts = []
    for m in models:
        size = sum(held(m).values())
        reason = why_kept(m, busy) or "idle"
        parts.append(f"'{m.name}' ({size / (1 << 20):.0f} MiB, {reason})" if size
                     else f"'{m.name}' ({reason})")
    return ", ".join(parts) or "nothing of ours"


def _transient(models: Iterable[Resident], busy: Callable[[str], bool], on: str | None
               ) -> frozenset[str]:
    """Those of ``models`` (holding memory on ``on``) that stay only for now: busy or
    restarting, neither pinned nor on an RPC host."""
    return frozenset(m.name for m in models
                     if why_kept(m, busy) in ("busy", "restarting") and not m.spec.pin
                     and m.keep_alive >= 0 and (on is None or held(m).get(on)))


def _short(placement: ex.Placement, spec: ModelSpec) -> bool:
    """Whether ``placement`` puts fewer of the model's layers on its GPU than it could
    (than all of them, or models.toml's ``gpu_layers``)."""
    offload = placement.offload
    if offload is None or offload.full:
        return False
    return spec.gpu_layers is None or offload.gpu_layers < min(spec.gpu_layers,
                                                               offload.n_layer)


async def make_room(res: Host, spec: ModelSpec, need: MemoryPlan, wanted: ex.Wanted
                    ) -> ex.Placement:
    """Where ``spec`` goes, after unloading idle models (least recently used first)
    while it does not fit, or gets fewer GPU layers than it could, or the daemon
    holds ``max_loaded_models``; waiting while only busy models could make room.
    Raises RejectedError naming what holds the memory when nothing ever could, and
    RequestCancelledError when nobody waits for the load any more."""
    outcome = "gave up"
    try:
        placement = await _make_room(res, spec, need, wanted)
        outcome = "placed"
        return placement
    finally:
        waited = res.room_waits.waiting.pop(spec.name, None)
        if waited is not None:  # the policy's decision, for the audit and /metrics
            seconds = time.monotonic() - waited[0]
            waits = res.room_waits.total
            waits[spec.name] = waits.get(spec.name, 0.0) + seconds
            res.publish(RoomWait(model=spec.name, waited_s=round(seconds, 3),
                                 outcome=outcome, held_by=waited[1]))


async def _make_room(res: Host, spec: ModelSpec, need: MemoryPlan, wanted: ex.Wanted
                     ) -> ex.Placement:
    busy = res.requests.busy
    shrunk = False
    while True:
        local = await res.measure()
        refusal: RejectedError | None = None
        placement: ex.Placement | None = None
        try:
            placement = ex.place(wanted, in_order(local, res.remote.executors()),
                                 need, max_layers=spec.gpu_layers)
        except RejectedError as exc:
            refusal = exc
        residents = [m for m in res.models.values() if m.name != spec.name]
        full = res.max_loaded_models is not None and \
            len(residents) >= res.max_loaded_models
        if placement is not None and placement.executor.remote is not None and not full:
            return placement  # an RPC host serves one model: nothing to make room on
        if full:
            reason, on = "max_loaded_models", None
        elif refusal is not None:
            if wanted.rpc_host is not None:
                raise refusal
            reason, on = "memory", None if wanted.auto else wanted.name
        elif placement is not None and _short(placement, spec):
            reason, on = "memory", placement.executor.name
        else:
            assert placement is not None
            return placement
        if reason == "memory" and on in (None, "cpu") and not shrunk:
            shrunk = True  # prompt caches give way before any model does
            if await shrink_caches(res) > 0:
                continue
        going = victim(residents, busy, on)
        holding = _transient(residents, busy, on) if going is None and (
            full or refusal is not None) else frozenset()
        if holding:
            since = res.room_waits.waiting.get(spec.name, (time.monotonic(), "", holding))[0]
            res.room_waits.waiting[spec.name] = (since, holders(residents, busy), holding)
            load = res.loading.get(spec.name)
            if load is not None and load.waiters == 0:
                raise RequestCancelledError(f"nobody waits for model '{spec.name}' any more")
            await res.changed(WAKE_S)
            continue
        if going is None:
            if full:
                raise RejectedError(
                    f"{len(residents)} models are loaded (max_loaded_models = "
                    f"{res.max_loaded_models}) and none may be unloaded for "
                    f"'{spec.name}': {holders(residents, busy)}")
            if refusal is not None:
                raise RejectedError(f"{refusal.message}; held by "
                                    f"{holders(residents, busy)}") from None
            assert placement is not None
            return placement  # fewer GPU layers: nothing idle holds that executor
        await res.evict(going, spec.name, reason)


def _layers(placement: ex.Placement) -> int:
    return placement.offload.gpu_layers if placement.offload is not None else 0


@dataclass(frozen=True, slots=True)
class Beside:
    """What loads in a model's engine beside its GGUF: its vision projector, its draft
    model (its name and file)."""

    projector: Path | None = None
    draft: tuple[str, Path] | None = None

    def need(self, need: MemoryPlan, spec: ModelSpec) -> MemoryPlan:
        """``need`` with these counted as the model's own weights (they go where it goes):
        the projector's file, the draft model's weights and its KV cache for the same
        slots."""
        extra = self.projector.stat().st_size if self.projector is not None else 0
        if self.draft is not None:
            assert spec.context is not None
            drafts = plan(self.draft[1], context=spec.context, parallel=spec.parallel,
                          kv_cache_type=spec.kv_cache_type)
            extra += drafts.total
        return replace(need, weights=need.weights + extra,
                       other_weights=need.other_weights + extra)


async def start(res: Host, spec: ModelSpec, path: Path, need: MemoryPlan, wanted: ex.Wanted,
                placement: ex.Placement, beside: Beside
                ) -> tuple[Engine, ex.Placement, LoadOptions]:
    """Start ``spec``'s engine at ``placement``. When llama.cpp cannot allocate there (a
    device reported more free memory than it had), retry once with the layers the fit
    gives for the memory reported now, then once on half as many GPU layers; then refuse
    with the numbers (RejectedError). As Ollama, which retries a failed load once."""
    tried: list[int] = []
    first: AllocationError | None = None
    retries = 0
    while True:
        options = load_options(res, spec, placement, beside)
        tried.append(_layers(placement))
        try:
            engine = await anyio.to_thread.run_sync(res.spawn, spec, path, options)
            if first is not None:
                log.info("loaded %s with %d GPU layers after: %s", spec.name, tried[-1],
                         first.message)
            return engine, placement, options
        except AllocationError as exc:
            first = first or exc
            log.warning("%s (with %d GPU layers)", exc.message, tried[-1])
        again: ex.Placement | None = None
        if retries == 0:  # the fit again, on the free memory the devices report now
            retries = 1
            local = await res.measure()
            with contextlib.suppress(RejectedError):
                refit = ex.place(wanted, in_order(local, res.remote.executors()), need,
                                 max_layers=spec.gpu_layers)
                if (refit.executor.name == placement.executor.name
                        and _layers(refit) < tried[-1]):
                    again = refit
        if again is None and retries == 1:  # then on half as many GPU layers
            retries = 2
            if tried[-1] > 0:
                again = ex.with_layers(placement, need, tried[-1] // 2)
        if again is None:
            raise RejectedError(_refusal(spec, need, placement, tried, first))
        placement = again


def _refusal(spec: ModelSpec, need: MemoryPlan, placement: ex.Placement, tried: list[int],
             error: AllocationError | None) -> str:
    devices = [placement.executor.devices[i] for i in placement.device_indices]
    free = sum(d.memory_free for d in devices) if devices else placement.executor.memory_free
    where = placement.executor.name
    layers = (f" with {', then '.join(str(n) for n in dict.fromkeys(tried))} of "
              f"{need.n_layer} layers on the GPU" if placement.offload is not None else "")
    return (f"model '{spec.name}' could not be allocated on {where}{layers} "
            f"(it needs {_mib(need.total)}; {where} reports {_mib(free)} free): "
            f"{error.message if error else 'allocation failed'}")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


@dataclass(frozen=True, slots=True)
class Eviction:
    """One model unloaded to make room for another."""

    model: str
    for_model: str
    reason: str
    """``memory`` (the new model did not fit) or ``max_loaded_models``."""
    idle_s: float
    at: float
    """Wall-clock time (time.time())."""

    def describe(self) -> str:
        """One line for ``fleet``."""
        clock = time.strftime("%H:%M:%S", time.localtime(self.at))
        return f"last eviction: '{self.model}' for '{self.for_model}' at {clock} ({self.reason})"


def load_options(res: Host, spec: ModelSpec, placement: ex.Placement,
                 beside: Beside | None = None) -> LoadOptions:
    """How ``spec``'s engine loads on ``placement`` (its context chosen: ``context_for``)."""
    beside = beside or Beside()
    projector, draft = beside.projector, beside.draft
    limits = spec.draft
    assert spec.context is not None, "the context is chosen before the load"
    offload = placement.offload
    remote = placement.executor.remote
    kernels = cpukernels.decide(paths.state_dir())
    common = LoadOptions(context=spec.context, parallel=spec.parallel,
                         n_threads=spec.threads, kv_cache_type=spec.kv_cache_type,
                         extra_bufts=kernels.extra, name=spec.name,
                         kv_cache_dir=str(paths.cache_dir()),
                         kv_cache_disk=max(spec.kv_cache_disk, 0) << 20,
                         kv_cache_ram=promptcache.ram_limit(spec.kv_cache_ram),
                         mmproj=str(projector) if projector is not None else None,
                         lora=tuple(str(adapters.local(a)) for a in spec.lora),
                         mtp=spec.mtp)
    if draft is not None and limits is not None:
        common = replace(common, draft=str(draft[1]), draft_name=draft[0],
                         draft_max=limits.max, draft_min=limits.min, draft_p_min=limits.p_min)
    if remote is not None:
        holder = res.host_in_use(remote)
        if holder is not None:
            raise RejectedError(
                f"RPC host {remote} is serving model '{holder.name}'; a ggml RPC "
                "server serves one model at a time: unload that one first")
        assert offload is not None
        device = int(placement.executor.name.rpartition("/")[2])
        return replace(common, rpc_endpoints=(remote,), device_indices=(device,),
                       n_gpu_layers=offload.n_gpu_layers)
    return replace(common, executor=placement.executor.name,
                   device_indices=(tuple(placement.device_indices)
                                   if offload is not None else ()),
                   n_gpu_layers=offload.n_gpu_layers if offload else 0,
                   tensor_split=tuple(offload.split) if offload else ())


async def context_for(res: Host, spec: ModelSpec, path: Path, wanted: ex.Wanted) -> int:
    """The context a slot of ``spec`` gets: models.toml's ``context`` (past the length
    the model was trained for only there, with a warning, as llama-server warns), else
    the largest that fits where it would go (``memory.fit_context``: the executor the
    placement picks for it now, its total memory up to an agent's context, and what is
    free past that)."""
    trained = await anyio.to_thread.run_sync(trained_context, path)
    if spec.context is not None:
        if spec.context > trained:
            log.warning("%s: context %d is past the %d tokens the model was trained for; "
                        "its answers may degrade there", spec.name, spec.context, trained)
        return spec.context
    executors = in_order(await res.measure(), res.remote.executors())
    small = plan(path, context=256, parallel=spec.parallel, kv_cache_type=spec.kv_cache_type)
    try:
        where = ex.place(wanted, executors, small, max_layers=spec.gpu_layers).executor
    except EverycycleError:  # (the load says why; the context is not what stops it)
        where = max(executors, key=lambda e: e.memory_total)
    context = await anyio.to_thread.run_sync(lambda: fit_context(
        path, parallel=spec.parallel, kv_cache_type=spec.kv_cache_type,
        free=where.memory_free, total=where.memory_total))
    log.info("%s: context %d tokens a slot (trained for %d; %s has %s free)", spec.name,
             context, trained, where.name, _mib(where.memory_free))
    return context


async def give_way(res: Host, name: str, active: Active) -> None:
    """Hold a new request of ``name`` while its model gives way to a load that has
    waited for the memory it holds (``RoomWaits.yields``): it runs once the model is
    loaded again."""
    while (model := res.models.get(name)) is not None and res.room_waits.yields(
            model, time.monotonic()):
        if active.position is None:
            res.requests.tell_position(active, len(res.requests.lane(name).queue) + 1)
        active.on(RequestInput.GIVE_WAY)
        await res.changed(WAKE_S)
