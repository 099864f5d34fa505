"""llama.cpp's own GBNF parser and grammar sampler, on SmolLM2's vocabulary (no weights):
does a grammar compile, and does it accept a text token by token, then end-of-text."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

from templatehelp import SMOLLM2


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
        self._one: Any = (llama_cpp.llama_token_data * 1)()
        self._arr = llama_cpp.llama_token_data_array(data=self._one, size=1, selected=-1,
                                                     sorted=False)

    def tokens(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.L.llama_token * (len(raw) + 8))()
        n = self.L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        assert n >= 0
        return list(buf[:n])

    def sampler(self, gbnf: str, patterns: list[str] | None = None) -> Any:
        if patterns is None:
            return self.L.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        arr = (ctypes.c_char_p * len(patterns))(*[p.encode() for p in patterns])
        return self.L.llama_sampler_init_grammar_lazy_patterns(
            self.vocab, gbnf.encode(), b"root", arr, len(patterns), None, 0)

    def compiles(self, gbnf: str) -> bool:
        s = self.sampler(gbnf)
        if not s:
            return False
        self.L.llama_sampler_free(s)
        return True

    def _allows(self, sampler: Any, tok: int) -> bool:
        self._one[0].id, self._one[0].logit, self._one[0].p = tok, 0.0, 0.0
        self._arr.size, self._arr.selected, self._arr.sorted = 1, -1, False
        self.L.llama_sampler_apply(sampler, ctypes.byref(self._arr))
        return bool(self._one[0].logit > -1e30)

    def accepts(self, gbnf: str, text: str, patterns: list[str] | None = None) -> bool:
        """Whether the grammar lets ``text`` through and then allows end-of-text. With
        ``patterns`` (lazy), only use texts whose constrained part is well-formed:
        llama.cpp aborts the process when a trigger feeds it text it refuses."""
        s = self.sampler(gbnf, patterns)
        assert s, "grammar does not compile"
        try:
            for tok in self.tokens(text):
                if not self._allows(s, tok):
                    return False
                self.L.llama_sampler_accept(s, tok)
            return self._allows(s, self.eos)
        finally:
            self.L.llama_sampler_free(s)


@functools.cache
def smollm2() -> Vocab:
    return Vocab(SMOLLM2)
