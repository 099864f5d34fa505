"""Drafts: tokens put in a step's batch after a slot's own row, for the model to confirm
in that one step. Two kinds: the tokens a slot's grammar forces (llguidance's
fast-forward tokens: after ``{"`` of an object whose first key is ``title``, that key),
and prompt-lookup drafts (``lookup.py``). The scheduler asks the ``Drafter`` for a
slot's draft as it plans a step; the step verifies it by choosing each row's token
exactly as one-at-a-time decoding would (greedy or sampled, within the grammar), so a
draft changes no choice, only how many steps they take (and, where a batch's rows are
not bit-exact, llama.cpp's numerics). No llama.cpp here. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from .lookup import Costs
from .slots import Run

FORCED_RATE = 0.95
"""The chance a forced token is the model's choice too: it is, unless the model spells
the same text with other tokens (llguidance forces the canonical ones)."""


@dataclass(frozen=True)
class Draft:
    """A slot's draft for one step: its tokens, the chance each is right given the ones
    before it were, and whether its grammar forces them."""

    tokens: list[int]
    rate: float = 0.0
    forced: bool = False


NO_DRAFT = Draft([])


class Drafter:
    """Proposes drafts as long as their rows pay for (``StepCost.draft_len``), and counts
    what was drafted and confirmed."""

    def __init__(self, costs: Costs) -> None:
        self._costs = costs
        self.lookup_drafted = 0
        """Prompt-lookup draft tokens proposed, and those the model confirmed."""
        self.lookup_accepted = 0
        self.forced_drafted = 0
        """Draft tokens a grammar forced, and those the model confirmed."""
        self.forced_accepted = 0

    def propose(self, run: Run, room: int, rows: int, expected: float) -> Draft:
        """``run``'s draft for a step of ``rows`` rows so far, expected to yield
        ``expected`` tokens, with room for ``room`` more: the tokens its grammar forces
        (the model confirms them, barring another spelling of the same text), else a
        prompt-lookup draft."""
        cost = self._costs.decode
        if run.grammar is not None and room > 0:
            forced = run.grammar.forced(room)
            if forced:
                n = cost.draft_len(rows, expected, FORCED_RATE, len(forced))
                return Draft(forced[:n], FORCED_RATE, True)
        if run.lookup is None:
            return NO_DRAFT
        draft = run.lookup.propose(room, partial(cost.draft_len, rows, expected))
        return Draft(draft, run.lookup.rate)

    def verified(self, run: Run, drafted: int, accepted: int, forced: bool) -> None:
        """``run``'s draft of ``drafted`` tokens had its first ``accepted`` confirmed."""
        if forced:
            self.forced_drafted += drafted
            self.forced_accepted += accepted
        else:
            assert run.lookup is not None
            run.lookup.verified(drafted, accepted)
            self.lookup_drafted += drafted
            self.lookup_accepted += accepted
