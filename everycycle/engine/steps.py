"""The engine thread of a Runner: one decode step after another.

Each step admits pending jobs into free slots (``_admit``), puts the pending work of
every active slot — prefill chunks, one token per decoding slot, drafts (the tokens a
grammar forces, prompt lookup's: ``drafts.py``) — into one ``llama_batch``
(``_build``), runs one ``llama_decode``, samples each slot with its own chain
(``_sample``), and hands that step's outputs to ``notify`` in one call (``preempt``
stops a background step for an interactive job). Requests leave between steps, so a
cancel takes effect within one step. A slot keeps its KV cells after a request ends; a
new one sharing a prefix with them only prefills the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from functools import partial
from typing import Any

from ..errors import EverycycleError, InternalError, InvalidRequestError
from . import kvdisk, promptcache
from .constraint import Constraints
from .contract import Notify
from .drafts import Drafts
from .jobs import EMBED_MAX_TOKENS, Job, Output, common_prefix
from .logits import RowLogits, logprob
from .lookup import History, PromptLookup, StepCost, expected_accepted
from .parking import Lanes
from .preempt import Preempt
from .probes import batch_probe, put
from .sampling import Samplers
from .slots import Slot, best_slot
from .vocab import Vocab

log = logging.getLogger(__name__)

STEP_TABLE_EVERY = 64
"""Decode steps between two publications of the step costs (``step_seconds``)."""

BACKGROUND_CHUNK = 16
"""Prompt tokens of background jobs read in one step at most (short steps, where none stop)."""
BACKGROUND_STRETCH = 2.0
"""How much longer than a decode step of every slot background prompt tokens may make a step."""


class EngineThread(Drafts, Lanes):
    """The decode loop's half of a Runner (``Runner`` sets these up and starts it)."""

    _L: Any
    path: Any
    parallel: int
    n_ctx_slot: int
    vocab: Vocab
    lookup_type: type[PromptLookup]
    lookup_exact: bool
    steps: int = 0
    """Loop iterations with work done: a step that moves is progress."""
    step_seconds: tuple[float, ...] = ()
    """A decode step's seconds by rows, 1 to ``parallel`` (``Engine.step_seconds``):
    republished from the step costs every ``STEP_TABLE_EVERY`` steps, read anywhere."""
    _notify: Notify
    _ctx: Any
    _mem: Any
    _model: Any
    _batch: Any
    _n_batch: int
    _n_vocab: int
    _logits: RowLogits
    _n_swa: int
    _threads: int
    _samplers: Samplers
    _constraints: Constraints
    _slots: list[Slot]
    _pending: deque[Job]
    _cond: threading.Condition
    _closing: bool
    _history: History
    _fill: StepCost
    _embedder: Any
    _vision: Any  # (the model's Vision, images in, or None)
    _preempt: Preempt | None
    _cache: promptcache.PromptCache | None
    """Prefixes kept beyond the slots, in RAM and on disk (None: not kept)."""

    def _run(self, probed: threading.Event) -> None:
        # Every llama_decode of this context runs on this thread, the probe too: OpenMP
        # keeps a pool per calling thread, and a second pool (more threads than cores)
        # makes libgomp sleep at every barrier (SmolLM2, 2 cores: 25% slower).
        try:
            self.lookup_exact = self._probe()
        except Exception:
            log.exception("probing batched decoding failed for %s", self.path)
        finally:
            probed.set()
        try:
            self._loop()
        except BaseException as exc:  # the thread must report, never vanish silently
            log.exception("engine thread for %s failed", self.path)
            err = InternalError(f"engine failed: {exc}")
            with self._cond:
                self._closing = True
                jobs = ([s.job for s in self._slots if s.job] + list(self._pending)
                        + [p.job for p in self._parked])
                self._pending.clear()
                self._parked.clear()
            self._safe_notify([(j, Output("", (), True, "error", err)) for j in jobs])

    def _piece_text(self, tok: int) -> str:
        return self.vocab.piece(tok, True).decode("utf-8", "replace")

    def _publish_steps(self) -> None:
        table = tuple(self._cost.estimate(rows) for rows in range(1, self.parallel + 1))
        self.step_seconds = tuple(t for t in table if t is not None)

    def _probe(self) -> bool:
        """Whether batches are bit-exact here; times steps by row count meanwhile."""
        toks = self.vocab.tokenize(
            "The quick brown fox jumps over the lazy dog again and again", special=False)
        exact, self._cost = batch_probe(
            self._L, self._ctx, self._mem, self._batch, n_vocab=self._n_vocab,
            n_batch=self._n_batch, n_ctx_slot=self.n_ctx_slot, toks=toks)
        self._publish_steps()
        return exact

    def _safe_notify(self, outputs: list[tuple[Job, Output]]) -> None:
        if not outputs:
            return
        try:
            self._notify(outputs)
        except Exception:
            log.exception("notify failed; %d outputs dropped", len(outputs))

    def _loop(self) -> None:
        while True:
            out: list[tuple[Job, Output]] = []
            embeds = self._admit(out)
            if embeds is None:  # closing
                self._safe_notify(out)
                return
            self.steps += 1  # (progress, for the daemon's hung-engine watch)
            if embeds:
                self._embed(embeds, out)
            for s in self._slots:
                if s.job is not None and s.job.spec.images and s.prompt is None and not s.todo:
                    self._prepare_images(s, out)
            active = [s for s in self._slots if s.job is not None]
            before = self._preempt.snapshot(active) if self._preempt else None
            n, rows, prefilled = self._build(active)
            if n == 0:
                self._safe_notify(out)
                continue
            self._batch.n_tokens = n
            started = time.perf_counter()
            decode = partial(self._L.llama_decode, self._ctx, self._batch)
            rc = (decode() if before is None or self._preempt is None else
                  self._preempt.decode(before, self._pending, decode,
                                       self._estimate(n, bool(prefilled))))
            if rc is None:  # stopped and undone: an interactive job came
                self._safe_notify(out)
                continue
            if rc != 0:
                err = InternalError(f"llama_decode returned {rc}")
                for s in active:
                    self._finish(s, out, "error", err)
                self._safe_notify(out)
                continue
            if not prefilled:
                self._cost.observe(n, time.perf_counter() - started)
                if self.steps % STEP_TABLE_EVERY == 0 or not self.step_seconds:
                    self._publish_steps()
            else:
                self._fill.observe(n, time.perf_counter() - started)
                for s in prefilled:  # (a prompt read whole yields its first token instead)
                    if s.todo and s.job is not None and s.job.spec.progress:
                        out.append((s.job, Output("", (), progress=s.n_past)))
            self._sample(rows, out)
            self._safe_notify(out)

    def _admit(self, out: list[tuple[Job, Output]]) -> list[Job] | None:
        """Wait for work; end cancelled jobs; start pending jobs in free slots. Returns
        the embedding jobs to run this step, or None when the runner is closing."""
        with self._cond:
            while not (self._closing or self._pending or self._parked
                       or any(s.job for s in self._slots)):
                self._cond.wait()
            if self._closing:
                for s in self._slots:
                    if s.job is not None:
                        self._finish(s, out, "cancelled")
                for job in self._pending:
                    out.append((job, Output("", (), True, "cancelled")))
                self._pending.clear()
                self._end_parked(out, all_=True)
                return None
            for s in self._slots:
                if s.job is not None and s.job._cancel_reason is not None:
                    self._finish(s, out, "cancelled")
            self._end_parked(out, all_=False)
            kept: deque[Job] = deque()
            embeds: list[Job] = []
            for job in self._pending:
                if job._cancel_reason is not None:
                    out.append((job, Output("", (), True, "cancelled")))
                elif job.spec.embed_inputs is not None:
                    embeds.append(job)  # needs no slot: its own context
                else:
                    kept.append(job)
            self._pending = kept
            self._schedule(out)
            return embeds

    def _build(self, active: list[Slot]) -> tuple[int, list[tuple[Slot, int]], list[Slot]]:
        """Fill the batch: a token per decoding slot first, then drafts, then prefill
        chunks. Returns (rows, the slots whose logits come from which row, the slots
        that read some of their prompt)."""
        batch = self._batch
        n = 0
        rows: list[tuple[Slot, int]] = []
        # While an interactive job reads its prompt, background jobs sit the step out:
        # its first token comes as soon as on an idle engine.
        if any(s.todo and s.job is not None and not s.job.background for s in active):
            active = [s for s in active if s.job is not None and not s.job.background]
        for s in active:
            if not s.todo:
                put(batch, n, s.last, s.n_past, s.seq, True)
                s.cached.append(s.last)
                s.n_past += 1
                rows.append((s, n))
                n += 1
        expected = float(len(rows))  # the tokens this step should yield
        for s, _ in rows:  # drafts after every slot has its row
            if s.grammar is None and s.lookup is None:
                continue
            assert s.job is not None
            room = min(self._n_batch - n, self.n_ctx_slot - s.n_past,
                       s.job.spec.max_tokens - s.job.n_generated - 1)
            s.draft, rate = self._propose(s, room, n, expected)
            s.draft_row = n
            expected += expected_accepted(rate, len(s.draft))
            for tok in s.draft:
                put(batch, n, tok, s.n_past, s.seq, True)
                s.cached.append(tok)
                s.n_past += 1
                n += 1
        prefilled: list[Slot] = []
        background_room = self._background_room(n)
        for s in active:
            if not s.todo or n >= self._n_batch:
                continue
            room = self._n_batch - n
            if s.job is not None and s.job.background:
                room = min(room, background_room)
                if room <= 0:
                    continue
                background_room -= room
            prefilled.append(s)
            take = s.todo[:room]
            del s.todo[: len(take)]
            for j, tok in enumerate(take):
                last = not s.todo and j == len(take) - 1
                put(batch, n, tok, s.n_past, s.seq, last)
                s.cached.append(tok)
                s.n_past += 1
                if last:
                    rows.append((s, n))
                n += 1
        return n, rows, prefilled

    def _background_room(self, rows: int) -> int:
        """Prompt tokens of background jobs a step of ``rows`` other rows may read: as
        many as keep it within BACKGROUND_STRETCH times a decode step of every slot (by
        the measured step costs), at least 1, at most BACKGROUND_CHUNK. A short step: an
        interactive job arriving waits little for it, or loses little work stopping it."""
        base = self._cost.estimate(max(rows, self.parallel))
        if base is None:
            return BACKGROUND_CHUNK
        room = 1
        while room < BACKGROUND_CHUNK and (
                (cost := self._cost.estimate(rows + room + 1)) is not None
                and cost <= BACKGROUND_STRETCH * base):
            room += 1
        return room

    def _estimate(self, n: int, filling: bool) -> float | None:
        """A step of ``n`` batch tokens: as steps that read prompt tokens took (``filling``:
        3x the decode table's on a CPU), else as a decode step of ``n`` rows."""
        fill = self._fill.estimate(n) if filling else None
        return fill if fill is not None else self._cost.estimate(n)

    def _choose(self, s: Slot, row: int) -> int:
        """The slot's next token from batch row ``row``: its chain's (greedy: the
        argmax), within its grammar, taken by both; its log-probabilities held when
        asked. Raises InvalidRequestError when the grammar allows no token."""
        assert s.job is not None
        if s.sampler is None:
            logits = self._logits(row)
            tok = int(logits.argmax())
            if s.grammar is not None:
                tok = s.grammar.greedy(logits, tok)
        elif s.grammar is not None:
            tok = self._samplers.sample_constrained(s.sampler, s.grammar, self._logits(row))
        else:
            tok = self._L.llama_sampler_sample(s.sampler, self._ctx, row)
        if s.job.spec.logprobs is not None:
            s.held_logprobs.append(logprob(self._logits(row), tok, s.job.spec.logprobs,
                                           self._piece_text))
        return tok

    def _sample(self, rows: list[tuple[Slot, int]], out: list[tuple[Job, Output]]) -> None:
        """Each slot's next token from its row (or its draft verified)."""
        for s, row in rows:
            if s.draft:
                self._verify(s, row, out)
                continue
            try:
                tok = self._choose(s, row)
            except InvalidRequestError as exc:
                self._finish(s, out, "error", exc)
                continue
            self._take(s, tok, s.n_past, out)

    def _start(self, job: Job, out: list[tuple[Job, Output]]) -> None:
        """Put ``job`` in the free slot whose cached tokens share the longest prefix."""
        L = self._L
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
        free = [s for s in self._slots if s.job is None]
        slot, reuse = best_slot([s for s in free if s.parked is None] or free, job.spec.tokens)
        held = slot.parked is not None  # (its cells, a parked job's, are copied out now)
        self._vacate(slot)
        if self._cache is not None and not job.spec.images:
            if not held:  # (another conversation's)
                self._keep(slot, reuse)
            reuse = self._restore(slot, job, reuse)
        if reuse > 0 and self._n_swa > 0:
            # A sliding-window layer has dropped the cells before its window: the
            # prefix can be reused only if the window before position `reuse` is all
            # still there (llama-server's rule), else the slot starts over.
            pos_min = L.llama_memory_seq_pos_min(self._mem, slot.seq)
            if pos_min > 0 and pos_min >= reuse - self._n_swa:
                reuse = 0
        if job.spec.images:  # its cells are settled once its images are read (_prepare_images)
            reuse = len(slot.cached)
        else:
            L.llama_memory_seq_rm(self._mem, slot.seq, reuse if reuse else -1, -1)
            del slot.cached[reuse:]
        slot.job, slot.used = job, self.steps
        greedy = job.spec.sampling.plain_greedy
        slot.grammar = matcher
        slot.sampler = self._samplers.chain(job.spec.sampling, self.n_ctx_slot)  # None: plain greedy
        slot.lookup = (self.lookup_type(job.spec.tokens, self._history)
                       if job.spec.lookup and greedy else None)
        slot.draft = []
        slot.todo = [] if job.spec.images else list(job.spec.tokens[reuse:])
        slot.prompt = None
        slot.n_past = reuse
        slot.reset_text()
        job.n_prompt, job.n_reused, job.n_generated = len(job.spec.tokens), reuse, 0
        if job.spec.progress and slot.todo:
            out.append((job, Output("", (), progress=reuse)))

    def _restore(self, slot: Slot, job: Job, reuse: int) -> int:
        """Restore a prefix kept in the prompt cache into ``slot`` when it is longer
        than what the slot would reuse; the tokens it now reuses."""
        assert self._cache is not None
        found = self._cache.best(job.spec.tokens, reuse)
        state = self._cache.state(found) if found is not None else None
        if found is None or state is None:
            return reuse
        if not kvdisk.restore_sequence(self._L, self._ctx, self._mem, slot.seq, state):
            self._cache.forget(found)  # (never tried again)
            slot.cached.clear()
            return 0
        slot.cached[:] = found.tokens
        return min(common_prefix(slot.cached, job.spec.tokens), len(job.spec.tokens) - 1)

    def _prepare_images(self, slot: Slot, out: list[tuple[Job, Output]]) -> None:
        """Read a job's images and prompt (libmtmd), keep the slot's cells that match
        them (an image by its content), decode the rest but the last text chunk, which
        prefills in the shared batch as any prompt does."""
        job = slot.job
        assert job is not None and job.spec.text is not None
        vision = self._vision
        if vision is None:
            self._finish(slot, out, "error", InvalidRequestError(
                "this model has no vision projector: it cannot read images"))
            return
        L = self._L
        try:
            prompt = slot.prompt = vision.prompt(job.spec.text, job.spec.images)
            keys = prompt.keys
            if len(keys) >= self.n_ctx_slot:
                raise InvalidRequestError(f"prompt is {len(keys)} tokens with its images; "
                                          f"the context holds {self.n_ctx_slot}")
            if vision.is_image(prompt, len(prompt.starts) - 1):
                raise InvalidRequestError("the prompt ends with an image: text must follow")
            reuse = 0 if vision.mrope else min(common_prefix(slot.cached, keys), len(keys) - 1)
            first = prompt.chunk_at(reuse)
            reuse = prompt.starts[first]  # (a chunk is decoded whole)
            L.llama_memory_seq_rm(self._mem, slot.seq, reuse if reuse else -1, -1)
            del slot.cached[reuse:]
            slot.n_past = reuse
            last = len(prompt.starts) - 1
            for index in range(first, last):
                self._progressed()
                slot.n_past = vision.eval_chunk(self._ctx, prompt, index, slot.n_past,
                                                slot.seq, self._n_batch)
                end = prompt.starts[index + 1]
                slot.cached.extend(keys[prompt.starts[index]:end])
            slot.todo = vision.text_tokens(prompt, last)
            job.n_prompt, job.n_reused = len(keys), reuse
        except EverycycleError as exc:
            self._finish(slot, out, "error", exc)

    def _finish(self, slot: Slot, out: list[tuple[Job, Output]], reason: str,
                error: EverycycleError | None = None) -> None:
        job = slot.job
        assert job is not None
        text, ids = "", list[int]()
        if reason not in ("cancelled", "error"):
            if slot.lookup is not None:  # (a model with lookup off keeps no history)
                self._history.add(slot.cached, job.n_prompt)
            text, ids, reason = slot.final_text(reason, job.spec.stop)
            if job.background:  # (its slot likely goes to another: the copy, now, is
                self._keep(slot)  # off the path of an interactive job's first token)
        out.append((job, Output(text, tuple(ids), True, reason, error,
                                logprobs=slot.take_logprobs() if ids else None)))
        slot.held_logprobs = []
        self._samplers.free(slot.sampler)
        slot.sampler = slot.grammar = None
        slot.job = None
        slot.todo = []
        if slot.prompt is not None:
            self._vision.free_prompt(slot.prompt)
            slot.prompt = None
        if reason == "error":  # the KV cells may be half-written
            self._L.llama_memory_seq_rm(self._mem, slot.seq, -1, -1)
            slot.cached.clear()

    def _emit(self, slot: Slot, token: int, out: list[tuple[Job, Output]]) -> bool:
        """Add a sampled token's text; True if a stop string ended the job."""
        job = slot.job
        assert job is not None
        chunk = slot.add_text(token, self.vocab.piece(token, job.spec.special), job.spec.stop)
        if isinstance(chunk, bool):
            return chunk
        out.append((job, Output(chunk[0], tuple(chunk[1]), logprobs=slot.take_logprobs())))
        return False

    def _take(self, s: Slot, tok: int, n_past: int, out: list[tuple[Job, Output]]) -> bool:
        """Handle one generated token, sampled with ``n_past`` tokens in the slot's cache;
        True if it ended the job."""
        running = s.job
        assert running is not None
        if self.vocab.is_eog(tok):
            if s.held_logprobs:
                s.held_logprobs.pop()  # (the end is no token of the answer)
            self._finish(s, out, "eos")
            return True
        running.n_generated += 1
        s.last = tok
        if s.lookup is not None:
            s.lookup.append(tok)
        if self._emit(s, tok, out):
            self._finish(s, out, "stop")
        elif running.n_generated >= running.spec.max_tokens:
            self._finish(s, out, "length")
        elif n_past + 1 >= self.n_ctx_slot:
            self._finish(s, out, "context")
        else:
            return False
        return True

    def _embed(self, jobs: list[Job], out: list[tuple[Job, Output]]) -> None:
        """Embed every input of ``jobs`` in shared batches (on the engine thread)."""
        from .embedder import Embedder

        try:
            if self._embedder is None:
                self._embedder = Embedder(self._L, self._model, n_threads=self._threads,
                                          n_batch=EMBED_MAX_TOKENS)
        except EverycycleError as exc:
            out.extend((job, Output("", (), True, "error", exc)) for job in jobs)
            return
        self._embedder.run(jobs, out, progress=self._progressed)

    def _progressed(self) -> None:
        """A step's worth of work done inside one loop pass (an embedding batch, an
        image): progress, for the hung-engine watch."""
        self.steps += 1
