"""A run's position in its grammar: llguidance's matcher over the model's vocabulary
(built by ``worker/constraint.py``), asked for the tokens it allows, forces and masks.
Its mask (a bit per token) is applied to the logits before the sampler chain."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...chatfmt.constraint import short
from ...errors import InvalidRequestError


class Matcher:
    """One job's position in its grammar. Engine thread only."""

    __slots__ = ("_bits", "_eos", "_m", "_n_vocab")

    def __init__(self, matcher: Any, n_vocab: int, eos: list[int]) -> None:
        self._m = matcher
        self._n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._eos = eos

    def allows(self, tok: int) -> bool:
        if tok in self._eos:  # (llguidance validates no EOS once the grammar is done)
            return bool(self._m.is_accepting())
        return bool(self._m.validate_tokens([tok]) == 1)

    def forced(self, limit: int) -> list[int]:
        """The next tokens the grammar allows and nothing else (llguidance's
        fast-forward tokens, at most ``limit``), not consumed: a draft for the model."""
        return list(self._m.compute_ff_tokens()[:limit]) if limit > 0 else []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (not changed) with every token the grammar refuses at -inf.
        Raises InvalidRequestError when it allows none."""
        m = self._m
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():
            raise InvalidRequestError(f"the grammar failed: {short(m.get_error())}")
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self._n_vocab,
                                bitorder="little").view(bool)
        if not allowed.any():
            raise InvalidRequestError("the grammar allows no next token: the output so far "
                                      "has no continuation under its rules")
        return np.where(allowed, logits, np.float32(-np.inf))

    def greedy(self, logits: np.ndarray, tok: int) -> int:
        """The argmax among the tokens the grammar allows (``tok``, the plain argmax,
        when it allows that one), consumed."""
        if not self.allows(tok):
            tok = int(self.mask(logits).argmax())
        self.accept(tok)
        return tok

    def accept(self, tok: int) -> None:
        """Consume ``tok``; the end of generation is taken as the end of the grammar."""
        if tok in self._eos:
            return  # (the job ends with it; the matcher allowed it)
        if not self._m.consume_token(tok):
            raise InvalidRequestError(f"the grammar refused token {tok}: "
                                      f"{short(self._m.get_error()) or 'not allowed here'}")
