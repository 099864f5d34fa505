"""The one interface every speculative method implements (``Proposer``), what a slot's
draft is weighed against as a step is planned (``Weighing``), and the counts each
method keeps (``DraftCount``). No llama.cpp here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.plan import Draft, StepPlan
from ..core.slots import Run, Slot
from ..core.stepcost import Rows, StepCost


@dataclass(slots=True)
class Weighing:
    """What a slot's draft is weighed against: the step's rows so far (``rows``: the
    decoding slots'), the tokens it is expected to yield, what a step costs by its rows,
    the rows left (``room``) and those the slot may fill without a micro-batch of its own
    (``own``: a slot that is not the one with the most left may only join the rows of
    other slots' drafts, since a micro-batch of its own makes the step longer for every
    slot while the batch ends no sooner for its draft). Made for every decoding slot
    each step: a plain record (a frozen one's set-up took 0.69 µs here, this 0.16)."""

    room: int
    own: int
    rows: Rows
    expected: float
    cost: StepCost

    def length(self, rate: float, most: int) -> int:
        """The length of a draft of tokens each right with chance ``rate`` (``most`` at
        most) that gives the most tokens a second; 0 where none beats not drafting."""
        return self.cost.draft_len(self.rows, self.expected, rate, most)


@dataclass
class DraftCount:
    """A method's draft tokens the model verified so far, and those it confirmed."""

    method: str
    drafted: int = 0
    accepted: int = 0


class Proposer(Protocol):
    """One speculative method. ``name`` (given by ``methods.py``, the list of them) keys
    its state in a run (``Run.drafting``), its drafts (``Draft.source``) and its counts.
    Engine thread only."""

    name: str
    count: DraftCount
    makes: bool
    """Whether it makes its drafts with a model, before each step (``prepare``)."""

    def start(self, run: Run) -> Any:
        """Its state for a newly seated run; None where it drafts nothing for it."""
        ...

    def propose(self, state: Any, weighing: Weighing, best: Draft) -> Draft:
        """Its draft for the run whose ``state`` this is, or ``best`` (the earlier
        methods' best so far) where that pays more."""
        ...

    def offers(self, state: Any, n_batch: int) -> bool:
        """Whether it has a draft ready for the run now (its rows may lengthen a step)."""
        ...

    def joins(self, state: Any) -> bool:
        """Whether it has a draft made for the run's step, to grow with others' drafts
        in one micro-batch."""
        ...

    def prepare(self, items: Sequence[tuple[Slot, Any, Weighing]]) -> None:
        """Before the next step: make the drafts it makes with a model (a draft model's,
        MTP heads') for the runs on ``items``' slots (each with its state and how its
        next step's draft would be weighed), where they pay, in one go; the next plan
        proposes them. Raises EverycycleError where it cannot (the method is then
        dropped)."""
        ...

    def took(self, state: Any, token: int) -> None:
        """The run took ``token`` (generated, or confirmed from a draft)."""
        ...

    def decoded(self, plan: StepPlan) -> None:
        """The target decoded ``plan`` (before its slots take it: a method that keeps
        its own copy of the slots' cells, as MTP heads do, follows them). Raises
        EverycycleError where it cannot (the method is then dropped)."""
        ...

    def verified(self, state: Any, drafted: int, accepted: int) -> None:
        """Its draft of ``drafted`` tokens had its first ``accepted`` confirmed."""
        ...

    def ended(self, state: Any, cached: Sequence[int], n_prompt: int) -> None:
        """The run ended cleanly with ``cached`` in its slot (``n_prompt`` of them its
        prompt)."""
        ...
