"""Seating: putting a job on a slot and taking it off, with the slot's KV cells — a
prefix reused or restored from the prompt cache, a parked job's cells copied out or
back, a conversation kept before another overwrites it, a job's images read. The
scheduler decides which job goes where (``scheduler.py``); this carries it out.
Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from ...errors import InvalidRequestError
from ..core.features import ThinkingBudget
from ..core.jobs import Job, Output, common_prefix
from ..core.slots import Parked, Run, Slot, cells
from ..kvcache import kvdisk, promptcache
from ..spec.drafter import Drafter
from . import parking
from .constraint import Constraints
from .sampling import Samplers

Outputs = list[tuple[Job, Output]]


class Seating:
    """Seats jobs on the slots of one llama.cpp context (``mem``: its memory)."""

    def __init__(self, L: Any, ctx: Any, mem: Any, *, samplers: Samplers,
                 constraints: Constraints, cache: promptcache.PromptCache | None,
                 vision: Any, drafter: Drafter,
                 tokenize: Callable[[str], list[int]], n_ctx_slot: int, n_swa: int,
                 n_batch: int) -> None:
        self._L = L
        self._ctx = ctx
        self._mem = mem
        self._samplers = samplers
        self._constraints = constraints
        self.cache = cache
        """Prefixes kept beyond the slots, in RAM and on disk (None: not kept)."""
        self._vision = vision
        self._drafter = drafter
        """Each speculative method's state for a run is set up as it is seated."""
        self._tokenize = tokenize
        """Text to tokens, control tokens' text read as them (a thinking ending's)."""
        self._n_ctx_slot = n_ctx_slot
        self._n_swa = n_swa
        self._n_batch = n_batch
        self.spares = promptcache.Spares()
        """Buffers parked jobs' cells are copied into, used again."""

    def start(self, job: Job, slot: Slot, out: Outputs, step: int) -> None:
        """Put ``job`` on the free ``slot``, reusing the cells it shares with its prompt."""
        matcher = None
        if job.spec.sampling.grammar is not None:
            # Its own matcher: a copy (microseconds) of the grammar compiled when the
            # job was checked, off this thread (compiled here only if it has since
            # left the compiled grammars kept, Constraints.KEEP).
            try:
                matcher = self._constraints.matcher(job.spec.sampling.grammar)
            except InvalidRequestError as exc:
                out.append((job, Output("", (), True, "error", exc)))
                return
        L = self._L
        lora = cells(job.spec.lora)
        reuse = (min(common_prefix(slot.cached, job.spec.tokens), len(job.spec.tokens) - 1)
                 if slot.lora == lora else 0)  # (cells of other scales: none reused)
        held = slot.parked is not None  # (its cells, a parked job's, are copied out now)
        self.vacate(slot)
        if self.cache is not None and not job.spec.images:
            if not held:  # (another conversation's)
                self.keep(slot, reuse)
            if not lora:  # (the cache keeps the base model's cells only)
                reuse = self._restore(slot, job, reuse)
        slot.lora = lora
        if reuse > 0 and self._n_swa > 0:
            # A sliding-window layer has dropped the cells before its window: the
            # prefix can be reused only if the window before position `reuse` is all
            # still there (llama-server's rule), else the slot starts over.
            pos_min = L.llama_memory_seq_pos_min(self._mem, slot.seq)
            if pos_min > 0 and pos_min >= reuse - self._n_swa:
                reuse = 0
        if job.spec.images:  # its cells are settled once its images are read (images)
            reuse = len(slot.cached)
        else:
            L.llama_memory_seq_rm(self._mem, slot.seq, reuse if reuse else -1, -1)
            del slot.cached[reuse:]
        slot.run = Run(
            job, n_past=reuse, todo=[] if job.spec.images else list(job.spec.tokens[reuse:]),
            grammar=matcher,
            sampler=self._samplers.chain(job.spec.sampling, self._n_ctx_slot))
        self._drafter.start(slot.run)
        if job.spec.think is not None:
            slot.run.features.append(ThinkingBudget(job.spec.think, self._tokenize))
        for feature in slot.run.features:
            slot.run.forced = feature.started(job) or slot.run.forced
        slot.used = step
        job.n_prompt, job.n_reused, job.n_generated = len(job.spec.tokens), reuse, 0
        job.n_thought = 0
        if job.spec.progress and slot.run.todo:
            out.append((job, Output("", (), progress=reuse)))

    def _restore(self, slot: Slot, job: Job, reuse: int) -> int:
        """Restore a prefix kept in the prompt cache into ``slot`` when it is longer
        than what the slot would reuse; the tokens it now reuses."""
        assert self.cache is not None
        found = self.cache.best(job.spec.tokens, reuse)
        state = self.cache.state(found) if found is not None else None
        if found is None or state is None:
            return reuse
        if not kvdisk.restore_sequence(self._L, self._ctx, self._mem, slot.seq, state):
            self.cache.forget(found)  # (never tried again)
            slot.cached.clear()
            return 0
        slot.cached[:] = found.tokens
        return min(common_prefix(slot.cached, job.spec.tokens), len(job.spec.tokens) - 1)

    def images(self, slot: Slot, progressed: Callable[[], None]) -> None:
        """Read a job's images and prompt (libmtmd), keep the slot's cells that match
        them (an image by its content), decode the rest but the last text chunk, which
        prefills in the shared batch as any prompt does. Raises EverycycleError (the
        job then ends with it)."""
        run = slot.run
        assert run is not None and run.job.spec.text is not None
        vision = self._vision
        if vision is None:
            raise InvalidRequestError(
                "this model has no vision projector: it cannot read images")
        prompt = run.prompt = vision.prompt(run.job.spec.text, run.job.spec.images)
        keys = prompt.keys
        if len(keys) >= self._n_ctx_slot:
            raise InvalidRequestError(f"prompt is {len(keys)} tokens with its images; "
                                      f"the context holds {self._n_ctx_slot}")
        if vision.is_image(prompt, len(prompt.starts) - 1):
            raise InvalidRequestError("the prompt ends with an image: text must follow")
        reuse = 0 if vision.mrope else min(common_prefix(slot.cached, keys), len(keys) - 1)
        first = prompt.chunk_at(reuse)
        reuse = prompt.starts[first]  # (a chunk is decoded whole)
        self._L.llama_memory_seq_rm(self._mem, slot.seq, reuse if reuse else -1, -1)
        del slot.cached[reuse:]
        run.n_past = reuse
        last = len(prompt.starts) - 1
        for index in range(first, last):
            progressed()
            run.n_past = vision.eval_chunk(self._ctx, prompt, index, run.n_past,
                                           slot.seq, self._n_batch)
            slot.cached.extend(keys[prompt.starts[index]:prompt.starts[index + 1]])
        run.todo = vision.text_tokens(prompt, last)
        run.job.n_prompt, run.job.n_reused = len(keys), reuse

    def release(self, slot: Slot, reason: str) -> None:
        """``slot``'s job has ended with ``reason``. Ended cleanly (not cancelled, no
        error): its sequence goes to the history lookup drafts from, a background job's
        conversation to the prompt cache (its slot likely goes to another: the copy, now,
        is off the path of an interactive job's first token). After an error the cells
        may be half-written: they go."""
        run = slot.run
        assert run is not None
        if reason not in ("cancelled", "error"):
            self._drafter.ended(run, slot.cached)
            if run.job.background:
                self.keep(slot)
        self._samplers.free(run.sampler)
        if run.prompt is not None:
            self._vision.free_prompt(run.prompt)
        slot.run = None
        if reason == "error":
            self._L.llama_memory_seq_rm(self._mem, slot.seq, -1, -1)
            slot.cached.clear()

    def park(self, slot: Slot) -> Parked:
        return parking.park(slot)

    def resume(self, parked: Parked, slot: Slot, step: int) -> None:
        """Put a parked job back on the free ``slot``; a slot other than its own gives up
        what it holds first (the interactive turn that took the parked job's slot, say,
        goes to the prompt cache: the person's next request restores it)."""
        if parked.slot is not slot:
            if slot.parked is None:
                self.keep(slot)
            self.vacate(slot)
        parking.resume(self._L, self._ctx, self._mem, parked, slot, self.spares)
        slot.used = step

    def end_parked(self, parked: Parked) -> None:
        """A parked job ends (cancelled): its cells stay, as any conversation's."""
        self._samplers.free(parked.run.sampler)
        parking.drop(parked, self.spares)
        if parked.slot is not None:
            parked.slot.parked = None

    def keep(self, slot: Slot, shared: int = 0) -> None:
        """Before another job overwrites ``slot``: the conversation it holds goes to the
        prompt cache, unless the newcomer shares all but a few tokens of it (``shared``)."""
        if (self.cache is not None and not slot.lora
                and len(slot.cached) - shared >= kvdisk.MIN_TOKENS):
            self.cache.keep(slot.cached, partial(
                promptcache.copy_state, self._L, self._ctx, slot.seq))

    def vacate(self, slot: Slot) -> None:
        """Before another job takes ``slot``: copy out a parked job's cells it holds."""
        if slot.parked is not None:
            parking.save(self._L, self._ctx, slot.parked, self.spares)
