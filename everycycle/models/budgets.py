"""A thinking model's reasoning budgets from its models.toml entry: a default budget
(``reasoning_budget``, llama-server's ``--reasoning-budget``), the budget of each effort a
client may ask for (``reasoning_efforts``: OpenAI's ``reasoning_effort``, Ollama's think
levels) and what is said when a budget ends the thinking (``reasoning_budget_message``,
llama-server's ``--reasoning-budget-message``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError

EFFORTS = {"low": 1024, "medium": 4096, "high": 16384}
"""Thinking tokens per effort unless the entry says otherwise."""
MAX_BUDGET = 1 << 20
KEYS = {"reasoning_budget": int, "reasoning_efforts": dict, "reasoning_budget_message": str}


@dataclass(frozen=True, slots=True)
class ReasoningBudgets:
    default: int | None = None
    """Thinking tokens at most when a request asks for no budget (None: no limit)."""
    efforts: Mapping[str, int] = field(default_factory=lambda: dict(EFFORTS))
    message: str = ""

    def budget(self, tokens: int | None, effort: str | None) -> int | None:
        """A request's budget: its own (``tokens``), else its effort's, else the
        model's default (None: no limit)."""
        if tokens is not None:
            return tokens
        if effort is not None:
            return self.efforts.get(effort, self.default)
        return self.default


def parse(raw: Mapping[str, object], where: str) -> ReasoningBudgets:
    """The entry's budgets. Raises ConfigError naming the key."""
    default = raw.get("reasoning_budget")
    if default is not None and (not isinstance(default, int) or isinstance(default, bool)
                                or not -1 <= default <= MAX_BUDGET):
        raise ConfigError(f"{where}.reasoning_budget must be -1 (no limit) or 0 to "
                          f"{MAX_BUDGET} thinking tokens")
    efforts = dict(EFFORTS)
    given = raw.get("reasoning_efforts", {})
    if not isinstance(given, Mapping):
        raise ConfigError(f"{where}.reasoning_efforts must be a table: low, medium, high")
    for effort, tokens in given.items():
        if effort not in EFFORTS or not isinstance(tokens, int) or isinstance(tokens, bool) \
                or not 0 <= tokens <= MAX_BUDGET:
            raise ConfigError(f"{where}.reasoning_efforts.{effort}: want low, medium or high "
                              f"= 0 to {MAX_BUDGET} thinking tokens")
        efforts[effort] = tokens
    message = raw.get("reasoning_budget_message", "")
    if not isinstance(message, str):
        raise ConfigError(f"{where}.reasoning_budget_message must be a string")
    return ReasoningBudgets(None if default in (None, -1) else default, efforts, message)
