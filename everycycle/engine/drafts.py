"""Drafts: tokens put in a step's batch after a slot's own row, for the model to confirm
in that one step. Two kinds: the tokens a slot's grammar forces (llguidance's
fast-forward tokens: after ``{"`` of an object whose first key is ``title``, that key),
and prompt-lookup drafts (``lookup.py``). Either is verified by choosing each row's
token exactly as one-at-a-time decoding would (greedy or sampled, within the grammar),
so a draft changes no choice, only how many steps they take (and, where a batch's
rows are not bit-exact, llama.cpp's numerics). Engine thread only.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from ..errors import EverycycleError, InvalidRequestError
from .jobs import Job, Output
from .lookup import StepCost, accepted_prefix
from .slots import Slot

FORCED_RATE = 0.95
"""The chance a forced token is the model's choice too: it is, unless the model spells
the same text with other tokens (llguidance forces the canonical ones)."""


class Drafts:
    """The engine thread's drafting (``EngineThread`` inherits it)."""

    _L: Any
    _mem: Any
    _cost: StepCost
    lookup_drafted: int
    lookup_accepted: int
    forced_drafted: int
    forced_accepted: int

    def _choose(self, s: Slot, row: int) -> int:
        raise NotImplementedError

    def _take(self, s: Slot, tok: int, n_past: int, out: list[tuple[Job, Output]]) -> bool:
        raise NotImplementedError

    def _finish(self, slot: Slot, out: list[tuple[Job, Output]], reason: str,
                error: EverycycleError | None = None) -> None:
        raise NotImplementedError

    def _propose(self, s: Slot, room: int, rows: int, expected: float
                 ) -> tuple[list[int], float]:
        """A slot's draft for this step, and the chance each token of it is right: the
        tokens its grammar forces (llguidance's fast-forward tokens: the model confirms
        them, barring another spelling of the same text), else a prompt-lookup draft.
        Either is as long as its rows pay for (``StepCost``)."""
        s.draft_forced = False
        if s.grammar is not None and room > 0:
            forced = s.grammar.forced(room)
            if forced:
                s.draft_forced = True
                return forced[:self._cost.draft_len(rows, expected, FORCED_RATE,
                                                    len(forced))], FORCED_RATE
        if s.lookup is None:
            return [], 0.0
        draft = s.lookup.propose(room, partial(self._cost.draft_len, rows, expected))
        return draft, s.lookup.rate

    def _verify(self, s: Slot, row: int, out: list[tuple[Job, Output]]) -> None:
        """Check a slot's draft against the model's own choices (its own row ``row``,
        then the draft's rows, each chosen as in ``_sample``); keep the longest agreeing
        prefix and drop the rest of the draft from the KV cache. The tokens taken are
        exactly those one-at-a-time decoding would have produced from these logits."""
        L = self._L
        draft = s.draft
        s.draft = []
        k = len(draft)
        start = s.n_past - k - 1  # the position of the slot's own row (its last token)
        rows = [row, *range(s.draft_row, s.draft_row + k)]
        try:
            taken = accepted_prefix(draft, lambda i: self._choose(s, rows[i]))
        except InvalidRequestError as exc:
            self._finish(s, out, "error", exc)
            return
        accepted = len(taken) - 1  # draft tokens confirmed
        if accepted < k:
            L.llama_memory_seq_rm(self._mem, s.seq, start + 1 + accepted, -1)
            del s.cached[len(s.cached) - (k - accepted):]
            s.n_past = start + 1 + accepted
        if s.draft_forced:
            self.forced_drafted += k
            self.forced_accepted += accepted
        else:
            assert s.lookup is not None
            s.lookup.verified(k, accepted)
            self.lookup_drafted += k
            self.lookup_accepted += accepted
        for i, tok in enumerate(taken):
            if self._take(s, tok, start + 1 + i, out):
                return
