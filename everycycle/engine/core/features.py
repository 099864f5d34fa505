"""A request's features that act on its run token by token (a reasoning budget, so far:
``ThinkingBudget``): each is told when the run starts and of every token it
takes, may force the tokens it takes next, and may keep it from drafting. A run holds
its features (``Run.features``); the step loop and the scheduler ask them, knowing
none by name. No llama.cpp here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .jobs import Job
from .thinking import ThinkBudget, Thinking


class Feature(Protocol):
    """One feature of a request, on its run. Engine thread only."""

    def started(self, job: Job) -> list[int]:
        """The run starts: the tokens it must take first ([]: none)."""
        ...

    def took(self, job: Job, piece: str) -> list[int]:
        """The run took a token whose text (control tokens rendered) is ``piece``: the
        tokens it must take next ([]: none)."""
        ...

    def may_draft(self) -> bool:
        """Whether the run may take drafted tokens now (else one token a step)."""
        ...


class ThinkingBudget:
    """A run's reasoning budget, as a feature of the run: its
    thinking counted as it streams (``job.n_thought``), its ending forced once the
    budget is spent, no drafts while it thinks (each token is counted as it comes)."""

    def __init__(self, spec: ThinkBudget, tokenize: Callable[[str], list[int]]) -> None:
        self.thinking = Thinking(spec)
        self._tokenize = tokenize
        """Text to tokens, control tokens' text read as them (the ending's)."""

    def started(self, job: Job) -> list[int]:
        return self._ending() if self.thinking.due else []  # (a budget of 0, say)

    def took(self, job: Job, piece: str) -> list[int]:
        thinking = self.thinking
        if thinking.done:
            return []
        thinking.took(piece)
        job.n_thought = thinking.count
        return self._ending() if thinking.due else []

    def may_draft(self) -> bool:
        return self.thinking.done

    def _ending(self) -> list[int]:
        """The tokens that end the thinking now (its budget is spent)."""
        self.thinking.forced()
        return self._tokenize(self.thinking.spec.ending)
