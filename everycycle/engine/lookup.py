"""Prompt-lookup drafts: guess the next tokens by finding the sequence's last n-gram
earlier in the prompt or the text generated so far, and proposing what followed it.

Pure bookkeeping (no llama.cpp): the runner verifies every draft with the model itself
in the same batch, so a wrong guess costs a few batch rows and never changes the
output. The draft length adapts per sequence: it grows while drafts are accepted
whole and shrinks to what was accepted.

A draft is only worth its rows where the rows are cheap next to the step. On a GPU a
step costs about the same for 1 row or 20; on a CPU each row costs nearly as much as
the step's fixed part, and with several sequences decoding at once a wrong draft
slows every one of them. ``StepCost`` fits a step's time as ``c0 + c1·rows`` and says
what fraction of drafted tokens must be accepted to pay for them; a sequence whose
recent acceptance rate is below that only *predicts* its draft and checks it against
the tokens it then generates (free), so that it starts drafting again as soon as its
text starts to copy.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM = 3
MAX_DRAFT = 10
RATE_DECAY = 0.8
"""How fast a sequence forgets old drafts' outcomes (per draft, verified or predicted)."""


class PromptLookup:
    """One sequence's n-gram index: the most recent continuation of each n-gram."""

    __slots__ = ("_hits", "_index", "_predicted", "_tokens", "_weight_accepted",
                 "_weight_drafted", "accepted", "drafted", "k")

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.k = 4
        """The longest draft to propose next."""
        self.drafted = 0
        """Draft tokens verified in a batch, and those the model confirmed."""
        self.accepted = 0
        # The recent acceptance rate (verified and predicted drafts), from an even
        # start: where rows are cheap a sequence drafts from its first step; where
        # they are dear its first drafts are predictions, which cost nothing.
        self._weight_accepted, self._weight_drafted = 1.0, 2.0
        self._predicted: list[int] = []
        """A draft not verified (not worth its rows), checked against what follows."""
        self._hits = 0
        for t in tokens:
            self.append(t)

    @property
    def rate(self) -> float:
        """The fraction of recently drafted tokens that were (or would have been) right."""
        return self._weight_accepted / self._weight_drafted

    def append(self, token: int) -> None:
        """``token`` is now the sequence's last (prompt, or generated and accepted)."""
        toks = self._tokens
        toks.append(token)
        n = len(toks)
        if n > NGRAM:  # the n-gram ending just before this token now has a continuation
            self._index[tuple(toks[n - 1 - NGRAM:n - 1])] = n - 1
        predicted = self._predicted
        if predicted:
            if token == predicted[self._hits]:
                self._hits += 1
                if self._hits < len(predicted):
                    return
            self._predicted = []
            self._learn(len(predicted), self._hits)

    def draft(self, limit: int) -> list[int]:
        """Up to ``min(k, limit)`` tokens that followed the last n-gram before; [] if none."""
        toks = self._tokens
        k = min(self.k, limit)
        if k <= 0 or len(toks) < NGRAM:
            return []
        start = self._index.get(tuple(toks[-NGRAM:]))
        if start is None:
            return []
        return toks[start:start + k]

    def worth(self, threshold: float) -> bool:
        """Whether drafts pay here: the acceptance rate beats ``threshold``."""
        return self.rate > threshold

    def propose(self, limit: int, threshold: float) -> list[int]:
        """A draft to verify in this step, or []: none found, or one not worth its rows
        at ``threshold`` (StepCost.threshold), which is then predicted instead."""
        if self._predicted:
            return []  # still checking a prediction
        draft = self.draft(limit)
        if not draft or self.worth(threshold):
            return draft
        self._predicted, self._hits = draft, 0
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` confirmed."""
        self.drafted += drafted
        self.accepted += accepted
        self._learn(drafted, accepted)

    def _learn(self, drafted: int, accepted: int) -> None:
        self._weight_accepted = RATE_DECAY * self._weight_accepted + accepted
        self._weight_drafted = RATE_DECAY * self._weight_drafted + drafted
        if accepted == drafted:
            self.k = min(MAX_DRAFT, self.k + 2)
        else:
            self.k = max(1, accepted + 1)


class StepCost:
    """A decode step's time as ``c0 + c1·rows``: the ratio ``c1/c0`` from a probe at
    load, refitted from the engine's own steps once their row counts vary (least
    squares, older steps forgotten)."""

    DECAY = 0.995
    MIN_SPREAD = 1.0
    """The row-count variance (rows²) below which the steps say nothing about c1."""

    def __init__(self, ratio: float) -> None:
        self.ratio = max(0.0, ratio)
        """c1/c0: the cost of one more row, in units of the step's fixed cost."""
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> StepCost:
        """From (rows, seconds) probe samples; a ratio of 1 (rows are dear) if they
        cannot tell."""
        cost = cls(1.0)
        for rows, seconds in samples:
            cost._add(rows, seconds, 1.0)
        fitted = cost._ratio()
        cost.ratio = fitted if fitted is not None else 1.0
        cost._w = cost._n = cost._t = cost._nn = cost._nt = 0.0
        return cost

    def observe(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` rows (all with logits, no prompt) took ``seconds``."""
        self._add(rows, seconds, self.DECAY)
        fitted = self._ratio()
        if fitted is not None:
            self.ratio = fitted

    def _add(self, rows: int, seconds: float, decay: float) -> None:
        self._w = decay * self._w + 1.0
        self._n = decay * self._n + rows
        self._t = decay * self._t + seconds
        self._nn = decay * self._nn + rows * rows
        self._nt = decay * self._nt + rows * seconds

    def _ratio(self) -> float | None:
        if self._w <= 0:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        spread = self._nn / self._w - mean_n * mean_n
        if spread < self.MIN_SPREAD:
            return None
        c1 = max(0.0, (self._nt / self._w - mean_n * mean_t) / spread)
        c0 = mean_t - c1 * mean_n
        if c0 <= 0:
            return 1e9 if c1 > 0 else 0.0  # all cost is per row: drafts never pay
        return c1 / c0

    MARGIN = 0.5
    """The share of the headroom above break-even that a draft must also clear."""

    def threshold(self, slots: int) -> float:
        """The acceptance rate that drafting must beat with ``slots`` sequences each
        taking one row per step.

        Break-even is ``slots·c1 / (c0 + slots·c1)``: one more row costs c1, and an
        accepted token saves the per-token share of a step, (c0 + c1·slots)/slots.
        Near break-even the gain is small and the risk is not (a noisy cost
        estimate), so a draft must clear break-even by half of what is left above it.
        And where rows are dear (break-even above one half: a CPU) and other sequences
        share the step, a draft mostly moves time from them to this one: their steps
        get slower, and a sequence that finishes early does not make them finish any
        sooner. Then there is no draft at all (a threshold above 1).
        """
        per_row = slots * self.ratio
        even = per_row / (1.0 + per_row)
        if slots > 1 and even > 0.5:
            return 2.0
        return even + self.MARGIN * (1.0 - even)
