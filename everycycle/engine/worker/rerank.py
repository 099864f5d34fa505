"""Reranking: a reranker GGUF (pooling type ``rank``) scores (query, document) pairs.

A pair is laid out as llama-server's ``/rerank`` lays it out: through the GGUF's
``rerank`` template (``{query}`` and ``{document}`` replaced; Qwen3-Reranker ships
one) when it has one, else BOS, the query, EOS, SEP, the document, EOS, each special
token where the vocabulary asks for it. The embeddings context (embedder.py) then
gives each pair its classifier's outputs, the first being the relevance score,
unnormalized, as llama-server reports it.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ...errors import InvalidRequestError
from ..llama.vocab import Vocab

POOLING_RANK = 4


def meta(L: Any, model: Any, key: str) -> str | None:
    """The GGUF metadata value ``key`` as text (None: absent)."""
    size = 256
    buf = ctypes.create_string_buffer(size)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, size)
    if n < 0:
        return None
    if n >= size:
        buf = ctypes.create_string_buffer(n + 1)
        L.llama_model_meta_val_str(model, key.encode(), buf, n + 1)
    return buf.value.decode("utf-8", "replace")


def pooling(L: Any, model: Any) -> int | None:
    """The pooling type the GGUF declares (None: none)."""
    arch = meta(L, model, "general.architecture")
    value = meta(L, model, f"{arch}.pooling_type") if arch else None
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


class Pairs:
    """Lays out (query, document) pairs for one reranker. Any thread."""

    def __init__(self, L: Any, model: Any, vocab: Vocab) -> None:
        self._L = L
        self.reranker = pooling(L, model) == POOLING_RANK
        tmpl = L.llama_model_chat_template(model, b"rerank")
        self.template: str | None = tmpl.decode("utf-8", "replace") if tmpl else None
        self._vocab = vocab
        v = vocab.handle
        eos = int(L.llama_vocab_eos(v))
        self._bos = int(L.llama_vocab_bos(v)) if L.llama_vocab_get_add_bos(v) else None
        self._eos = (eos if eos >= 0 else int(L.llama_vocab_sep(v))) if (
            L.llama_vocab_get_add_eos(v)) else None
        self._sep = int(L.llama_vocab_sep(v)) if L.llama_vocab_get_add_sep(v) else None

    def check(self, name: str) -> None:
        """Raises InvalidRequestError unless this model is a reranker."""
        if not self.reranker:
            raise InvalidRequestError(
                f"model '{name}' is not a reranker (its GGUF declares no rank pooling): "
                "rerank with a reranker GGUF, e.g. bge-reranker or Qwen3-Reranker")

    def tokens(self, query: str, document: str) -> list[int]:
        """The pair's tokens."""
        if self.template is not None:
            text = self.template.replace("{query}", query).replace("{document}", document)
            return self._vocab.tokenize(text, special=True, add_special=False)
        out: list[int] = []

        def put(token: int | None) -> None:
            if token is not None and token >= 0:
                out.append(token)

        put(self._bos)
        out += self._vocab.tokenize(query, special=False, add_special=False)
        put(self._eos)
        put(self._sep)
        out += self._vocab.tokenize(document, special=False, add_special=False)
        put(self._eos)
        return out
