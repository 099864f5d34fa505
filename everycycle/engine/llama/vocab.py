"""A loaded model's vocabulary and chat template: text to tokens, tokens to bytes, and
conversations rendered by llama.cpp's own template support.

Thread-safe as llama.cpp's vocabulary calls are; the Runner keeps the model alive
while these run.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from ...chatfmt.infill import FimTokens
from ...errors import InvalidRequestError
from ..kvcache.tokencache import Pieces

Turns = Sequence[tuple[bytes, str]]
"""(role, content) pairs."""


class Vocab:
    """The vocabulary of ``model`` (a llama_model pointer) and its chat template."""

    def __init__(self, L: Any, model: Any) -> None:
        self._L = L
        self._vocab = L.llama_model_get_vocab(model)
        self.n_vocab: int = L.llama_vocab_n_tokens(self._vocab)
        tmpl = L.llama_model_chat_template(model, None)
        self.template_source: str | None = tmpl.decode("utf-8", "replace") if tmpl else None
        """The GGUF's ``tokenizer.chat_template``, if it has one."""
        self.template: bytes | None = (
            tmpl if tmpl and self._apply(tmpl, ((b"user", "x"),)) is not None else None)
        """The GGUF's chat template if llama.cpp can render it (probed once)."""
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        """Whether tokenizing adds BOS itself."""
        self._add_eos = bool(L.llama_vocab_get_add_eos(self._vocab))
        self._pieces: Pieces | None = None
        self._built = False
        self._pieces_lock = threading.Lock()

    def tokenize(self, text: str, *, special: bool, add_special: bool = True) -> list[int]:
        """``text``'s tokens; ``special``: control tokens' text is parsed as them;
        ``add_special``: BOS (and EOS) added where the vocabulary says. A long text with
        special tokens is tokenized by its pieces, long ones once (``tokencache``)."""
        if special and len(text) >= Pieces.MIN_CHARS and (pieces := self._piece_cache()):
            tokens = pieces.tokenize(text)
            if add_special and self.add_bos:
                tokens.insert(0, self._L.llama_vocab_bos(self._vocab))
            if add_special and self._add_eos:
                tokens.append(self._L.llama_vocab_eos(self._vocab))
            return tokens
        return self._tokenize(text, special=special, add_special=add_special)

    def _piece_cache(self) -> Pieces | None:
        """The vocabulary's piece cache (built on first use: every token's attributes
        read once); None where llama.cpp's tokenizer is not SPM or BPE."""
        with self._pieces_lock:
            if not self._built:
                self._built = True
                L = self._L
                if L.llama_vocab_type(self._vocab) not in (L.LLAMA_VOCAB_TYPE_SPM,
                                                           L.LLAMA_VOCAB_TYPE_BPE):
                    self._pieces = None
                else:
                    self._pieces = Pieces(self._specials(), lambda text: self._tokenize(
                        text, special=True, add_special=False))
            return self._pieces

    def _specials(self) -> list[tuple[str, bool]]:
        """(text, may be cut before) of every token llama.cpp's tokenizer partitions on."""
        L = self._L
        partition = (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED
                     | L.LLAMA_TOKEN_ATTR_UNKNOWN)
        out = []
        for tok in range(self.n_vocab):
            attr = L.llama_vocab_get_attr(self._vocab, tok)
            if attr & partition:
                text = (L.llama_vocab_get_text(self._vocab, tok) or b"").decode("utf-8",
                                                                                "replace")
                out.append((text, bool(attr & L.LLAMA_TOKEN_ATTR_CONTROL)
                            and not attr & L.LLAMA_TOKEN_ATTR_LSTRIP))
        return out

    def _tokenize(self, text: str, *, special: bool, add_special: bool) -> list[int]:
        L = self._L
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, special)
        if n < 0:
            buf = (L.llama_token * -n)()
            n = L.llama_tokenize(self._vocab, data, len(data), buf, -n, add_special, special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes ``token`` renders as (a part of a character, perhaps); a control
        token renders as its text only with ``special``."""
        L = self._L
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def special_text(self, which: str) -> str:
        """The text of the ``bos`` or ``eos`` token ("" when the model has none)."""
        L = self._L
        token = L.llama_vocab_bos(self._vocab) if which == "bos" else L.llama_vocab_eos(
            self._vocab)
        return self.piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    def is_eog(self, token: int) -> bool:
        return bool(self._L.llama_vocab_is_eog(self._vocab, token))

    def eog_tokens(self) -> tuple[int, ...]:
        """Every token that ends a generation (EOS, EOT, and FIM's pad, repo and file
        separator where the model has them)."""
        return tuple(t for t in range(self.n_vocab) if self.is_eog(t))

    @property
    def bos(self) -> int | None:
        """The BOS token where tokenizing adds one (else None)."""
        token = int(self._L.llama_vocab_bos(self._vocab))
        return token if self.add_bos and token >= 0 else None

    def fim(self) -> FimTokens:
        """The vocabulary's fill-in-the-middle tokens, as llama.cpp found them at load
        (its GGUF keys, else the tokens' text)."""
        L, v = self._L, self._vocab

        def tok(fn: Any) -> int | None:
            t = int(fn(v))
            return t if t >= 0 else None

        return FimTokens(tok(L.llama_vocab_fim_pre), tok(L.llama_vocab_fim_suf),
                         tok(L.llama_vocab_fim_mid), tok(L.llama_vocab_fim_pad),
                         tok(L.llama_vocab_fim_rep), tok(L.llama_vocab_fim_sep))

    @property
    def handle(self) -> Any:
        """The llama_vocab pointer (for samplers)."""
        return self._vocab

    def render_chat(self, turns: Turns) -> str:
        """``turns`` through the model's template, ready for the assistant's turn."""
        assert self.template is not None
        out = self._apply(self.template, turns)
        if out is None:
            raise InvalidRequestError("the model's chat template cannot render this conversation")
        return out

    def _apply(self, tmpl: bytes, turns: Turns) -> str | None:
        L = self._L
        contents = [content.encode("utf-8") for _, content in turns]
        msgs = (L.llama_chat_message * len(turns))()
        for i, ((role, _), content) in enumerate(zip(turns, contents, strict=True)):
            msgs[i].role = role
            msgs[i].content = content
        size = 2 * sum(len(c) for c in contents) + 256 * len(turns) + 256
        buf = ctypes.create_string_buffer(size)
        n = L.llama_chat_apply_template(tmpl, msgs, len(turns), True, buf, size)
        if n < 0:
            return None
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = L.llama_chat_apply_template(tmpl, msgs, len(turns), True, buf, n)
        return buf.raw[:n].decode("utf-8", "replace")
