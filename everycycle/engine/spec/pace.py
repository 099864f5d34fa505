"""A slot's pace with the draft model: how that model's drafts do for it, and how long
it rests from them once they stop paying (``drafts.Drafter`` keeps it; the slot holds it)."""

from __future__ import annotations

from dataclasses import dataclass

from .lookup import Acceptance

REST_FIRST = 8
REST_MAX = 256
"""Steps a slot rests from model drafts once they stop paying: the first time, and at
most (each rest that ends in a failed try doubles the next)."""


@dataclass
class Pace:
    """A slot's drafting with the draft model: how its drafts do, and its rest."""

    acceptance: Acceptance
    rest: int = 0
    """Steps left before it may draft again."""
    backoff: int = REST_FIRST
    """The next rest's length."""
    tried: bool = False
    """Whether it has drafted since its last rest began, or since it started (else, where
    no draft the model's rate says pays, it tries a short one: a new request learns its
    own rate at once, where the model's so far says not to draft)."""
