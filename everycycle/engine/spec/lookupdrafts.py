"""Prompt lookup as a proposer: each greedy run keeps an n-gram index of its prompt and
answer (``lookup.PromptLookup``), drafting what followed its last n-gram before, or in
one of the model's recent answers (``lookup.History``: a finished run's sequence goes
there)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from ..core.plan import Draft, StepPlan
from ..core.slots import Run, Slot
from .lookup import History, PromptLookup
from .proposer import DraftCount, Weighing


class LookupDrafts:
    """Drafts from a run's own text and the model's recent answers."""

    def __init__(self, name: str, history: History,
                 kind: Callable[[], type[PromptLookup]] = lambda: PromptLookup) -> None:
        self.name = name
        self.history = history
        """Recent finished sequences, for drafts across requests."""
        self._kind = kind
        """What drafts for a run (tests put an oracle here, through the Runner)."""
        self.count = DraftCount(self.name)
        self.makes = False

    def start(self, run: Run) -> PromptLookup | None:
        spec = run.job.spec
        if not (spec.lookup and spec.sampling.plain_greedy):
            return None
        return self._kind()(spec.tokens, self.history)

    def propose(self, state: PromptLookup, weighing: Weighing, best: Draft) -> Draft:
        w = weighing
        tokens = state.propose(w.own, partial(w.cost.draft_len, w.rows, w.expected))
        return Draft(tokens, state.rate, self.name) if tokens else best

    def offers(self, state: PromptLookup, n_batch: int) -> bool:
        return state.ready(n_batch)

    def joins(self, state: PromptLookup) -> bool:
        return False

    def prepare(self, items: Sequence[tuple[Slot, PromptLookup, Weighing]]) -> None:
        pass  # (its drafts are known as the plan is made)

    def took(self, state: PromptLookup, token: int) -> None:
        state.append(token)

    def decoded(self, plan: StepPlan) -> None:
        pass

    def verified(self, state: PromptLookup, drafted: int, accepted: int) -> None:
        state.verified(drafted, accepted)

    def ended(self, state: PromptLookup, cached: Sequence[int], n_prompt: int) -> None:
        self.history.add(cached, n_prompt)
