"""The scheduler: each step's decisions, as plain data (``plan.py``), from plain state.

``admit`` seats jobs: a pending interactive job takes a free slot first, else parks a
background job to take its slot, so it waits at most one step; a parked job resumes
before any pending background job; a job parked for longer than its
``background_age`` is served as interactive. ``plan`` lays out the one
``llama_decode``: a row per decoding slot, then drafts (``Drafter``: a grammar's forced
tokens, prompt lookup's, a draft model's made after the step before), then prompt
chunks; the plan it returns is final; while
an interactive job reads its prompt, background jobs sit the step out (its first token
comes as soon as on an idle engine), and a background prompt reads only as many tokens
as keep the step short (``background_room``).

Nothing here calls llama.cpp or changes a slot: the step applies what it decides
(``steps.py``), and tests drive it with plain slots and jobs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from .jobs import Job, common_prefix
from .plan import Draft, Move, Park, Resume, Start, StepPlan, Work
from .slots import Parked, Run, Slot, best_slot, cells, parkable
from .stepcost import N_UBATCH, Costs, Rows, expected_accepted

STEP_BUDGET_S = 10.0
"""The longest a step reading prompts should take by the measured costs: past it, a long
prompt is read over more steps (a step is what a cancel, an interactive arrival and the
hung-engine watch wait for)."""
BACKGROUND_CHUNK = 16
"""Prompt tokens of background jobs read in one step at most (short steps, where none stop)."""
BACKGROUND_STRETCH = 2.0
"""How much longer than a decode step of every slot background prompt tokens may make a step."""
LORA_TURN = 16
"""Steps one set of LoRA scales keeps the batch while jobs of another set wait: a switch
reserves llama.cpp's graph again, so sets take turns of several steps, not one each."""


class Drafts(Protocol):
    """What the scheduler asks of speculative decoding (``spec/drafter.py``'s ``Drafter``)."""

    def propose(self, run: Run, room: int, rows: Rows, expected: float) -> Draft:
        """``run``'s draft for a step of ``rows`` so far, expected to yield ``expected``
        tokens, with room for ``room`` more rows."""
        ...

    def offers(self, run: Run, n_batch: int) -> bool:
        """Whether ``run`` has a draft ready to offer (it may lengthen the step with the
        others')."""
        ...

    def joins(self, run: Run) -> bool:
        """Whether ``run`` has a draft made for this step (a draft model's), which may
        grow with the slot's before it, all in one micro-batch."""
        ...



@dataclass
class Admission:
    """What ``admit`` decided: the moves, in order, and the parked jobs that waited too
    long (served as interactive from now on)."""

    moves: list[Move] = field(default_factory=list)
    promote: list[Job] = field(default_factory=list)


def victim_rank(slot: Slot, *, tokens: Sequence[int], drained: bool) -> tuple[int, int]:
    """How fit ``slot``'s background job is to be parked for an interactive job whose
    prompt is ``tokens`` (the highest is parked). First, the cells it shares with that
    prompt (a chat template's system turn, say): each is a token the person's first token
    need not wait for. Then, while other background work waits to take a slot freed
    early, the fewest cells (the cheapest to copy out); once none waits (``drained``),
    the least work left: that job finishes before the others even parked, so the batch
    ends no later for it, where parking the job that ends last makes it end later."""
    run = slot.run
    assert run is not None
    job = run.job
    left = job.spec.max_tokens - job.n_generated + len(run.todo)
    return common_prefix(slot.cached, tokens), -left if drained else -run.n_past


