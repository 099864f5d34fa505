"""Sampling: llama.cpp's sampler chain for a job's settings; under a constraint, the
chain runs on logits its matcher has masked (``constraint.py``)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InvalidRequestError
from ...protocol import sampling as P
from ..core.jobs import Sampling
from ..core.matcher import Matcher
from ..core.slots import SamplerChain

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed


GREEDY_STEPS = ("penalties", "dry", "xtc", "infill")
"""The samplers that can change greedy decoding's choice (the others keep the likeliest
token)."""


class Samplers:
    """Builds samplers for one model's vocabulary (``vocab``: a llama_vocab pointer)."""

    def __init__(self, L: Any, vocab: Any, n_vocab: int, eog: tuple[int, ...] = ()) -> None:
        self._L = L
        self._vocab = vocab
        self._n_vocab = n_vocab
        # The candidate array of constrained sampling (engine thread only).
        self._all = np.zeros(n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.eog = eog
        """Its end-of-generation tokens (``ignore_eos`` bars them)."""

    def chain(self, s: Sampling, n_ctx: int) -> SamplerChain | None:
        """llama.cpp's sampler chain for ``s`` (a constraint aside: see ``sample_constrained``), in
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

        # (A grammar is never in the chain: sample_constrained masks the logits first.)
        seed = DEFAULT_SEED if s[P.SEED] is None else s[P.SEED]
        pairs = [(b.token, b.bias) for b in s[P.LOGIT_BIAS]]
        if s.ignore_eos:  # (as llama-server: each end token's logit at -inf)
            pairs += [(t, -math.inf) for t in self.eog]
        if pairs:
            array = (L.llama_logit_bias * len(pairs))(*pairs)
            add(L.llama_sampler_init_logit_bias(self._n_vocab, len(pairs), array))
        last_n, dry_n = s[P.REPEAT_LAST_N], s[P.DRY_PENALTY_LAST_N]
        breakers = [b.encode() for b in s[P.DRY_SEQUENCE_BREAKERS]]
        # Each sampler llama-server's `samplers` names, where it changes anything.
        steps: dict[str, Callable[[], Any] | None] = {
            "penalties": (lambda: L.llama_sampler_init_penalties(
                self._n_vocab, n_ctx if last_n < 0 else last_n, s[P.REPEAT_PENALTY],
                s[P.FREQUENCY_PENALTY], s[P.PRESENCE_PENALTY])) if any(
                s[p] != p.neutral for p in (P.REPEAT_PENALTY, P.FREQUENCY_PENALTY,
                                            P.PRESENCE_PENALTY)) else None,
            "dry": (lambda: L.llama_sampler_init_dry(
                self._vocab, s[P.DRY_MULTIPLIER], s[P.DRY_BASE], s[P.DRY_ALLOWED_LENGTH],
                n_ctx if dry_n < 0 else dry_n, (ctypes.c_char_p * len(breakers))(*breakers),
                len(breakers))) if s[P.DRY_MULTIPLIER] > 0.0 else None,
            "top_n_sigma": (lambda: L.llama_sampler_init_top_n_sigma(s[P.TOP_N_SIGMA]))
            if s[P.TOP_N_SIGMA] > 0.0 else None,
            "top_k": (lambda: L.llama_sampler_init_top_k(s[P.TOP_K]))
            if s[P.TOP_K] > 0 else None,
            "typ_p": (lambda: L.llama_sampler_init_typical(s[P.TYPICAL_P], 1))
            if s[P.TYPICAL_P] < 1.0 else None,
            "top_p": lambda: L.llama_sampler_init_top_p(s[P.TOP_P], 1),
            "min_p": lambda: L.llama_sampler_init_min_p(s[P.MIN_P], 1),
            "xtc": (lambda: L.llama_sampler_init_xtc(
                s[P.XTC_PROBABILITY], s[P.XTC_THRESHOLD], 1, seed))
            if s[P.XTC_PROBABILITY] > 0.0 else None,
            "temperature": lambda: L.llama_sampler_init_temp(s[P.TEMPERATURE]),
            "infill": lambda: L.llama_sampler_init_infill(self._vocab),
        }
        order = s[P.SAMPLERS]
        if s.greedy:  # (only what can change the likeliest token, then it)
            for name in order:
                if name in GREEDY_STEPS and (step := steps[name]) is not None:
                    add(step())
            add(L.llama_sampler_init_greedy())
            return SamplerChain(chain)
        if s[P.MIROSTAT]:  # (its own chain, whatever the order: llama-server's)
            for name in ("penalties", "dry"):
                if name in order and (step := steps[name]) is not None:
                    add(step())
            add(L.llama_sampler_init_temp(s[P.TEMPERATURE]))
            if s[P.MIROSTAT] == 1:
                add(L.llama_sampler_init_mirostat(self._n_vocab, seed, s[P.MIROSTAT_TAU],
                                                  s[P.MIROSTAT_ETA], 100))
            else:
                add(L.llama_sampler_init_mirostat_v2(seed, s[P.MIROSTAT_TAU],
                                                     s[P.MIROSTAT_ETA]))
            return SamplerChain(chain)
        for name in order:
            if (step := steps[name]) is not None:
                add(step())
        add(L.llama_sampler_init_dist(seed))
        return SamplerChain(chain)

    def check(self, s: Sampling) -> None:
        """Raises InvalidRequestError for a logit bias on a token the vocabulary lacks."""
        for b in s[P.LOGIT_BIAS]:
            if b.token >= self._n_vocab:
                raise InvalidRequestError(f"logit_bias: token {b.token} is not in this "
                                          f"model's vocabulary of {self._n_vocab}")

    def free(self, sampler: SamplerChain | None) -> None:
        if sampler is not None:
            self._L.llama_sampler_free(sampler)

    def sample_constrained(self, chain: SamplerChain, matcher: Matcher, logits: np.ndarray) -> int:
        """Sample with ``chain`` from ``logits`` masked by ``matcher`` (every token its
        grammar refuses at -inf, before the chain runs), consumed by both. Raises
        InvalidRequestError when the grammar allows no token. Engine thread only."""
        L = self._L
        arr = self._candidates(matcher.mask(logits))
        L.llama_sampler_apply(chain, ctypes.byref(arr))
        tok = int(arr.data[arr.selected].id)
        matcher.accept(tok)
        L.llama_sampler_accept(chain, tok)
        return tok

    def sample_with_probs(self, chain: SamplerChain, logits: np.ndarray, top: int
                          ) -> tuple[int, list[tuple[int, float]]]:
        """Sample with ``chain`` from ``logits`` as ``llama_sampler_sample`` does (the
        same candidates, the same RNG draw, accepted by the chain), and report the
        ``top`` likeliest candidates after the chain, with their probabilities (those
        at 0 left out): llama-server's ``post_sampling_probs``. Engine thread only."""
        L = self._L
        arr = self._candidates(logits)
        L.llama_sampler_apply(chain, ctypes.byref(arr))
        tok = int(arr.data[arr.selected].id)
        L.llama_sampler_accept(chain, tok)
        if ctypes.addressof(arr.data.contents) == self._all.ctypes.data:
            kept = self._all[:arr.size]  # (the chain cut and sorted the array in place)
            order = np.argsort(-kept["p"], kind="stable")[:top]
            pairs = [(int(kept["id"][i]), float(kept["p"][i])) for i in order]
        else:
            data = arr.data
            pairs = sorted(((int(data[i].id), float(data[i].p)) for i in range(arr.size)),
                           key=lambda pair: -pair[1])[:top]
        return tok, [pair for pair in pairs if pair[1] > 0.0]

    def _candidates(self, logits: np.ndarray) -> Any:
        """Every token with its logit, as a llama_token_data_array over ``_all``."""
        every = self._all
        every["id"] = self._ids
        every["logit"] = logits
        every["p"] = 0.0
        return self._L.llama_token_data_array(
            data=every.ctypes.data_as(ctypes.POINTER(self._L.llama_token_data)),
            size=self._n_vocab, selected=-1, sorted=False)
