"""A request that needs more context than its model was loaded with: the model loaded
again, once, with enough (Ollama's ``num_ctx``, ``launch``'s agents).

The new context is the need rounded up to a power of two (so that clients asking
8,000 and 8,192 share one), never past what the model was trained for: a need past
that is refused. A need at or under the loaded context never reloads, so clients that
send different ``num_ctx`` do not take turns reloading the model (Ollama's reload
thrash): the raised context stays for the model's residency. The reload waits for the
model's other work to end (nothing running, queued or being admitted but the asker),
then goes through the room planner as any load does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import anyio
import anyio.to_thread

from ...errors import EverycycleError, InvalidRequestError
from ...hardware.memory import trained_context
from ...models.registry import ModelSpec, local_file
from ..active import Lane
from . import room
from .loaded import Resident
from .resident import Residency


def raised(need: int, trained: int) -> int:
    """The context a slot is loaded with for a ``need`` of tokens."""
    return min(1 << (need - 1).bit_length(), trained)


async def ensure_context(res: Residency, spec: ModelSpec, need: int,
                         quiet: Callable[[], bool]) -> None:
    """Have ``spec``'s model, if loaded with fewer than ``need`` tokens a slot, loaded
    again with enough once ``quiet()`` says its other work has ended. Raises
    InvalidRequestError when the model was not trained for ``need`` tokens."""
    model = res.models.get(spec.name)
    if model is None or model.options.context >= need:
        return
    trained = await anyio.to_thread.run_sync(trained_context, model.path)
    if need > trained:
        raise InvalidRequestError(
            f"a context of {need:,} tokens is more than model '{spec.name}' was trained "
            f"for ({trained:,}); it is loaded with {model.options.context:,}")
    while not quiet():
        await res.changed(room.WAKE_S)
        if res.models.get(spec.name) is not model:
            return  # (unloaded or reloaded meanwhile: the caller's load decides)
    context = raised(need, trained)
    await res.reload(replace(model.spec, context=context),
                     f"model '{spec.name}' reloaded with a {context:,}-token context (a "
                     f"request needs {need:,})")


async def loaded(res: Residency, lane: Lane, spec: ModelSpec, need: int | None, *,
                 executor: str | None = None, allow_load: bool = True,
                 retry_failed: bool = False) -> Resident:
    """``spec``'s model loaded (``Residency.ensure_loaded``) with at least ``need`` tokens
    a slot: loaded again with enough once its other work has ended, the requests asking
    for more (``lane.raising``) waiting together. Raises InvalidRequestError past its
    trained context, and what its load raises."""
    model = await res.ensure_loaded(await for_load(res, spec, need), executor,
                                    allow_load=allow_load, retry_failed=retry_failed)
    if need is None or model.options.context >= need:
        return model
    lane.raising += 1
    try:
        for _ in range(3):  # (another's reload may have come first, with less)
            await ensure_context(res, spec, need, lambda: not lane.running and not lane.queue
                                 and lane.admitting <= lane.raising)
            model = await res.ensure_loaded(spec, None, allow_load=allow_load)
            if model.options.context >= need:
                break
        return model
    finally:
        lane.raising -= 1


def of(res: Residency, name: str) -> int | None:
    """Tokens a slot of model ``name``: as loaded, else models.toml's ``context``; None
    when neither says (it is chosen at load)."""
    model = res.models.get(name)
    if model is not None:
        return model.options.context
    spec = res.registry.models.get(name)
    return spec.context if spec is not None else None


async def for_load(res: Residency, spec: ModelSpec, need: int | None) -> ModelSpec:
    """``spec`` as a request needing ``need`` tokens a slot loads it, when it is neither
    loaded nor loading: models.toml's smaller ``context`` raised as a reload would
    raise it (one load, not two), where its file is here to say what it was trained
    for."""
    if (need is None or spec.context is None or spec.context >= need
            or spec.name in res.models or spec.name in res.loading):
        return spec
    try:
        trained = await anyio.to_thread.run_sync(lambda: trained_context(local_file(spec)))
    except EverycycleError:
        return spec
    return replace(spec, context=raised(need, trained)) if need <= trained else spec
