"""The constraint engine's own matcher (llguidance, as the engine builds it) on SmolLM2's
vocabulary (no weights): does a grammar compile, and does it accept a text token by
token, then end-of-text."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from templatehelp import SMOLLM2

from everycycle.engine.worker.constraint import Constraints
from everycycle.errors import InvalidRequestError


class Vocab:
    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.L: Any = llama_cpp
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, path
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        self.constraints = Constraints(llama_cpp, self.vocab,
                                       llama_cpp.llama_vocab_n_tokens(self.vocab))

    def tokens(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.L.llama_token * (len(raw) + 8))()
        n = self.L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        assert n >= 0
        return list(buf[:n])

    def compiles(self, grammar: str) -> bool:
        try:
            self.constraints.check(grammar)
        except InvalidRequestError:
            return False
        return True

    def accepts(self, grammar: str, text: str) -> bool:
        """Whether the grammar lets ``text`` through, token by token, and then allows
        end-of-text."""
        matcher = self.constraints.matcher(grammar)
        for tok in self.tokens(text):
            if not matcher.allows(tok):
                return False
            matcher.accept(tok)
        return matcher.allows(self.eos)


@functools.cache
def smollm2() -> Vocab:
    return Vocab(SMOLLM2)
