"""Drafts: tokens put in a step's batch after a slot's own row, for the model to confirm
in that one step. Three sources: the tokens a slot's grammar forces (llguidance's
fast-forward tokens: after ``{"`` of an object whose first key is ``title``, that key),
prompt-lookup drafts (``lookup.py``), and a draft model's (``draftmodel.py``). The
scheduler asks the ``Drafter`` for a slot's draft as it plans a step; a draft model's
tokens are made once the plan is laid out (``fill``: one batched drafting for every slot
that asked). The step verifies a draft by choosing each row's token exactly as
one-at-a-time decoding would (greedy or sampled, within the grammar), so a draft changes
no choice, only how many steps they take (and, where a batch's rows are not bit-exact,
llama.cpp's numerics).

One policy chooses, from what steps cost here as measured: a draft is proposed only
where its expected confirmed tokens pay for the rows it adds to the step, and, a draft
model's, for that model's own decoding (``StepCost.joint_plan``); of lookup's and the
draft model's, the one promising more tokens a second. A slot whose model drafts stop
paying rests from them (8 steps, doubling to 256 while they keep failing), then tries
a short one. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..core.plan import DraftSource, Work
from ..core.slots import Run
from ..core.stepcost import Costs, Rows
from .draftmodel import Ask, DraftModel
from .pace import REST_FIRST, REST_MAX, Pace

FORCED_RATE = 0.95
"""The chance a forced token is the model's choice too: it is, unless the model spells
the same text with other tokens (llguidance forces the canonical ones)."""
PROBE = 2
"""Tokens of the draft a slot tries when a rest ends."""
CATCH_UP_SHARE = 0.5
"""How much longer than the model's step the draft model's reading of tokens it has not
seen (a new prompt) may make a step: a long prompt is read over several steps."""
CATCH_UP_MIN = 64



@dataclass(frozen=True)
class Draft:
    """A slot's draft for one step: its tokens, the chance each is right given the ones
    before it were, and where they come from. A draft model's comes as ``ask``, the
    tokens wanted, its tokens made by ``Drafter.fill``."""

    tokens: list[int]
    rate: float = 0.0
    source: DraftSource = "lookup"
    ask: int = 0


NO_DRAFT = Draft([])


class Drafter:
    """Proposes drafts as long as their rows (and their making) pay, makes a draft
    model's, and counts what was drafted and confirmed."""

    def __init__(self, costs: Costs, model: DraftModel | None = None) -> None:
        self._costs = costs
        self.model = model
        """The draft model (None: none)."""
        self._asked = 0
        """Slots that asked the draft model for this step so far (``fill`` resets it)."""
        self.lookup_drafted = 0
        """Prompt-lookup draft tokens proposed, and those the model confirmed."""
        self.lookup_accepted = 0
        self.forced_drafted = 0
        """Draft tokens a grammar forced, and those the model confirmed."""
        self.forced_accepted = 0

    def pace(self) -> Pace | None:
        """A new job's pace with the draft model (None: there is none): its start, how
        the model's drafts have done on every slot."""
        if self.model is None:
            return None
        return Pace(self.model.acceptance.copy())

    def propose(self, run: Run, room: int, rows: Rows, expected: float) -> Draft:
        """``run``'s draft for a step of ``rows`` so far (the decoding slots'), expected to yield
        ``expected`` tokens, with room for ``room`` more: the tokens its grammar forces
        (the model confirms them, barring another spelling of the same text), else a
        prompt-lookup draft or a draft model's, whichever pays more."""
        cost = self._costs.decode
        # A slot that is not the one with the most left may only join the rows of other
        # slots' drafts: a micro-batch of its own makes the step longer for every slot,
        # and the batch ends no sooner for its draft (it ends before the others anyway).
        own = room if rows.lead else min(room, rows.joinable - 1)
        if run.grammar is not None and own > 0:
            forced = run.grammar.forced(own)
            if forced:
                n = cost.draft_len(rows, expected, FORCED_RATE, len(forced))
                return Draft(forced[:n], FORCED_RATE, "forced")
        lookup = NO_DRAFT
        if run.lookup is not None:
            tokens = run.lookup.propose(own, partial(cost.draft_len, rows, expected))
            if tokens:
                lookup = Draft(tokens, run.lookup.rate)
        pace, model = run.pace, self.model
        if pace is None or model is None or room <= 0:
            return lookup
        if pace.rest > 0:
            pace.rest -= 1
            return lookup
        rate = pace.acceptance.rate
        available = min(room, model.limits.n_max)
        # (it and its peers draft together: one drafting step of all their rows a token)
        step = model.cost.estimate(1 + len(rows.peers) + self._asked)
        n, speed = cost.joint_plan(rows, expected, rate, available,
                                   lambda d: d * (step or 0.0))
        if lookup.tokens and cost.draft_plan(rows, expected, lookup.rate,
                                             len(lookup.tokens))[1] >= speed:
            return lookup
        if n == 0:
            # A short try after a rest, to learn whether drafts pay again: only where a
            # draft the target always confirmed would pay (on a CPU whose rows cost what
            # a step does, with a draft model not much cheaper than the target, none
            # does: trying costs the draft model's catching up, for nothing).
            if not pace.tried and cost.joint_plan(rows, expected, 1.0, available,
                                                  lambda d: d * (step or 0.0))[0]:
                pace.tried = True
                self._asked += 1
                return Draft([], rate, "model", min(PROBE, available))
            pace.rest, pace.backoff = pace.backoff, min(2 * pace.backoff, REST_MAX)
            pace.tried = False
            return lookup
        pace.backoff = REST_FIRST
        self._asked += 1
        return Draft([], rate, "model", n)

    def fill(self, works: list[Work], rows: int) -> None:
        """Make the draft model's tokens for ``works`` (each asking for ``ask``) for a step
        of ``rows`` rows, in one batched drafting; a work whose draft came out empty (its
        sequence still catching up, the draft model unsure) drafts nothing."""
        model = self.model
        assert model is not None
        asks = [Ask(w.slot.seq, [*w.slot.cached, w.run.last], w.ask) for w in works]
        self._asked = 0
        for w, tokens in zip(works, model.draft(asks, self._catch_up(rows)), strict=True):
            w.tokens.extend(tokens)
            w.draft, w.ask = len(tokens), 0

    def _catch_up(self, rows: int) -> int:
        """Tokens the draft model may read this step to catch up: as many as it reads in
        CATCH_UP_SHARE of the model's step of ``rows`` rows (CATCH_UP_MIN at least)."""
        assert self.model is not None
        step, cost = self._costs.decode.estimate(rows), self.model.cost
        budget = CATCH_UP_MIN
        if step is None:
            return budget
        while (took := cost.estimate(2 * budget)) is not None and \
                took <= CATCH_UP_SHARE * step and budget < 1 << 16:
            budget *= 2
        return budget

    def verified(self, run: Run, drafted: int, accepted: int, source: DraftSource) -> None:
        """``run``'s draft of ``drafted`` tokens had its first ``accepted`` confirmed."""
        run.job.n_drafted += drafted
        run.job.n_draft_accepted += accepted
        if source == "forced":
            self.forced_drafted += drafted
            self.forced_accepted += accepted
        elif source == "model":
            assert self.model is not None and run.pace is not None
            self.model.verified(drafted, accepted)
            run.pace.acceptance.learn(drafted, accepted)
        else:
            assert run.lookup is not None
            run.lookup.verified(drafted, accepted)
            self.lookup_drafted += drafted
            self.lookup_accepted += accepted
