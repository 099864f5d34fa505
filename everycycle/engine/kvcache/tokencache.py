"""Tokenizing a chat prompt by its pieces, each long piece once.

An agent's every turn renders the same system prompt and tool list (tens of KB: 70 KB
for four MCP servers' tools) and the same history before its new message, and llama.cpp
tokenizes about 2.5 MB of text a second: 28 ms a turn for that list alone. llama.cpp's
tokenizer (SPM and BPE vocabularies) first partitions the text at the special tokens'
texts, then tokenizes each stretch of plain text on its own; so a prompt cut where a
control token's text starts (``<|im_start|>``) tokenizes to its pieces' tokens one after
the other, provided no special token's text spans the cut and the token there does not
strip the whitespace before it (``LSTRIP``). ``Pieces`` cuts only there, keeps the
tokens of long pieces by their text, and tokenizes the rest as before.

Exactness is the contract: for any text, ``Pieces.tokenize`` returns what one call of
llama.cpp's tokenizer does (tests/test_tokencache.py holds it to that on random texts
made of a real vocabulary's special tokens). Any thread.
"""

from __future__ import annotations

import itertools
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable


class Pieces:
    """The piece cache of one vocabulary: ``specials`` are (text, is_marker) for every
    token llama.cpp partitions on (control, user-defined, unknown); markers (control
    tokens without ``LSTRIP``) are where a text may be cut. ``tokenize_raw`` is
    llama.cpp's tokenizer with special parsing and no BOS/EOS."""

    MIN_CHARS = 2048
    """Pieces at least this long are kept (shorter ones cost less than a lookup)."""

    def __init__(self, specials: Iterable[tuple[str, bool]],
                 tokenize_raw: Callable[[str], list[int]], max_chars: int = 8 << 20) -> None:
        texts = {text for text, _ in specials if text}
        markers = sorted({text for text, marker in specials if text and marker},
                         key=len, reverse=True)
        self._tokenize = tokenize_raw
        self._cut = re.compile("|".join(map(re.escape, markers))) if markers else None
        self._risky = {m: _crossing(m, texts) for m in markers}
        """Per marker, the (special, offset) that could span a cut where it starts."""
        self.max_chars = max_chars
        self._kept: OrderedDict[str, array[int]] = OrderedDict()
        """Pieces' tokens, 4 bytes each (Python ints in a list would take 36)."""
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0

    def tokenize(self, text: str) -> list[int]:
        """``text``'s tokens, exactly as ``tokenize_raw(text)`` gives them."""
        if self._cut is None or len(text) < self.MIN_CHARS:
            return self._tokenize(text)
        out: list[int] = []
        run_start = 0
        for start, end in self._pieces(text):
            if end - start < self.MIN_CHARS:
                continue  # (joins the run of short pieces before the next long one)
            if run_start < start:
                out += self._tokenize(text[run_start:start])
            out += self._piece(text[start:end])
            run_start = end
        if run_start < len(text):
            out += self._tokenize(text[run_start:])
        return out

    def _pieces(self, text: str) -> list[tuple[int, int]]:
        assert self._cut is not None
        cuts = [0]
        for m in self._cut.finditer(text):
            at = m.start()
            if at > cuts[-1] and not any(text.startswith(s, at - k) for s, k in
                                         self._risky[m.group()] if at >= k):
                cuts.append(at)
        cuts.append(len(text))
        return list(itertools.pairwise(cuts))

    def _piece(self, piece: str) -> array[int]:
        with self._lock:
            found = self._kept.get(piece)
            if found is not None:
                self._kept.move_to_end(piece)
                self.hits += 1
                return found
        tokens = array("i", self._tokenize(piece))
        with self._lock:
            if piece not in self._kept:
                self._chars += len(piece)
            self._kept[piece] = tokens
            while self._chars > self.max_chars and len(self._kept) > 1:
                old, _ = self._kept.popitem(last=False)
                self._chars -= len(old)
        return tokens


def _crossing(marker: str, specials: set[str]) -> list[tuple[str, int]]:
    """The specials ``s`` and offsets ``k`` (1 <= k < len(s)) such that ``s`` starting
    ``k`` characters before a place where ``marker`` starts could match there: ``s[k:]``
    and ``marker`` agree on their common length."""
    out = []
    for s in specials:
        k = s.find(marker[0], 1)
        while k > 0:
            n = min(len(s) - k, len(marker))
            if s[k:k + n] == marker[:n]:
                out.append((s, k))
            k = s.find(marker[0], k + 1)
    return out
