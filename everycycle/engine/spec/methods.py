"""The speculative methods a model's engine asks, in order: the only place that knows
which exist, and names them. A new method is a module beside this one and a line here."""

from __future__ import annotations

from collections.abc import Callable

from ..core.stepcost import Costs
from .draftmodel import DraftModel
from .forced import ForcedTokens
from .lookup import History, PromptLookup
from .lookupdrafts import LookupDrafts
from .mtp import MtpHeads
from .paced import PacedDrafts
from .proposer import Proposer


def proposers(costs: Costs, *, history: History, lookup: Callable[[], type[PromptLookup]],
              draft_model: DraftModel | None, mtp: MtpHeads | None) -> list[Proposer]:
    """The methods, in the order each is asked: a grammar's forced tokens first (where it
    forces some, no other is asked), then prompt lookup, then the model's own MTP heads
    and a draft model where it has them (each weighed against the best so far)."""
    methods: list[Proposer] = [ForcedTokens("forced"), LookupDrafts("lookup", history, lookup)]
    if mtp is not None:
        methods.append(PacedDrafts("mtp", costs, mtp))
    if draft_model is not None:
        methods.append(PacedDrafts("model", costs, draft_model))
    return methods