class Scheduler:
    """Decides steps for ``parallel`` slots of ``n_ctx_slot`` tokens, batches of
    ``n_batch`` rows, priced by ``costs``, drafts proposed by ``drafter``."""

    def __init__(self, *, n_batch: int, n_ctx_slot: int, parallel: int, costs: Costs,
                 drafter: Drafts) -> None:
        self.n_batch = n_batch
        self.n_ctx_slot = n_ctx_slot
        self.parallel = parallel
        self.costs = costs
        self.drafter = drafter
        self.lora: tuple[float, ...] = ()
        """The LoRA scales the last step ran with."""
        self._lora_steps = 0
        """Steps in a row with those scales while another set's jobs waited."""

    def admit(self, slots: Sequence[Slot], pending: Sequence[Job],
              parked: Sequence[Parked], now: float) -> Admission:
        """Which jobs start, park and resume on which of ``slots`` now (``now``:
        ``time.monotonic()``), interactive ones first. Cancelled jobs are gone already."""
        promote = [p.job for p in parked if p.job.background and
                   now - p.since >= (p.job.spec.background_age or 0.0)]
        decided = Admission(promote=promote)
        running = {s: s.job for s in slots if s.job is not None}
        holding = {s: s.parked for s in slots}
        waiting, parked_left = list(pending), list(parked)
        newly_parked: list[Job] = []

        def background(job: Job) -> bool:
            return job.background and job not in promote

        while True:
            free = [s for s in slots if s not in running]
            resume = next((p for p in parked_left if not background(p.job)), None)
            start = next((j for j in waiting if not background(j)), None)
            vacated: Slot | None = None  # (a slot just parked: its cells the parked job's)
            if resume is None and start is None:  # no interactive job waits
                if not free:
                    break
                if parked_left:
                    resume = parked_left[0]
                elif waiting:
                    start = waiting[0]
                else:
                    break
            elif not free:
                victims = [s for s in slots if s in running and running[s] is s.job
                           and parkable(s)]
                if not victims:
                    break
                drained = not any(background(j) for j in [
                    *waiting, *(p.job for p in parked_left), *newly_parked])
                tokens = start.spec.tokens if resume is None and start else ()
                vacated = max(victims, key=partial(victim_rank, tokens=tokens,
                                                   drained=drained))
                decided.moves.append(Park(vacated))
                newly_parked.append(running.pop(vacated))
                free = [vacated]
            if resume is not None:
                slot = self._resume_slot(resume, free, holding, running)
                decided.moves.append(Resume(resume, slot))
                parked_left.remove(resume)
                running[slot] = resume.job
            else:
                assert start is not None
                slot, _ = best_slot(
                    [s for s in free if holding[s] is None and s is not vacated] or free,
                    start.spec.tokens, cells(start.spec.lora))
                decided.moves.append(Start(start, slot))
                waiting.remove(start)
                running[slot] = start
            holding[slot] = None  # (what it held is copied out, or resumed)
        return decided

    @staticmethod
    def _resume_slot(parked: Parked, free: Collection[Slot],
                     holding: dict[Slot, Parked | None], running: Collection[Slot]
                     ) -> Slot:
        """Where a parked job resumes: its own slot when still untouched, else one that
        holds no other parked job's cells, the least recently used."""
        own = parked.slot
        if own is not None and own not in running and holding.get(own) is parked:
            return own
        return min(free, key=lambda s: (holding[s] is not None, s.used))

    def plan(self, active: Sequence[Slot]) -> StepPlan:
        """The next ``llama_decode`` for the slots with a job: a token per decoding slot
        first, then drafts, then prompt chunks."""
        runs = [(s, s.run) for s in active if s.run is not None]
        if any(r.todo and not r.job.background for _, r in runs):
            runs = [(s, r) for s, r in runs if not r.job.background]
        lora = self._lora_turn([cells(r.job.spec.lora) for _, r in runs],
                               [cells(r.job.spec.lora) for _, r in runs
                                if not r.job.background])
        runs = [(s, r) for s, r in runs if cells(r.job.spec.lora) == lora]
        plan = StepPlan(lora=lora)
        n = 0
        for s, r in runs:
            if not r.todo:
                plan.work.append(Work(s, r, r.n_past, [r.last], [], sample=0))
                n += 1
        expected = float(n)  # the tokens this step should yield
        decoding = list(plan.work)
        leads = self._leads([w.run for w in decoding])
        joins: list[bool] = []  # (whether each has a draft made to join others' with)
        for at, w in enumerate(decoding):  # drafts after every slot has its row
            r = w.run
            if not self._may_draft(r):
                continue
            if not joins:
                joins = [self._may_draft(x.run) and self.drafter.joins(x.run)
                         for x in decoding]
            rows = Rows(tuple((x.slot.seq, len(x.tokens)) for x in decoding), at,
                        lead=leads[at],
                        peers=tuple(i for i in range(at + 1, len(decoding)) if joins[i]))
            draft = self.drafter.propose(r, self._room(r, n), rows, expected)
            if not draft.tokens:
                continue
            expected += expected_accepted(draft.rate, len(draft.tokens))
            w.tokens.extend(draft.tokens)
            w.draft, w.source = len(draft.tokens), draft.source
            n += len(draft.tokens)
        background_room = self.background_room(n)
        limit = self.step_rows() if any(r.todo for _, r in runs) else self.n_batch
        for s, r in runs:
            if not r.todo or n >= limit:
                continue
            room = limit - n
            if r.job.background:
                room = min(room, background_room)
                if room <= 0:
                    continue
                background_room -= room
            take = r.todo[:room]
            n += len(take)
            plan.work.append(Work(s, r, r.n_past, take, [], prompt=len(take),
                                  sample=0 if len(take) == len(r.todo) else None))
        plan.settle()
        return plan

    def step_rows(self) -> int:
        """Rows a step reading prompts may have: micro-batches (``N_UBATCH``) up to the
        whole batch (``n_batch``), as many as such a step is measured to take at most
        STEP_BUDGET_S for; one micro-batch before any was measured."""
        unit = min(self.n_batch, N_UBATCH)
        rows = unit
        while rows + unit <= self.n_batch and (
                (took := self.costs.fill.estimate(rows + unit)) is not None
                and took <= STEP_BUDGET_S):
            rows += unit
        return rows

    def draft_rows(self, slots: Sequence[Slot]) -> list[tuple[Slot, int, Rows, float]]:
        """For the drafts made before the next step (``Drafter.prepare``): each of
        ``slots`` (decoding next) that may draft, with its room and its rows in a step of
        one row for each of them (its peers: the others after it), and the tokens such a
        step should yield."""
        runs = [s.run for s in slots if s.run is not None]
        leads = self._leads(runs)
        shape = tuple((s.seq, 1) for s in slots)
        return [(s, self._room(r, len(slots)), Rows(shape, at, lead=leads[at],
                                                    peers=tuple(range(at + 1, len(slots)))),
                 float(len(slots)))
                for at, (s, r) in enumerate(zip(slots, runs, strict=True))
                if self._may_draft(r)]

    @staticmethod
    def _may_draft(run: Run) -> bool:
        """Whether ``run`` may draft: some method drafts for it, nothing is forced on it,
        and none of its features takes token by token now."""
        return bool(run.drafting) and not run.forced and all(
            f.may_draft() for f in run.features)

    def _room(self, run: Run, rows: int) -> int:
        """Draft rows ``run`` may have in a step of ``rows`` rows so far: within the
        batch, its context, and its ``max_tokens``."""
        return min(self.n_batch - rows, self.n_ctx_slot - run.n_past - 1,
                   run.job.spec.max_tokens - run.job.n_generated - 1)

    def _leads(self, runs: Sequence[Run]) -> list[bool]:
        """Whether each of the decoding ``runs`` may lengthen the step with its draft:
        where every one has a lookup draft to offer, any may (the others join its rows:
        all get ahead together); else only the one with the most left (``Rows.lead``)."""
        if len(runs) > 1 and all(r.drafting and self.drafter.offers(r, self.n_batch)
                                 for r in runs):
            return [True] * len(runs)
        left = [self._left(r) for r in runs]
        return [all(left[at] > v for i, v in enumerate(left) if i != at)
                for at in range(len(runs))]

    def _left(self, run: Run) -> int:
        """Tokens ``run`` may make yet: to its ``max_tokens``, or its context's end."""
        return min(self.n_ctx_slot - run.n_past, run.job.spec.max_tokens - run.job.n_generated)

    def _lora_turn(self, sets: Sequence[tuple[float, ...]],
                   interactive: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
        """The LoRA scales this step runs (only its jobs are in it): the last step's while
        its jobs are here, for LORA_TURN steps at most while another set waits, then the
        next set (an interactive job's first)."""
        if not sets:
            return self.lora
        waiting = [s for s in sets if s != self.lora]
        if self.lora in sets and (not waiting or self._lora_steps < LORA_TURN) and (
                not interactive or self.lora in interactive):
            self._lora_steps = self._lora_steps + 1 if waiting else 0
            return self.lora
        self.lora = next((s for s in interactive if s != self.lora), waiting[0])
        self._lora_steps = 1 if len(set(sets)) > 1 else 0
        return self.lora

    def background_room(self, rows: int) -> int:
        """Prompt tokens of background jobs a step of ``rows`` other rows may read: as
        many as keep it within BACKGROUND_STRETCH times a decode step of every slot (by
        the measured step costs), at least 1, at most BACKGROUND_CHUNK. A short step: an
        interactive job arriving waits little for it, or loses little work stopping it."""
        cost = self.costs.decode
        base = cost.estimate(max(rows, self.parallel))
        if base is None:
            return BACKGROUND_CHUNK
        room = 1
        while room < BACKGROUND_CHUNK and (
                (step := cost.estimate(rows + room + 1)) is not None
                and step <= BACKGROUND_STRETCH * base):
            room += 1
        return room
