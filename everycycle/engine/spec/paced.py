"""Drafts a model makes, paced per run: a draft model beside the target
(``draftmodel.py``, llama-server's ``-md``) or the target's own next-token heads
(``mtp.py``). A run drafts only where its expected confirmed tokens pay for the rows
they add to a step and for the drafter's own decoding (``StepCost.joint_plan``). The
tokens are made after each step for the next (``prepare``: one batched drafting for
every run that drafts; vLLM's ``update_draft_token_ids``), so the next plan is final as
it is made: it takes as many of them as pay in its rows, or prompt lookup's where they
promise more. A run whose drafts stop paying rests from them (8 steps, doubling to 256
while they keep failing), then tries a short one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..core.plan import Draft, StepPlan
from ..core.slots import Run, Slot
from ..core.stepcost import Costs, StepCost, expected_accepted
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
    ready: list[int] = field(default_factory=list)
    """Tokens made for its next step (after its last token), until it takes a token."""
    trying: bool = False
    """``ready`` is a short try after a rest: the next step takes it as it is, to learn
    whether drafts pay again (weighed again at the rate that said they do not, it never
    would be)."""


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
        self.count = DraftCount(self.name)
        self.makes = True

    def start(self, run: Run) -> Pace | None:
        spec = run.job.spec
        if not spec.draft or spec.images:
            return None
        return Pace(self.acceptance.copy())

    def propose(self, pace: Pace, weighing: Weighing, best: Draft) -> Draft:
        """The tokens made for the run before this step (``prepare``), as many as pay in
        this step's rows now; or ``best`` where they promise less."""
        w = weighing
        tokens = pace.ready[:max(w.room, 0)]
        if not tokens:
            return best
        rate = pace.acceptance.rate
        if pace.trying and not best.tokens:
            return Draft(tokens, rate, self.name)
        # (made already: no making to pay for; grown with its peers' alike)
        n, speed = w.cost.joint_plan(w.rows, w.expected, rate, len(tokens), lambda d: 0.0)
        if n == 0 or (best.tokens and w.cost.draft_plan(
                w.rows, w.expected, best.rate, len(best.tokens))[1] >= speed):
            return best
        return Draft(tokens[:n], rate, self.name)

    def offers(self, pace: Pace, n_batch: int) -> bool:
        return False

    def joins(self, pace: Pace) -> bool:
        return bool(pace.ready)

    def prepare(self, items: Sequence[tuple[Slot, Pace, Weighing]]) -> None:
        """Decide, for each run on ``items`` with no draft ready, how many tokens to
        draft for its next step (the pacing: only where they pay for their rows and their
        making), and make them all in one batched drafting. Raises EverycycleError where
        the model fails."""
        waiting = [(slot, pace, w) for slot, pace, w in items if not pace.ready]
        # (its peers: the runs after it this method may draft for in the same step)
        drafting = {w.rows.at for _, pace, w in items if not pace.rest}
        asks: list[Ask] = []
        paces: list[Pace] = []
        grown: dict[int, int] = {}  # (the drafts asked so far, by row index, as a plan lays them)
        gain = 0.0
        for slot, pace, w in waiting:
            rows = replace(
                w.rows, shape=tuple((seq, n + grown.get(i, 0))
                                    for i, (seq, n) in enumerate(w.rows.shape)),
                peers=tuple(i for i in w.rows.peers if i in drafting))
            weighing = replace(w, rows=rows, expected=w.expected + gain)
            n = self._length(pace, weighing, len(asks))
            if n and slot.run is not None:
                asks.append(Ask(slot.seq, [*slot.cached, slot.run.last], n))
                paces.append(pace)
                grown[w.rows.at] = n
                gain += expected_accepted(pace.acceptance.rate, n)
        if not asks:
            return
        made = self.model.draft(asks, self._catch_up(len(items)))
        for pace, tokens in zip(paces, made, strict=True):
            pace.ready = tokens

    def _length(self, pace: Pace, w: Weighing, asked: int) -> int:
        """How many tokens to draft for the run of ``pace`` (0: none), its rest counted
        down; ``asked``: runs asked for a draft before it in this drafting step."""
        rows = w.rows
        pace.trying = False
        if w.room <= 0:
            return 0
        if pace.rest > 0:
            pace.rest -= 1
            return 0
        rate = pace.acceptance.rate
        available = min(w.room, self.model.limits.n_max)
        # (it and its peers draft together: one drafting step of all their rows a token)
        step = self.model.cost.estimate(1 + len(rows.peers) + asked) or 0.0
        n, _ = w.cost.joint_plan(rows, w.expected, rate, available, lambda d: d * step)
        if n == 0:
            # A short try after a rest, to learn whether drafts pay again: only where a
            # draft the target always confirmed would pay (on a CPU whose rows cost what
            # a step does, with a draft model not much cheaper than the target, none
            # does: trying costs the draft model's catching up, for nothing).
            if not pace.tried and w.cost.joint_plan(rows, w.expected, 1.0, available,
                                                    lambda d: d * step)[0]:
                pace.tried = pace.trying = True
                return min(PROBE, available)
            pace.rest, pace.backoff = pace.backoff, min(2 * pace.backoff, REST_MAX)
            pace.tried = False
            return 0
        pace.backoff = REST_FIRST
        return n

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
        pace.ready = []  # (made after the run's last token, which is not last now)

    def decoded(self, plan: StepPlan) -> None:
        self.model.decoded(plan)

    def verified(self, pace: Pace, drafted: int, accepted: int) -> None:
        self.acceptance.learn(drafted, accepted)
        pace.acceptance.learn(drafted, accepted)

    def ended(self, pace: Pace, cached: Sequence[int], n_prompt: int) -> None:
        pass
