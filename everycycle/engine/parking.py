"""Parking: a running background job gives its slot up to an interactive one and later
resumes where it stopped.

Everything a slot keeps for its job moves into a ``Parked`` record: the sampler chain
(its RNG and penalties' history), the constraint matcher, the prompt left to read, the
last sampled token, held-back UTF-8 bytes, stop-string text and log-probabilities, the
prompt-lookup drafter. The KV cells stay in the slot until another job takes it; only
then are they copied out (``save``). A resume restores them into whichever slot it
gets (nothing to do when it gets its own, untouched), and, should llama.cpp refuse the
copy, reads the tokens again instead: the output is the uninterrupted run's either way
(up to llama.cpp's batch-size numerics). Engine thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from . import kvdisk, promptcache
from .constraint import Matcher
from .jobs import Job, Logprob, Output, common_prefix
from .lookup import PromptLookup
from .sampling import Samplers
from .slots import Slot


@dataclass(eq=False)
class Parked:
    """A job off its slot, and everything the slot kept for it."""

    job: Job
    slot: Slot | None
    """The slot whose KV cells are still this job's (None: they were copied out)."""
    cached: list[int]
    n_past: int
    todo: list[int]
    last: int
    sampler: Any
    grammar: Matcher | None
    decoder: Any
    held_text: str
    held_ids: list[int]
    held_logprobs: list[Logprob]
    lookup: PromptLookup | None
    state: Any = None
    """The cells, copied out once another job took the slot (None: not copied)."""
    since: float = 0.0
    """When it was parked (``time.monotonic()``)."""


def parkable(slot: Slot) -> bool:
    """Whether ``slot`` runs a job that gives way to an interactive one: a background
    job, text only (an image's cells are libmtmd's to lay out)."""
    job = slot.job
    return (job is not None and job.background and not job.spec.images
            and job._cancel_reason is None)


def park(slot: Slot) -> Parked:
    """Take ``slot``'s job off it, keeping all it had; the slot is free, its cells the
    parked job's until ``save``."""
    job = slot.job
    assert job is not None and not slot.draft
    parked = Parked(job, slot, list(slot.cached), slot.n_past, slot.todo, slot.last,
                    slot.sampler, slot.grammar, slot.decoder, slot.held_text,
                    slot.held_ids, slot.held_logprobs, slot.lookup, since=time.monotonic())
    job.n_parked += 1
    slot.job, slot.sampler, slot.grammar, slot.lookup = None, None, None, None
    slot.todo, slot.held_ids, slot.held_logprobs, slot.held_text = [], [], [], ""
    slot.parked = parked
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
    if parked.slot is not slot:
        # (its own slot, when untouched, is where it resumes: elsewhere, it was copied)
        assert parked.slot is None
        restored = (parked.state is not None and
                    kvdisk.restore_sequence(L, ctx, mem, slot.seq, parked.state))
        if restored:
            slot.cached[:] = parked.cached
        else:  # read its tokens again: the prompt, then what it generated but the last
            L.llama_memory_seq_rm(mem, slot.seq, -1, -1)
            slot.cached.clear()
            pending = parked.todo if parked.todo else [parked.last]
            parked.todo = parked.cached + pending
            parked.n_past = 0
        drop(parked, spares)
    slot.parked = parked.slot = None
    slot.job = parked.job
    slot.n_past, slot.todo, slot.last = parked.n_past, parked.todo, parked.last
    slot.sampler, slot.grammar, slot.lookup = parked.sampler, parked.grammar, parked.lookup
    slot.decoder, slot.held_text = parked.decoder, parked.held_text
    slot.held_ids, slot.held_logprobs = parked.held_ids, parked.held_logprobs
    slot.draft = []


def victim_rank(slot: Slot, *, tokens: Sequence[int], drained: bool) -> tuple[int, int]:
    """How fit ``slot``'s background job is to be parked for an interactive job whose
    prompt is ``tokens`` (the highest is parked). First, the cells it shares with that
    prompt (a chat template's system turn, say): each is a token the person's first token
    need not wait for. Then, while other background work waits to take a slot freed
    early, the fewest cells (the cheapest to copy out); once none waits (``drained``),
    the least work left: that job finishes before the others even parked, so the batch
    ends no later for it, where parking the job that ends last makes it end later."""
    job = slot.job
    assert job is not None
    left = job.spec.max_tokens - job.n_generated + len(slot.todo)
    return common_prefix(slot.cached, tokens), -left if drained else -slot.n_past


