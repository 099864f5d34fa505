"""Drafts a model makes once the plan is laid out, paced per run: a draft model beside
the target (``draftmodel.py``, llama-server's ``-md``) or the target's own next-token
heads (``mtp.py``). A run drafts only where its expected confirmed tokens pay for the
rows they add to the step and for the drafter's own decoding (``StepCost.joint_plan``),
and only where that pays more than the earlier methods' draft (prompt lookup's). The
tokens are made once the plan is laid out (``fill``: one batched drafting for every run
that asked). A run whose drafts stop paying rests from them (8 steps, doubling to 256
while they keep failing), then tries a short one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..core.plan import Draft, StepPlan, Work
from ..core.slots import Run
from ..core.stepcost import Costs, StepCost
from .draftmodel import Ask, DraftLimits
from .lookup import Acceptance
from .proposer import DraftCount, Weighing

PROBE = 2
"""Tokens of the draft a slot tries when a rest ends."""
CATCH_UP_SHARE = 0.5
"""How much longer than the model's step the draft model's reading of tokens it has not
seen (a new prompt) may make a step: a long prompt is read over several steps."""
CATCH_UP_MIN = 64
REST_FIRST = 8
REST_MAX = 256
"""Steps a slot rests from model drafts once they stop paying: the first time, and at
most (each rest that ends in a failed try doubles the next)."""


@dataclass
class Pace:
    """A run's drafting with the draft model: how its drafts do, and its rest."""

    acceptance: Acceptance
    rest: int = 0
    """Steps left before it may draft again."""
    backoff: int = REST_FIRST
    """The next rest's length."""
    tried: bool = False
    """Whether it has drafted since its last rest began, or since it started (else, where
    no draft the model's rate says pays, it tries a short one: a new request learns its
    own rate at once, where the model's so far says not to draft)."""


class Maker(Protocol):
    """What makes the drafts (a ``DraftModel``, ``MtpHeads``): its limits, what its
    drafting steps cost, the drafts."""

    limits: DraftLimits
    cost: StepCost

    def draft(self, asks: Sequence[Ask], budget: int) -> list[list[int]]:
        """Each ask's draft (reading at most ``budget`` tokens to catch up). Raises
        EverycycleError where llama.cpp fails."""
        ...

    def decoded(self, plan: StepPlan) -> None:
        """The target decoded ``plan`` (before its slots take it)."""
        ...


class PacedDrafts:
    """Drafts ``model`` makes, paced per run; ``name`` is the method's."""

    def __init__(self, name: str, costs: Costs, model: Maker) -> None:
        self.name = name
        self._costs = costs
        self.model = model
        self.acceptance = Acceptance()
        """How its drafts do on this model, all runs together: a new run's start."""
        self._asked = 0
        """Runs that asked for a draft for this step so far (``fill`` resets it)."""
        self.count = DraftCount(self.name)

    def start(self, run: Run) -> Pace | None:
        spec = run.job.spec
        if not spec.draft or spec.images:
            return None
        return Pace(self.acceptance.copy())

    def propose(self, pace: Pace, weighing: Weighing, best: Draft) -> Draft:
        w, model = weighing, self.model
        if w.room <= 0:
            return best
        if pace.rest > 0:
            pace.rest -= 1
            return best
        rate = pace.acceptance.rate
        available = min(w.room, model.limits.n_max)
        # (it and its peers draft together: one drafting step of all their rows a token)
        step = model.cost.estimate(1 + len(w.rows.peers) + self._asked) or 0.0
        n, speed = w.cost.joint_plan(w.rows, w.expected, rate, available, lambda d: d * step)
        if best.tokens and w.cost.draft_plan(w.rows, w.expected, best.rate,
                                             len(best.tokens))[1] >= speed:
            return best
        if n == 0:
            # A short try after a rest, to learn whether drafts pay again: only where a
            # draft the target always confirmed would pay (on a CPU whose rows cost what
            # a step does, with a draft model not much cheaper than the target, none
            # does: trying costs the draft model's catching up, for nothing).
            if not pace.tried and w.cost.joint_plan(w.rows, w.expected, 1.0, available,
                                                    lambda d: d * step)[0]:
                pace.tried = True
                self._asked += 1
                return Draft([], rate, self.name, min(PROBE, available))
            pace.rest, pace.backoff = pace.backoff, min(2 * pace.backoff, REST_MAX)
            pace.tried = False
            return best
        pace.backoff = REST_FIRST
        self._asked += 1
        return Draft([], rate, self.name, n)

    def offers(self, pace: Pace, n_batch: int) -> bool:
        return False

    def joins(self, pace: Pace) -> bool:
        return not pace.rest

    def fill(self, works: Sequence[Work], rows: int) -> None:
        """Make the tokens ``works`` asked for in one batched drafting; a work whose
        draft came out empty (its sequence still catching up, the draft model unsure)
        drafts nothing. Raises EverycycleError where the draft model fails."""
        asks = [Ask(w.slot.seq, [*w.slot.cached, w.run.last], w.ask) for w in works]
        self._asked = 0
        for w, tokens in zip(works, self.model.draft(asks, self._catch_up(rows)),
                             strict=True):
            w.tokens.extend(tokens)
            w.draft, w.ask = len(tokens), 0

    def _catch_up(self, rows: int) -> int:
        """Tokens the draft model may read this step to catch up: as many as it reads in
        CATCH_UP_SHARE of the model's step of ``rows`` rows (CATCH_UP_MIN at least)."""
        step, cost = self._costs.decode.estimate(rows), self.model.cost
        budget = CATCH_UP_MIN
        if step is None:
            return budget
        while (took := cost.estimate(2 * budget)) is not None and \
                took <= CATCH_UP_SHARE * step and budget < 1 << 16:
            budget *= 2
        return budget

    def took(self, pace: Pace, token: int) -> None:
        pass

    def decoded(self, plan: StepPlan) -> None:
        self.model.decoded(plan)

    def verified(self, pace: Pace, drafted: int, accepted: int) -> None:
        self.acceptance.learn(drafted, accepted)
        pace.acceptance.learn(drafted, accepted)

    def ended(self, pace: Pace, cached: Sequence[int], n_prompt: int) -> None:
        pass
