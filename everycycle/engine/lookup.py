"""Prompt-lookup drafts: guess the next tokens by finding the sequence's last n-gram
earlier in the prompt or the text generated so far, and proposing what followed it.

Pure bookkeeping (no llama.cpp): the runner verifies every draft with the model itself
in the same batch, so a wrong guess costs a few batch rows and never changes the
output. The draft length adapts per sequence: it grows while drafts are accepted
whole and shrinks to what was accepted, so text that never repeats drafts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM = 3
MAX_DRAFT = 10


class PromptLookup:
    """One sequence's n-gram index: the most recent continuation of each n-gram."""

    __slots__ = ("_index", "_tokens", "accepted", "drafted", "k")

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.k = 4
        """The longest draft to propose next."""
        self.drafted = 0
        self.accepted = 0
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        """``token`` is now the sequence's last (prompt, or generated and accepted)."""
        toks = self._tokens
        toks.append(token)
        n = len(toks)
        if n > NGRAM:  # the n-gram ending just before this token now has a continuation
            self._index[tuple(toks[n - 1 - NGRAM:n - 1])] = n - 1

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

    def verified(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` confirmed."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.k = min(MAX_DRAFT, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