class Lanes:
    """The engine thread's scheduling of two lanes (``EngineThread`` inherits it): a
    pending interactive job takes a free slot first, else parks a background job to
    take its slot, so it waits at most one step; a parked job resumes before any
    pending background job. Engine thread only."""

    _L: Any
    _ctx: Any
    _mem: Any
    _slots: list[Slot]
    _pending: deque[Job]
    _parked: list[Parked]
    _samplers: Samplers
    _cache: promptcache.PromptCache | None
    _spares: promptcache.Spares
    """Buffers parked jobs' cells are copied into, used again."""
    steps: int

    def _start(self, job: Job, out: list[tuple[Job, Output]]) -> None:
        raise NotImplementedError

    def _schedule(self, out: list[tuple[Job, Output]]) -> None:
        """Start or resume jobs in free slots, interactive ones first (with the lock)."""
        now = time.monotonic()
        for parked in self._parked:  # (parked for too long: served as interactive now)
            age = parked.job.spec.background_age
            if age is not None and now - parked.since >= age:
                parked.job.promoted = True
        while True:
            free = any(s.job is None for s in self._slots)
            urgent_parked = next((p for p in self._parked if not p.job.background), None)
            urgent = next((j for j in self._pending if not j.background), None)
            if urgent_parked is not None or urgent is not None:
                if not free:
                    victims = [s for s in self._slots if parkable(s)]
                    if not victims:
                        return
                    tokens = urgent.spec.tokens if urgent_parked is None and urgent else ()
                    self._parked.append(park(max(victims, key=partial(
                        victim_rank, tokens=tokens, drained=not any(
                            j.background for j in [*self._pending, *(
                                p.job for p in self._parked)])))))
                if urgent_parked is not None:
                    self._resume(urgent_parked)
                else:
                    assert urgent is not None
                    self._pending.remove(urgent)
                    self._start(urgent, out)
            elif not free:
                return
            elif self._parked:
                self._resume(self._parked[0])
            elif self._pending:
                self._start(self._pending.popleft(), out)
            else:
                return

    def _resume(self, parked: Parked) -> None:
        """Put a parked job back in a free slot: its own when still untouched, else one
        that holds no other parked job's cells, the least recently used."""
        self._parked.remove(parked)
        free = [s for s in self._slots if s.job is None]
        own = parked.slot if parked.slot is not None and parked.slot.job is None else None
        slot = own or min(free, key=lambda s: (s.parked is not None, s.used))
        if slot is not own:
            if slot.parked is None:
                # (the interactive turn that took the parked job's slot, say: the
                # person's next request restores it instead of reading it again)
                self._keep(slot)
            self._vacate(slot)
        resume(self._L, self._ctx, self._mem, parked, slot, self._spares)
        slot.used = self.steps

    def _keep(self, slot: Slot, shared: int = 0) -> None:
        """Before another job overwrites ``slot``: the conversation it holds goes to the
        prompt cache, unless the newcomer shares all but a few tokens of it (``shared``)."""
        if self._cache is not None and len(slot.cached) - shared >= kvdisk.MIN_TOKENS:
            self._cache.keep(slot.cached, partial(
                promptcache.copy_state, self._L, self._ctx, slot.seq))

    def _vacate(self, slot: Slot) -> None:
        """Before another job takes ``slot``: copy out a parked job's cells it holds."""
        if slot.parked is not None:
            save(self._L, self._ctx, slot.parked, self._spares)

    def _end_parked(self, out: list[tuple[Job, Output]], *, all_: bool) -> None:
        """End the parked jobs that were cancelled (``all_``: every one) as cancelled."""
        for parked in list(self._parked):
            if all_ or parked.job._cancel_reason is not None:
                self._parked.remove(parked)
                self._samplers.free(parked.sampler)
                drop(parked, self._spares)
                if parked.slot is not None:
                    parked.slot.parked = None  # (its cells stay, as any conversation's)
                out.append((parked.job, Output("", (), True, "cancelled")))
