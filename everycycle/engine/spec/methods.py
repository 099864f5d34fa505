"""The speculative methods a model's engine asks, in order: the only place that knows
which exist. A new method is a module beside this one and a line here."""

from __future__ import annotations

from collections.abc import Callable

from ..core.stepcost import Costs
from .draftmodel import DraftModel
from .forced import ForcedTokens
from .lookup import History, PromptLookup
from .lookupdrafts import LookupDrafts
from .modeldrafts import ModelDrafts
from .proposer import Proposer


def proposers(costs: Costs, *, history: History, lookup: Callable[[], type[PromptLookup]],
              draft_model: DraftModel | None) -> list[Proposer]:
    """The methods, in the order each is asked: a grammar's forced tokens first (where it
    forces some, no other is asked), then prompt lookup, then a draft model where the
    model has one (weighed against lookup's draft)."""
    methods: list[Proposer] = [ForcedTokens(), LookupDrafts(history, lookup)]
    if draft_model is not None:
        methods.append(ModelDrafts(costs, draft_model))
    return methods
