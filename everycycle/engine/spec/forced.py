"""Forced tokens as a draft: the tokens a run's grammar allows and nothing else
(llguidance's fast-forward tokens: after ``{"`` of an object whose first key is
``title``, that key), put in the step for the model to confirm, barring another spelling
of the same text. Where a grammar forces tokens, no other method is asked."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.matcher import Matcher
from ..core.plan import Draft, StepPlan
from ..core.slots import Run, Slot
from .proposer import DraftCount, Weighing

FORCED_RATE = 0.95
"""The chance a forced token is the model's choice too: it is, unless the model spells
the same text with other tokens (llguidance forces the canonical ones)."""


class ForcedTokens:
    """Drafts what a run's grammar forces."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = DraftCount(name)
        self.makes = False

    def start(self, run: Run) -> Matcher | None:
        return run.grammar

    def propose(self, state: Matcher, weighing: Weighing, best: Draft) -> Draft:
        if weighing.own <= 0:
            return best
        forced = state.forced(weighing.own)
        if not forced:
            return best
        n = weighing.length(FORCED_RATE, len(forced))
        return Draft(forced[:n], FORCED_RATE, self.name, final=True)

    def offers(self, state: Matcher, n_batch: int) -> bool:
        return False

    def joins(self, state: Matcher) -> bool:
        return False

    def prepare(self, items: Sequence[tuple[Slot, Matcher, Weighing]]) -> None:
        pass  # (its drafts are known as the plan is made)

    def took(self, state: Matcher, token: int) -> None:
        pass  # (the step's choice consumed it in the matcher)

    def decoded(self, plan: StepPlan) -> None:
        pass

    def verified(self, state: Matcher, drafted: int, accepted: int) -> None:
        pass

    def ended(self, state: Matcher, cached: Sequence[int], n_prompt: int) -> None:
        pass
