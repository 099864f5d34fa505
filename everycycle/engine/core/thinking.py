"""A reasoning budget: a thinking model's thinking, counted token by token, ended when
its budget runs out the way its template ends it (its close marker, then the answer),
after an optional message (llama-server's ``--reasoning-budget-message``).

Thinking is found by text, as the output streams: the prompt may open the section
(DeepSeek-R1's template ends with ``<think>``), else the model opens it with its own
first tokens. A marker may span several tokens; a token's piece is read with control
tokens rendered (``</think>`` is one in Qwen3's vocabulary). ``features.ThinkingBudget`` is
the run's feature that counts it and forces the ending. No llama.cpp here.
"""

from __future__ import annotations

from dataclasses import dataclass

OPENING_WINDOW = 8
"""Tokens at the start of the output in which a model may open its thinking."""


@dataclass(frozen=True, slots=True)
class ThinkBudget:
    """What a job's thinking may spend (``JobSpec.think``)."""

    budget: int
    """Thinking tokens at most (0: none: the section is closed at once)."""
    open: str
    close: str
    inside: bool = False
    """The prompt opened the section: the output starts inside it."""
    message: str = ""
    """Said before the close marker when the budget ends it."""

    @property
    def ending(self) -> str:
        """The text that ends thinking for the model: the message, the close marker and
        the blank line its answer follows."""
        return f"{self.message}{self.close}\n\n"


class Thinking:
    """One job's thinking as it streams (engine thread only)."""

    def __init__(self, spec: ThinkBudget) -> None:
        self.spec = spec
        self.inside = spec.inside
        self.done = False
        """Its thinking has ended (closed by the model or by the budget), or never began."""
        self.count = 0
        """Thinking tokens so far (the markers aside)."""
        self._seen = 0
        self._tail = ""

    @property
    def due(self) -> bool:
        """The budget is spent while it still thinks: the ending is forced now."""
        return self.inside and not self.done and self.count >= self.spec.budget

    def took(self, piece: str) -> None:
        """The job generated a token whose text is ``piece``."""
        if self.done:
            return
        self._seen += 1
        self._tail = (self._tail + piece)[-4 * max(len(self.spec.open),
                                                    len(self.spec.close)):]
        if not self.inside:
            if self.spec.open in self._tail:
                self.inside, self._tail = True, ""
            elif self._seen >= OPENING_WINDOW:
                self.done = True  # (it answers without thinking)
            return
        if self.spec.close in self._tail:
            self.done = True
            return
        self.count += 1

    def forced(self) -> None:
        """The ending was forced: its thinking is over."""
        self.done = True
