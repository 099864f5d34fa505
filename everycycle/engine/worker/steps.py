"""The engine thread of a Runner: one step after another, each read top to bottom as
admit → plan → run → apply → prepare.

- **admit** (under the lock): wait for work, end cancelled jobs, and carry out the
  scheduler's moves (``Scheduler.admit``: start, park, resume) through ``Seating``;
- **plan**: ``Scheduler.plan`` lays out the one ``llama_decode`` as a ``StepPlan`` —
  prompt chunks, a row per decoding slot, drafts (``Drafter``) — final as returned;
- **run**: ``BatchDecoder.decode`` decodes it (a background step may stop for an
  interactive job, and is then undone: its cells removed, the slots untouched);
- **apply**: the plan is committed to the slots, each slot's next token is chosen from
  its row with its own chain within its grammar (a draft verified row by row), and the
  step's outputs go to ``notify`` in one call;
- **prepare**: the drafts a model makes (a draft model's, MTP heads') are made for the
  next step (``Drafter.prepare``).

Requests leave between steps, so a cancel takes effect within one step. A slot keeps
its KV cells after a request ends; a new one sharing a prefix with them only prefills
the rest.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import EverycycleError, InternalError, InvalidRequestError
from ..core.jobs import Job, Output
from ..core.plan import Park, Resume, Start, StepPlan, Work
from ..core.scheduler import Scheduler
from ..core.slots import Parked, Run, Slot
from ..core.stepcost import Costs, StepCost
from ..host.contract import Notify
from ..llama.logits import RowLogits, logprob
from ..llama.vocab import Vocab
from ..spec.drafter import Drafter
from ..spec.lookup import accepted_prefix
from .batchdecode import BatchDecoder
from .sampling import Samplers
from .seating import Outputs, Seating

log = logging.getLogger(__name__)

STEP_TABLE_EVERY = 64
"""Decode steps between two publications of the step costs (``step_seconds``)."""


@dataclass
class Inbox:
    """What other threads hand the engine thread, under ``cond``."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: deque[Job] = field(default_factory=deque)
    closing: bool = False


def _log(p: float) -> float:
    """A probability's log (0 reported as the lowest float, as llama-server does)."""
    return math.log(p) if p > 0.0 else -sys.float_info.max


