"""Sampling: llama.cpp's sampler chain for a job's settings, and grammars (GBNF).

Greedy decoding under a grammar takes the argmax and masks the whole vocabulary only
when the grammar refuses that token, as llama-server does.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ..errors import InvalidRequestError
from ..protocol import sampling as P
from .jobs import Sampling
from .llamalog import log_capture, stderr_text

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed


class _OneCandidate:
    """A one-token llama_token_data_array, to ask a grammar about one token."""

    def __init__(self, L: Any) -> None:
        self.data = (L.llama_token_data * 1)()
        self.array = L.llama_token_data_array(data=self.data, size=1, selected=-1,
                                              sorted=False)


class Samplers:
    """Builds samplers for one model's vocabulary (``vocab``: a llama_vocab pointer)."""

    def __init__(self, L: Any, vocab: Any, n_vocab: int) -> None:
        self._L = L
        self._vocab = vocab
        self._n_vocab = n_vocab
        # Reused by greedy decoding under a grammar (engine thread only).
        self._all = np.zeros(n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._one = _OneCandidate(L)
        self._checked: OrderedDict[tuple[str, tuple[str, ...]], Any] = OrderedDict()
        """Grammars compiled by ``check`` and not used yet: a job takes its own."""
        self._lock = threading.Lock()

    CHECKED_KEEP = 8
    """Compiled grammars kept between admission and a slot (more are compiled again)."""

    def chain(self, s: Sampling, n_ctx: int) -> Any:
        """llama.cpp's sampler chain for ``s`` (its grammar aside: see ``grammar``), in
        llama-server's order; None for plain greedy decoding. ``n_ctx`` is what a
        ``-1`` look-back means.

        Plain greedy (``Sampling.plain_greedy``) is an argmax over the logits, which is
        what llama.cpp's greedy sampler computes, without building a candidate array
        over the whole vocabulary (262k entries for Gemma) for every token.
        """
        if s.plain_greedy:
            return None
        L = self._L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())

        def add(sampler: Any) -> None:
            L.llama_sampler_chain_add(chain, sampler)

        # (A grammar is never in the chain: sample_constrained holds each token to it.)
        seed = DEFAULT_SEED if s[P.SEED] is None else s[P.SEED]
        if biases := s[P.LOGIT_BIAS]:
            array = (L.llama_logit_bias * len(biases))(*[(b.token, b.bias) for b in biases])
            add(L.llama_sampler_init_logit_bias(self._n_vocab, len(biases), array))
        last_n = s[P.REPEAT_LAST_N]
        if any(s[p] != p.neutral for p in (P.REPEAT_PENALTY, P.FREQUENCY_PENALTY,
                                           P.PRESENCE_PENALTY)):
            add(L.llama_sampler_init_penalties(
                self._n_vocab, n_ctx if last_n < 0 else last_n, s[P.REPEAT_PENALTY],
                s[P.FREQUENCY_PENALTY], s[P.PRESENCE_PENALTY]))
        if s[P.DRY_MULTIPLIER] > 0.0:
            breakers = [b.encode() for b in s[P.DRY_SEQUENCE_BREAKERS]]
            dry_n = s[P.DRY_PENALTY_LAST_N]
            add(L.llama_sampler_init_dry(
                self._vocab, s[P.DRY_MULTIPLIER], s[P.DRY_BASE], s[P.DRY_ALLOWED_LENGTH],
                n_ctx if dry_n < 0 else dry_n, (ctypes.c_char_p * len(breakers))(*breakers),
                len(breakers)))
        if s.greedy:
            if s[P.XTC_PROBABILITY] > 0.0:
                add(L.llama_sampler_init_xtc(s[P.XTC_PROBABILITY], s[P.XTC_THRESHOLD], 1, seed))
            add(L.llama_sampler_init_greedy())
            return chain
        if s[P.MIROSTAT]:
            add(L.llama_sampler_init_temp(s[P.TEMPERATURE]))
            if s[P.MIROSTAT] == 1:
                add(L.llama_sampler_init_mirostat(self._n_vocab, seed, s[P.MIROSTAT_TAU],
                                                  s[P.MIROSTAT_ETA], 100))
            else:
                add(L.llama_sampler_init_mirostat_v2(seed, s[P.MIROSTAT_TAU],
                                                     s[P.MIROSTAT_ETA]))
            return chain
        if s[P.TOP_N_SIGMA] > 0.0:
            add(L.llama_sampler_init_top_n_sigma(s[P.TOP_N_SIGMA]))
        if s[P.TOP_K] > 0:
            add(L.llama_sampler_init_top_k(s[P.TOP_K]))
        if s[P.TYPICAL_P] < 1.0:
            add(L.llama_sampler_init_typical(s[P.TYPICAL_P], 1))
        add(L.llama_sampler_init_top_p(s[P.TOP_P], 1))
        add(L.llama_sampler_init_min_p(s[P.MIN_P], 1))
        if s[P.XTC_PROBABILITY] > 0.0:
            add(L.llama_sampler_init_xtc(s[P.XTC_PROBABILITY], s[P.XTC_THRESHOLD], 1, seed))
        add(L.llama_sampler_init_temp(s[P.TEMPERATURE]))
        add(L.llama_sampler_init_dist(seed))
        return chain

    def check(self, s: Sampling) -> None:
        """Raises InvalidRequestError for a logit bias on a token the vocabulary lacks."""
        for b in s[P.LOGIT_BIAS]:
            if b.token >= self._n_vocab:
                raise InvalidRequestError(f"logit_bias: token {b.token} is not in this "
                                          f"model's vocabulary of {self._n_vocab}")

    def grammar(self, gbnf: str, triggers: tuple[str, ...] = ()) -> Any:
        """llama.cpp's grammar sampler for ``gbnf`` (root rule ``root``), lazy from the
        first match of one of ``triggers`` when given: the one ``check`` compiled when
        it did, else a new one.

        Raises InvalidRequestError with llama.cpp's own parse error, which says where.
        """
        with self._lock:
            ready = self._checked.pop((gbnf, triggers), None)
        return ready if ready is not None else self._compile(gbnf, triggers)

    def _compile(self, gbnf: str, triggers: tuple[str, ...]) -> Any:
        L = self._L
        with log_capture() as captured, stderr_text() as printed:
            if triggers:
                patterns = (ctypes.c_char_p * len(triggers))(*[t.encode() for t in triggers])
                sampler = L.llama_sampler_init_grammar_lazy_patterns(
                    self._vocab, gbnf.encode("utf-8"), b"root", patterns, len(triggers),
                    None, 0)
            else:
                sampler = L.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"),
                                                       b"root")
        if not sampler:
            # llama.cpp prints where the parse failed straight to stderr, then logs a
            # generic error; the first says where.
            where = [ln.strip() for ln in printed.text.splitlines() if "error" in ln]
            detail = "; ".join(where or captured.errors) or "llama.cpp could not parse it"
            raise InvalidRequestError(f"grammar: {detail}")
        return sampler

    def check_grammar(self, gbnf: str, triggers: tuple[str, ...] = ()) -> None:
        """Compile ``gbnf`` (raising InvalidRequestError saying where it is broken) and
        keep it for the job that asked, so that it is compiled once."""
        sampler = self._compile(gbnf, triggers)
        key = (gbnf, triggers)
        with self._lock:
            old = self._checked.pop(key, None)
            self._checked[key] = sampler
            spill = [old] if old is not None else []
            while len(self._checked) > self.CHECKED_KEEP:
                spill.append(self._checked.popitem(last=False)[1])
        for extra in spill:
            self._L.llama_sampler_free(extra)

    def close(self) -> None:
        """Free the grammars compiled and not taken."""
        with self._lock:
            spill, self._checked = list(self._checked.values()), OrderedDict()
        for sampler in spill:
            self._L.llama_sampler_free(sampler)

    def free(self, sampler: Any) -> None:
        if sampler is not None:
            self._L.llama_sampler_free(sampler)

    def grammar_greedy(self, grammar: Any, logits: np.ndarray, tok: int) -> int:
        """The argmax among the tokens ``grammar`` allows (``tok``, the plain argmax, when
        it allows that one), accepted into the grammar's state. Engine thread only."""
        L = self._L
        if not self.allows(grammar, tok):
            every = self._all
            arr = self._candidates(logits)
            L.llama_sampler_apply(grammar, ctypes.byref(arr))
            best = int(every["logit"].argmax())
            if not np.isfinite(every["logit"][best]):
                # Accepting a token the grammar refuses aborts the process: end the job.
                raise InvalidRequestError("the grammar allows no next token")
            tok = int(every["id"][best])
        L.llama_sampler_accept(grammar, tok)
        return tok

    def sample_constrained(self, chain: Any, grammar: Any, logits: np.ndarray) -> int:
        """Sample with ``chain`` (no grammar in it), then hold the token to ``grammar``:
        kept if allowed, else resampled from the grammar-masked distribution — as
        llama-server samples. Accepted into both. Raises InvalidRequestError when the
        grammar allows no token at all: accepting one it refuses would abort the
        process (llama.cpp throws from C++). Engine thread only."""
        L = self._L
        arr = self._candidates(logits)
        L.llama_sampler_apply(chain, ctypes.byref(arr))
        tok = int(arr.data[arr.selected].id)
        if not self.allows(grammar, tok):
            arr = self._candidates(logits)
            L.llama_sampler_apply(grammar, ctypes.byref(arr))
            if not np.isfinite(self._all["logit"]).any():
                raise InvalidRequestError("the grammar allows no next token: the output so "
                                          "far has no continuation under its rules")
            L.llama_sampler_apply(chain, ctypes.byref(arr))
            tok = int(arr.data[arr.selected].id)
            if not self.allows(grammar, tok):  # (a sampler that ignores the mask)
                raise InvalidRequestError("the grammar allows no next token")
        L.llama_sampler_accept(grammar, tok)
        L.llama_sampler_accept(chain, tok)
        return tok

    def _candidates(self, logits: np.ndarray) -> Any:
        """Every token with its logit, as a llama_token_data_array over ``_all``."""
        every = self._all
        every["id"] = self._ids
        every["logit"] = logits
        every["p"] = 0.0
        return self._L.llama_token_data_array(
            data=every.ctypes.data_as(ctypes.POINTER(self._L.llama_token_data)),
            size=self._n_vocab, selected=-1, sorted=False)

    def allows(self, grammar: Any, tok: int) -> bool:
        """Whether ``grammar``, in its current state, allows ``tok`` next."""
        one = self._one
        one.data[0].id, one.data[0].logit, one.data[0].p = tok, 0.0, 0.0
        one.array.size, one.array.selected, one.array.sorted = 1, -1, False
        self._L.llama_sampler_apply(grammar, ctypes.byref(one.array))
        return bool(np.isfinite(one.data[0].logit))
