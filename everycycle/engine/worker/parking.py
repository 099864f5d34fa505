"""Parking: a running background job gives its slot up to an interactive one and later
resumes where it stopped.

The slot's ``Run`` (sampler chain with its RNG and penalties' history, the constraint
matcher, the prompt left to read, the last sampled token, held-back UTF-8 bytes,
stop-string text and log-probabilities, the prompt-lookup drafter) moves whole into a
``Parked`` record, with the tokens its cells hold. The KV cells stay in the slot until
another job takes it; only then are they copied out (``save``). A resume restores them
into whichever slot it gets (nothing to do when it gets its own, untouched), and, should
llama.cpp refuse the copy, reads the tokens again instead: the output is the
uninterrupted run's either way (up to llama.cpp's batch-size numerics). Which job parks
and where it resumes is the scheduler's decision (``scheduler.py``); this moves the
state. Engine thread only.
"""

from __future__ import annotations

import time
from typing import Any

from ..core.slots import Parked, Slot, cells
from ..kvcache import kvdisk, promptcache


def park(slot: Slot) -> Parked:
    """Take ``slot``'s job off it, keeping all it had; the slot is free, its cells the
    parked job's until ``save``."""
    run = slot.run
    assert run is not None
    parked = Parked(run, slot, list(slot.cached), since=time.monotonic())
    run.job.n_parked += 1
    slot.run, slot.parked = None, parked
    return parked


def save(L: Any, ctx: Any, parked: Parked, spares: promptcache.Spares) -> None:
    """Copy the parked job's cells out of its slot (another job takes the slot now), into
    a buffer of ``spares`` (``drop`` gives it back)."""
    slot = parked.slot
    assert slot is not None
    parked.state = promptcache.copy_state(L, ctx, slot.seq, spares)
    parked.slot = slot.parked = None


def drop(parked: Parked, spares: promptcache.Spares) -> None:
    """The parked job's copied cells are read no more."""
    if parked.state is not None:
        spares.give_back(parked.state)
        parked.state = None


def resume(L: Any, ctx: Any, mem: Any, parked: Parked, slot: Slot,
           spares: promptcache.Spares) -> None:
    """Put the parked job back on the free ``slot``, as it was when it stopped."""
    run = parked.run
    if parked.slot is not slot:
        # (its own slot, when untouched, is where it resumes: elsewhere, it was copied)
        assert parked.slot is None
        restored = (parked.state is not None and
                    kvdisk.restore_sequence(L, ctx, mem, slot.seq, parked.state))
        slot.lora = cells(run.job.spec.lora)  # (its cells, restored or read again)
        if restored:
            slot.cached[:] = parked.cached
        else:  # read its tokens again: the prompt, then what it generated but the last
            L.llama_memory_seq_rm(mem, slot.seq, -1, -1)
            slot.cached.clear()
            run.todo = parked.cached + (run.todo if run.todo else [run.last])
            run.n_past = 0
        drop(parked, spares)
    slot.parked = parked.slot = None
    slot.run = run
