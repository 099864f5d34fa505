"""Drafts: tokens put in a step's batch after a slot's own row, for the model to confirm
in that one step. Each method is a ``Proposer`` (``proposer.py``); ``methods.py`` lists
them. The scheduler asks the ``Drafter`` for a slot's draft as it plans a step, and the
Drafter asks each method in order, each weighing its draft against the best so far; a
method that drafts with a model makes its tokens after each step for the next
(``prepare``), so the plan is final as the scheduler returns it. The step verifies a draft by choosing each row's token exactly
as one-at-a-time decoding would (greedy or sampled, within the grammar), so a draft
changes no choice, only how many steps they take (and, where a batch's rows are not
bit-exact, llama.cpp's numerics). Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ...errors import EverycycleError
from ..core.plan import NO_DRAFT, Draft, StepPlan
from ..core.slots import Run, Slot
from ..core.stepcost import Costs, Rows
from .proposer import DraftCount, Proposer, Weighing

log = logging.getLogger(__name__)


class Drafter:
    """Asks the methods for drafts, makes the ones asked for, keeps each run's state per
    method (``Run.drafting``), and counts what each drafted and the model confirmed."""

    def __init__(self, costs: Costs, proposers: Sequence[Proposer], label: str = "") -> None:
        self._costs = costs
        self.proposers = list(proposers)
        """The methods asked, in order (one that fails is dropped from it)."""
        self._by_name = {p.name: p for p in proposers}
        self._asked = dict(self._by_name)
        """The methods still asked, by name."""
        self._label = label

    def start(self, run: Run) -> None:
        """A run is seated: each method that drafts for it keeps its state there."""
        for p in self.proposers:
            state = p.start(run)
            if state is not None:
                run.drafting[p.name] = state

    def propose(self, run: Run, room: int, rows: Rows, expected: float) -> Draft:
        """``run``'s draft for a step of ``rows`` so far (the decoding slots'), expected to
        yield ``expected`` tokens, with room for ``room`` more rows: each method's, where
        it pays more than the earlier ones' (a method's ``final`` draft ends the asking)."""
        weighing = self._weighing(room, rows, expected)
        best = NO_DRAFT
        for p in self.proposers:
            state = run.drafting.get(p.name)
            if state is not None:
                best = p.propose(state, weighing, best)
                if best.final:
                    break
        return best

    def offers(self, run: Run, n_batch: int) -> bool:
        asked = self._asked
        return any((p := asked.get(name)) is not None and p.offers(state, n_batch)
                   for name, state in run.drafting.items())

    def joins(self, run: Run) -> bool:
        asked = self._asked
        return any((p := asked.get(name)) is not None and p.joins(state)
                   for name, state in run.drafting.items())

    @property
    def makes(self) -> bool:
        """Whether a method makes drafts before each step (``prepare`` has work)."""
        return any(p.makes for p in self.proposers)

    def prepare(self, entries: Sequence[tuple[Slot, int, Rows, float]]) -> None:
        """After a step, before the next: the methods that draft with a model make their
        drafts for the runs on ``entries``' slots (each with its room, its rows in the
        next step and the tokens that step should yield: ``Scheduler.draft_rows``). A
        method that fails is dropped (said once in the log); the next step goes on."""
        for p in list(self.proposers):
            items = [(slot, slot.run.drafting[p.name], self._weighing(room, rows, expected))
                     for slot, room, rows, expected in entries
                     if slot.run is not None and p.name in slot.run.drafting]
            if not items:
                continue
            try:
                p.prepare(items)
            except Exception as exc:  # noqa: BLE001 - a method's failure ends only it
                self._drop(p, exc)

    def decoded(self, plan: StepPlan) -> None:
        """The target decoded ``plan``: the methods that follow its cells see it. One
        that fails is dropped, as in ``fill``."""
        for p in list(self.proposers):
            try:
                p.decoded(plan)
            except Exception as exc:  # noqa: BLE001 - a method's failure ends only it
                self._drop(p, exc)

    def took(self, run: Run, token: int) -> None:
        asked = self._asked
        for name, state in run.drafting.items():
            p = asked.get(name)
            if p is not None:
                p.took(state, token)

    def verified(self, run: Run, drafted: int, accepted: int, source: str) -> None:
        """``run``'s draft of ``drafted`` tokens (by method ``source``) had its first
        ``accepted`` confirmed."""
        run.job.n_drafted += drafted
        run.job.n_draft_accepted += accepted
        p = self._by_name[source]
        p.count.drafted += drafted
        p.count.accepted += accepted
        state = run.drafting.get(source)
        if state is not None:
            p.verified(state, drafted, accepted)

    def ended(self, run: Run, cached: Sequence[int]) -> None:
        """``run`` ended cleanly with ``cached`` in its slot."""
        for name, state in run.drafting.items():
            p = self._asked.get(name)
            if p is not None:
                p.ended(state, cached, run.job.n_prompt)

    def counts(self) -> tuple[DraftCount, ...]:
        """Each method's counts since the model loaded (a dropped one's too)."""
        return tuple(DraftCount(p.name, p.count.drafted, p.count.accepted)
                     for p in self._by_name.values())

    def _drop(self, p: Proposer, exc: Exception) -> None:
        why = exc.message if isinstance(exc, EverycycleError) else f"{type(exc).__name__}: {exc}"
        log.error("%s: %s drafting stops: %s", self._label, p.name, why)
        self.proposers.remove(p)
        del self._asked[p.name]

    def _weighing(self, room: int, rows: Rows, expected: float) -> Weighing:
        # A slot that is not the one with the most left may only join the rows of other
        # slots' drafts (``Weighing.own``).
        own = room if rows.lead else min(room, rows.joinable - 1)
        return Weighing(room, own, rows, expected, self._costs.decode)
