"""A batch row's logits as a numpy view in place, read the cheap way: the per-token path
reads one row per decoding slot every step."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InternalError
from ..core.jobs import Logprob


class RowLogits:
    """``logits(row)``: row ``row`` of the last decode's logits (a view, valid until the
    next decode). ``llama_get_logits_ith`` is called through a prototype that returns
    the address as an int: numpy's ``as_array`` of the bindings' float pointer costs
    more than the argmax of a small vocabulary."""

    def __init__(self, L: Any, ctx: Any, n_vocab: int) -> None:
        proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
        function = ctypes.cast(L.llama_get_logits_ith, ctypes.c_void_p).value
        assert function is not None
        self._at = proto(function)
        self._ctx = ctx
        self._row = ctypes.c_float * n_vocab

    def __call__(self, row: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        address = self._at(self._ctx, row)
        if not address:
            raise InternalError(f"llama.cpp has no logits for batch row {row}")
        return np.ctypeslib.as_array(self._row.from_address(address))


def logprob(row: np.ndarray[Any, np.dtype[np.float32]], tok: int, top: int,
            text: Callable[[int], str]) -> Logprob:
    """``tok``'s log-probability under the model's own distribution in ``row`` (its
    logits, before any sampling setting), and the ``top`` likeliest tokens', each with
    its ``text``."""
    logits = row.astype(np.float64)
    peak = logits.max()
    lse = peak + np.log(np.exp(logits - peak).sum())
    best: list[tuple[str, float, int]] = []
    if top:
        ids = np.argpartition(-logits, top - 1)[:top]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        best = [(text(int(i)), float(logits[i] - lse), int(i)) for i in ids]
    return text(tok), float(logits[tok] - lse), tuple(best)