class StepLoop:
    """The decode loop, composed of the parts a Runner builds for its context."""

    def __init__(self, *, L: Any, ctx: Any, vocab: Vocab, logits: RowLogits,
                 samplers: Samplers, slots: list[Slot], inbox: Inbox, scheduler: Scheduler,
                 batches: BatchDecoder, seating: Seating, drafter: Drafter, costs: Costs,
                 notify: Notify, n_ctx_slot: int,
                 probe: Callable[[], tuple[bool, StepCost]],
                 embed: Callable[[list[Job], Outputs, Callable[[], None]], None],
                 label: str) -> None:
        self._L = L
        self._ctx = ctx
        self._vocab = vocab
        self._logits = logits
        self._samplers = samplers
        self.slots = slots
        self.inbox = inbox
        self.scheduler = scheduler
        self.batches = batches
        self.seating = seating
        self.drafter = drafter
        self.costs = costs
        self.notify = notify
        self._n_ctx_slot = n_ctx_slot
        self._probe = probe
        self._embed = embed
        self._label = label
        self.parked: list[Parked] = []
        self.steps = 0
        """Loop iterations with work done: a step that moves is progress."""
        self.step_seconds: tuple[float, ...] = ()
        """A decode step's seconds by rows, 1 to ``parallel`` (``Engine.step_seconds``):
        republished from the step costs every ``STEP_TABLE_EVERY`` steps, read anywhere."""
        self.lookup_exact = False
        """Whether batches are bit-exact here (probed at start)."""

    def serve(self, probed: threading.Event) -> None:
        """The thread: probe, then step until closed."""
        # Every llama_decode of this context runs on this thread, the probe too: OpenMP
        # keeps a pool per calling thread, and a second pool (more threads than cores)
        # makes libgomp sleep at every barrier (SmolLM2, 2 cores: 25% slower).
        try:
            self.lookup_exact, self.costs.decode = self._probe()
            self._publish_steps()
        except Exception:
            log.exception("probing batched decoding failed for %s", self._label)
        finally:
            probed.set()
        try:
            while self._step():
                pass
        except BaseException as exc:  # the thread must report, never vanish silently
            log.exception("engine thread for %s failed", self._label)
            err = InternalError(f"engine failed: {exc}")
            with self.inbox.cond:
                self.inbox.closing = True
                jobs = ([s.job for s in self.slots if s.job] + list(self.inbox.pending)
                        + [p.job for p in self.parked])
                self.inbox.pending.clear()
                self.parked.clear()
            self._safe_notify([(j, Output("", (), True, "error", err)) for j in jobs])

    def _step(self) -> bool:
        """One step: admit, plan, run, apply. False once closing."""
        out: Outputs = []
        embeds = self._admit(out)
        if embeds is None:
            self._safe_notify(out)
            return False
        self.steps += 1  # (progress, for the daemon's hung-engine watch)
        if embeds:
            self._embed(embeds, out, self.progressed)
        self._read_images(out)
        plan = self.scheduler.plan([s for s in self.slots if s.run is not None])
        applied = False
        if plan.n:
            try:
                rc = self.batches.decode(plan, self.inbox.pending)
            except EverycycleError as exc:
                # (LoRA scales llama.cpp would not set, before any decode: the step's own
                # jobs end with why; the engine and its other jobs go on)
                for slot in {id(w.slot): w.slot for w in plan.work}.values():
                    if slot.run is not None:
                        self._finish(slot, out, "error", exc)
                self._safe_notify(out)
                return True
            if rc is None:  # stopped and undone: an interactive job came
                pass
            elif rc != 0:
                err = InternalError(f"llama_decode returned {rc}")
                for s in self.slots:
                    if s.run is not None:
                        self._finish(s, out, "error", err)
            else:
                self._apply(plan, out)
                applied = True
        self._safe_notify(out)
        if applied:  # (after the outputs went: off the path of every token)
            self.drafter.decoded(plan)
            if self.drafter.makes:
                self._prepare(plan)
        return True

    def _admit(self, out: Outputs) -> list[Job] | None:
        """Wait for work; end cancelled jobs; carry out the scheduler's moves. Returns
        the embedding jobs to run this step, or None when the runner is closing."""
        inbox = self.inbox
        with inbox.cond:
            while not (inbox.closing or inbox.pending or self.parked
                       or any(s.run for s in self.slots)):
                inbox.cond.wait()
            for s in self.slots:
                if s.job is not None and (inbox.closing or s.job.cancel_reason is not None):
                    self._finish(s, out, "cancelled")
            for parked in list(self.parked):
                if inbox.closing or parked.job.cancel_reason is not None:
                    self.parked.remove(parked)
                    self.seating.end_parked(parked)
                    out.append((parked.job, Output("", (), True, "cancelled")))
            kept: deque[Job] = deque()
            embeds: list[Job] = []
            for job in inbox.pending:
                if inbox.closing or job.cancel_reason is not None:
                    out.append((job, Output("", (), True, "cancelled")))
                elif job.spec.embed_inputs is not None:
                    embeds.append(job)  # needs no slot: its own context
                else:
                    kept.append(job)
            inbox.pending = kept
            if inbox.closing:
                return None
            decided = self.scheduler.admit(self.slots, kept, self.parked, time.monotonic())
            for job in decided.promote:
                job.promoted = True
            for move in decided.moves:
                if isinstance(move, Park):
                    parked = self.seating.park(move.slot)
                    self.parked.append(parked)
                    out.append((parked.job, Output("", (), parked=True)))
                elif isinstance(move, Start):
                    kept.remove(move.job)
                    self.seating.start(move.job, move.slot, out, self.steps)
                elif isinstance(move, Resume):
                    self.parked.remove(move.parked)
                    self.seating.resume(move.parked, move.slot, self.steps)
                    out.append((move.parked.job, Output("", (), parked=False)))
            return embeds

    def _prepare(self, plan: StepPlan) -> None:
        """After a step (its outputs sent): the drafts a model makes for the next step,
        for the slots that took a token in this one and decode next (vLLM's
        ``update_draft_token_ids``)."""
        slots = [w.slot for w in plan.work
                 if w.sample is not None and w.slot.run is w.run and not w.run.todo]
        if slots:
            self.drafter.prepare(self.scheduler.draft_rows(slots))

    def _read_images(self, out: Outputs) -> None:
        """Jobs with images read them (and their prompt's chunks before the last text)."""
        for s in self.slots:
            run = s.run
            if run is not None and run.job.spec.images and run.prompt is None and not run.todo:
                try:
                    self.seating.images(s, self.progressed)
                except EverycycleError as exc:
                    self._finish(s, out, "error", exc)

    def _apply(self, plan: StepPlan, out: Outputs) -> None:
        """The step ran: its slots hold its tokens now; each slot whose row has logits
        takes its next tokens."""
        for w in plan.work:
            if not w.draft:  # (a draft is committed as far as it is confirmed: _verify)
                w.commit()
        for w in plan.work:  # (the last one says the whole prompt is read, as llama-server)
            if w.prompt and w.run.job.spec.progress:
                out.append((w.run.job, Output("", (), progress=w.run.n_past)))
        if not plan.filling and (self.steps % STEP_TABLE_EVERY == 0 or not self.step_seconds):
            self._publish_steps()
        for w in plan.work:
            if w.sample is None:
                continue
            if w.draft:
                self._verify(w, out)
                continue
            try:
                tok = (self._force(w.run, w.sample) if w.run.forced
                       else self._choose(w.run, w.sample))
            except InvalidRequestError as exc:
                self._finish(w.slot, out, "error", exc)
                continue
            self._take(w.slot, tok, w.run.n_past, out)

    def _choose(self, run: Run, row: int) -> int:
        """The run's next token from batch row ``row``: its chain's (greedy: the
        argmax), within its grammar, taken by both; its log-probabilities held when
        asked. Raises InvalidRequestError when the grammar allows no token."""
        if run.sampler is None:
            logits = self._logits(row)
            tok = int(logits.argmax())
            if run.grammar is not None:
                tok = run.grammar.greedy(logits, tok)
        elif run.grammar is not None:
            tok = self._samplers.sample_constrained(run.sampler, run.grammar,
                                                    self._logits(row))
        elif run.job.spec.post_sampling and run.job.spec.logprobs is not None:
            tok, probs = self._samplers.sample_with_probs(run.sampler, self._logits(row),
                                                          run.job.spec.logprobs)
            chosen = next((p for t, p in probs if t == tok), 0.0)
            run.held_logprobs.append((self._piece_text(tok), _log(chosen), tuple(
                (self._piece_text(t), _log(p), t) for t, p in probs)))
            return tok
        else:
            tok = self._L.llama_sampler_sample(run.sampler, self._ctx, row)
        if run.job.spec.post_sampling and run.job.spec.logprobs is not None:
            # greedy: the chosen token is certain
            run.held_logprobs.append((self._piece_text(tok), 0.0,
                                      ((self._piece_text(tok), 0.0, tok),)))
        elif run.job.spec.logprobs is not None:
            run.held_logprobs.append(logprob(self._logits(row), tok, run.job.spec.logprobs,
                                             self._piece_text))
        return tok

    def _force(self, run: Run, row: int) -> int:
        """The run's next forced token (a thinking budget's ending), taken as if chosen:
        its sampler chain and its grammar see it (penalties, the RNG's place), its
        log-probability is the model's. Where its grammar refuses it, the ending is
        dropped and the model goes on as the grammar allows."""
        tok = run.forced[0]
        if run.grammar is not None and not run.grammar.allows(tok):
            run.forced.clear()
            return self._choose(run, row)
        run.forced.pop(0)
        if run.grammar is not None:
            run.grammar.accept(tok)
        if run.sampler is not None:
            self._L.llama_sampler_accept(run.sampler, tok)
        if run.job.spec.logprobs is not None:
            run.held_logprobs.append(logprob(self._logits(row), tok, run.job.spec.logprobs,
                                             self._piece_text))
        return tok

    def _verify(self, w: Work, out: Outputs) -> None:
        """Check a slot's draft against the model's own choices (its own row, then the
        draft's rows, each chosen as in ``_apply``); keep the longest agreeing prefix and
        drop the rest of the draft from the KV cache. The tokens taken are exactly those
        one-at-a-time decoding would have produced from these logits."""
        run, k = w.run, w.draft
        try:
            taken = accepted_prefix(w.tokens[1:], lambda i: self._choose(run, w.rows[i]))
        except InvalidRequestError as exc:
            self._finish(w.slot, out, "error", exc)
            return
        accepted = len(taken) - 1  # draft tokens confirmed
        cut = w.commit(accepted)
        if cut is not None:
            try:
                self.batches.forget(w.slot.seq, cut)
            except EverycycleError as exc:
                self._finish(w.slot, out, "error", exc)
                return
        self.drafter.verified(run, k, accepted, w.source)
        for i, tok in enumerate(taken):
            if self._take(w.slot, tok, w.start + 1 + i, out):
                return

    def _take(self, s: Slot, tok: int, n_past: int, out: Outputs) -> bool:
        """Handle one generated token, sampled with ``n_past`` tokens in the slot's cache;
        True if it ended the job."""
        run = s.run
        assert run is not None
        job = run.job
        if self._vocab.is_eog(tok):
            if run.held_logprobs:
                run.held_logprobs.pop()  # (the end is no token of the answer)
            self._finish(s, out, "eos")
            return True
        job.n_generated += 1
        run.last = tok
        if run.drafting:
            self.drafter.took(run, tok)
        if run.features:
            text = self._piece_text(tok)
            for feature in run.features:
                run.forced = feature.took(job, text) or run.forced
        spec = job.spec
        piece = self._vocab.piece(tok, spec.special)
        if job.n_generated == 1:
            run.t_gen = time.monotonic()
        if (spec.n_indent or spec.t_max_predict_ms) and run.ends_block(
                piece.decode("utf-8", "replace"), spec.n_indent):
            job.n_generated -= 1  # (the token that leaves the block is not the answer's)
            if run.held_logprobs:
                run.held_logprobs.pop()
            self._finish(s, out, "length")
            return True
        chunk = run.add_text(tok, piece, spec.stop)
        if chunk is True:
            self._finish(s, out, "stop")
            return True
        if chunk is not False:
            out.append((job, Output(chunk[0], tuple(chunk[1]),
                                    logprobs=run.take_logprobs())))
        if job.n_generated >= spec.max_tokens or (
                spec.t_max_predict_ms and run.new_line
                and time.monotonic() - run.t_gen > spec.t_max_predict_ms / 1000):
            self._finish(s, out, "length")
        elif n_past + 1 >= self._n_ctx_slot:
            self._finish(s, out, "context")
        else:
            return False
        return True

    def _finish(self, slot: Slot, out: Outputs, reason: str,
                error: EverycycleError | None = None) -> None:
        run = slot.run
        assert run is not None
        text, ids = "", list[int]()
        if reason not in ("cancelled", "error"):
            text, ids, reason = run.final_text(reason, run.job.spec.stop)
        out.append((run.job, Output(text, tuple(ids), True, reason, error,
                                    logprobs=run.take_logprobs() if ids else None)))
        self.seating.release(slot, reason)

    def _piece_text(self, tok: int) -> str:
        return self._vocab.piece(tok, True).decode("utf-8", "replace")

    def _publish_steps(self) -> None:
        parallel = self.scheduler.parallel
        table = tuple(self.costs.decode.estimate(rows) for rows in range(1, parallel + 1))
        self.step_seconds = tuple(t for t in table if t is not None)

    def _safe_notify(self, outputs: Outputs) -> None:
        if not outputs:
            return
        try:
            self.notify(outputs)
        except Exception:
            log.exception("notify failed; %d outputs dropped", len(outputs))

    def progressed(self) -> None:
        """A step's worth of work done inside one loop pass (an embedding batch, an
        image): progress, for the hung-engine watch."""
        self.steps += 1
