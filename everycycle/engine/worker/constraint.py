"""Constrained decoding: llguidance's matcher over one model's vocabulary, one per slot.

A job's grammar (llguidance's serialized form, compiled from a schema, GBNF or the tool
formats by ``chatfmt/constraint.py``) becomes an ``LLMatcher`` over an ``LLTokenizer``
built once per model from the GGUF's vocabulary. Each step the matcher's mask (a bit per
token, ~50 µs for a 49k vocabulary) is applied to the logits before the sampler chain;
the sampled token is then consumed. Greedy decoding takes the argmax and computes the
mask only when the matcher refuses it (the same token either way).

Control tokens are marked special (llguidance's ``\\xff`` prefix), so JSON text never
contains ``<|im_end|>``; the tool formats' own markers (``<tool_call>``,
``<|python_tag|>``, ``[TOOL_CALLS]``) are kept as their text, so a grammar's literal
``"<tool_call>"`` matches the model's marker token as well as the text spelled out.

Compiling runs wherever ``check`` is called (a worker thread: never the decode loop);
llguidance drops the GIL while it compiles.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ...chatfmt.constraint import limits, short
from ...chatfmt.tools import MARKERS
from ...errors import InvalidRequestError
from ..core.matcher import Matcher


def tokenizer(L: Any, vocab: Any) -> Any:
    """An llguidance ``LLTokenizer`` for ``vocab`` (a llama_vocab pointer): every
    token's bytes, control tokens marked special, the end-of-generation tokens as its
    EOS, and llama.cpp's own tokenizer for text. ~0.2 s for 49k tokens: build once."""
    import llguidance

    n = int(L.llama_vocab_n_tokens(vocab))
    size = 256
    buf = ctypes.create_string_buffer(size)
    tokens: list[bytes] = []
    eog: list[int] = []
    special = L.LLAMA_TOKEN_ATTR_CONTROL
    user = L.LLAMA_TOKEN_ATTR_USER_DEFINED
    markers = {m.encode() for m in MARKERS}
    for tok in range(n):
        k = L.llama_token_to_piece(vocab, tok, buf, size, 0, True)
        if k < 0:
            big = ctypes.create_string_buffer(-k)
            k = L.llama_token_to_piece(vocab, tok, big, -k, 0, True)
            piece = big.raw[:k]
        else:
            piece = buf.raw[:k]
        attr = L.llama_vocab_get_attr(vocab, tok)
        looks_special = bool(attr & special) or (
            bool(attr & user) and piece.startswith(b"<") and piece.endswith(b">"))
        if looks_special and piece not in markers:
            piece = b"\xff" + piece
        tokens.append(piece)
        if L.llama_vocab_is_eog(vocab, tok):
            eog.append(tok)
    if not eog:
        eog.append(int(L.llama_vocab_eos(vocab)))
    fptr = ctypes.cast(L.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=tokens, vocab_ptr=vocab, tokenize_fptr=fptr, eos_token=eog, slices=None)


class Constraints:
    """The matchers of one model: its tokenizer (built on first use) and the grammars
    compiled by ``check``, kept so that a job's grammar is compiled once. Any thread."""

    KEEP = 16
    """Compiled grammars kept (each job takes a copy; an agent's tools repeat)."""
    KEEP_CHARS = 16 << 20
    """At most this much grammar text among them (a tool list's grammar is about its
    JSON's length; the newest is always kept)."""

    def __init__(self, L: Any, vocab: Any, n_vocab: int) -> None:
        self._L = L
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._tokenizer: Any = None
        self._eos: list[int] = []
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._build = threading.Lock()

    def _tok(self) -> Any:
        with self._build:
            if self._tokenizer is None:
                self._tokenizer = tokenizer(self._L, self._vocab)
                self._eos = list(self._tokenizer.eos_tokens)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Compile ``grammar`` for this vocabulary and keep it. Raises
        InvalidRequestError with llguidance's message, or when the grammar matches no
        text at all (a ``$ref`` cycle, an unsatisfiable schema)."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return
        import llguidance

        m = llguidance.LLMatcher(self._tok(), grammar, log_level=0, limits=limits(grammar))
        if m.is_error():
            raise InvalidRequestError(f"grammar: {short(m.get_error())}")
        bits = np.zeros((self._n_vocab + 31) // 32, dtype=np.int32)
        m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.unpackbits(bits.view(np.uint8), count=self._n_vocab,
                                bitorder="little").view(bool)
        allowed[self._eos] = False  # (llguidance offers the end even where it refuses it)
        if m.is_error() or not (m.is_accepting() or allowed.any()):
            raise InvalidRequestError("grammar: it matches no text at all (a $ref cycle, "
                                      "or rules that never end?)")
        with self._lock:
            if grammar not in self._compiled:  # (another thread may have compiled it too)
                self._chars += len(grammar)
            self._compiled[grammar] = m
            self._compiled.move_to_end(grammar)
            while len(self._compiled) > 1 and (len(self._compiled) > self.KEEP
                                               or self._chars > self.KEEP_CHARS):
                self._chars -= len(self._compiled.popitem(last=False)[0])

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher for ``grammar`` (a copy of the compiled one)."""
        with self._lock:
            compiled = self._compiled.get(grammar)
        if compiled is None:
            self.check(grammar)
            with self._lock:
                compiled = self._compiled[grammar]
        return Matcher(compiled.deep_copy(), self._n_vocab, self._eos)

    def close(self) -> None:
        """Drop the compiled grammars and the tokenizer (the vocabulary is being freed)."""
        with self._lock:
            self._compiled.clear()
            self._chars = 0
        with self._build:
            self._tokenizer = None
