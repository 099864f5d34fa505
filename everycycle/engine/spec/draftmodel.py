"""A draft model: a second, smaller model with the target's vocabulary, loaded in the
target's engine on its devices, that proposes the next few tokens of a slot for the
target to verify in its one step (speculative decoding, llama-server's ``-md``).

It keeps a sequence per target slot. Before it drafts for a slot it brings that
sequence up to the slot's (the cells they share kept, the rest read: a new prompt, the
tokens the target took), then decodes greedily, one row per drafting slot a step, until
each slot has its tokens or the draft is unsure (``p_min``). Every draft is verified by
the target as any other is (``steps.py``), so it changes speed, never output.

Its decoding is timed (``cost``) so the drafting policy (``modeldrafts.py``) weighs what a
draft costs to make against what it is expected to save. Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InternalError, InvalidRequestError
from ..core.jobs import common_prefix
from ..core.plan import StepPlan
from ..core.stepcost import StepCost
from ..llama.batchrow import put
from ..llama.llamaload import create_context, load_model
from ..llama.logits import RowLogits

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5
"""llama.cpp's rule (``common_speculative_are_compatible``): vocabularies of the same
type, the same BOS and EOS where added, sizes within 128, and the same text for every
token from id 5 on that both have."""


@dataclass(frozen=True, slots=True)
class DraftLimits:
    """llama-server's ``--spec-draft-n-max``, ``--spec-draft-n-min``, ``--draft-p-min``."""

    n_max: int = 3
    """Tokens drafted at most a step (the policy drafts fewer where fewer pay)."""
    n_min: int = 0
    """A draft shorter than this is dropped."""
    p_min: float = 0.0
    """The draft stops at a token the draft model gives less than this probability."""


def incompatible(L: Any, target: Any, draft: Any) -> str | None:
    """Why ``draft``'s vocabulary cannot draft for ``target``'s (llama.cpp's rule);
    None when it can."""
    vt, vd = L.llama_model_get_vocab(target), L.llama_model_get_vocab(draft)
    if L.llama_vocab_type(vt) != L.llama_vocab_type(vd):
        return "their tokenizers are of different types"
    for what, add, tok in (("BOS", L.llama_vocab_get_add_bos, L.llama_vocab_bos),
                           ("EOS", L.llama_vocab_get_add_eos, L.llama_vocab_eos)):
        if add(vt) != add(vd) or (add(vt) and tok(vt) != tok(vd)):
            return f"their {what} tokens differ"
    nt, nd = L.llama_vocab_n_tokens(vt), L.llama_vocab_n_tokens(vd)
    if abs(nt - nd) > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"their vocabularies hold {nt:,} and {nd:,} tokens"
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(nt, nd)):
        if L.llama_vocab_get_text(vt, i) != L.llama_vocab_get_text(vd, i):
            return f"their token {i} differs"
    return None


@dataclass(frozen=True, slots=True)
class Ask:
    """Draft up to ``n`` tokens after ``tokens`` (a slot's cells and its last token) in
    sequence ``seq``."""

    seq: int
    tokens: Sequence[int]
    n: int


class DraftModel:
    """The draft model of one target Runner: its weights, a context of the target's
    slots, and what drafting costs and came to."""

    def __init__(self, L: Any, path: Path, target: Any, *, label: str, target_label: str,
                 parallel: int, n_ctx_slot: int, n_batch: int, threads: int,
                 gpu_devices: Sequence[int], n_gpu_layers: int | None, extra_bufts: bool,
                 kv_cache_type: str, limits: DraftLimits) -> None:
        self._L = L
        self.label = label
        self.limits = limits
        weights = load_model(L, path, gpu_devices=list(gpu_devices),
                             n_gpu_layers=n_gpu_layers, tensor_split=(),
                             extra_bufts=extra_bufts)
        why = incompatible(L, target, weights.model)
        if why is not None:
            L.llama_model_free(weights.model)
            raise InvalidRequestError(f"draft model '{label}' cannot draft for model "
                                      f"'{target_label}': {why}")
        self._weights = weights
        self._model = weights.model
        ctx, self.kv_bytes = create_context(L, weights, path, context=n_ctx_slot,
                                            parallel=parallel, n_batch=n_batch,
                                            threads=threads, kv_cache_type=kv_cache_type)
        self._ctx = ctx
        self._mem = L.llama_get_memory(ctx)
        self._n_batch = n_batch
        self._n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model)))
        self._logits = RowLogits(L, ctx, self._n_vocab)
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        self.weights_bytes = int(L.llama_model_size(self._model))
        self._cached: list[list[int]] = [[] for _ in range(parallel)]
        """The tokens each sequence's cells hold."""
        self.cost = StepCost()
        """A drafting step's time by its rows (one per drafting slot), as measured."""

    def probe(self) -> None:
        """Time drafting steps of 1, 2 and 4 rows and a 64-token read (engine thread, at
        start; the first decode, which allocates, untimed)."""
        slots = len(self._cached)
        for i, rows in enumerate((1, 1, 1, 1, 2, 2, 2, 4, 4, 4, 64)):
            if rows > slots and rows < 64:
                continue
            self._L.llama_memory_clear(self._mem, True)
            for row in range(rows):  # (one row a sequence; 64 rows: one sequence's prompt)
                seq, pos = (row, 0) if rows < 64 else (0, row)
                put(self._batch, row, VOCAB_CHECK_START_TOKEN_ID, pos, seq, True)
            self._decode(rows, timed=i > 0)
        self._L.llama_memory_clear(self._mem, True)

    def draft(self, asks: Sequence[Ask], budget: int) -> list[list[int]]:
        """Each ask's draft: its sequence brought up to its tokens, then greedy tokens
        while the draft model is sure enough (``p_min``), up to its ``n`` (fewer than
        ``n_min``: none). At most ``budget`` tokens are read to bring sequences up: an
        ask further behind (a new prompt's) reads its share and drafts on a later step.
        Raises InternalError when llama.cpp fails."""
        drafts: list[list[int]] = [[] for _ in asks]
        live = self._catch_up(asks, drafts, budget)
        while live:
            for row, i in enumerate(live):
                a = asks[i]
                put(self._batch, row, drafts[i][-1], len(a.tokens) + len(drafts[i]) - 1,
                    a.seq, True)
                self._cached[a.seq].append(drafts[i][-1])
            self._decode(len(live), timed=True)
            live = [i for row, i in enumerate(live) if self._take(row, asks[i], drafts[i])]
        n_min = self.limits.n_min
        return [d if len(d) >= n_min else [] for d in drafts]

    def _catch_up(self, asks: Sequence[Ask], drafts: list[list[int]], budget: int
                  ) -> list[int]:
        """Bring each ask's sequence up to its tokens (in as few batches as fit, ``budget``
        tokens at most) and take its first draft token; the asks still drafting."""
        L, batch = self._L, self._batch
        n, waiting, live = 0, list[tuple[int, int]](), list[int]()
        for i, a in enumerate(asks):
            have = self._cached[a.seq]
            keep = min(common_prefix(have, a.tokens), len(a.tokens) - 1)
            if keep < len(have):
                L.llama_memory_seq_rm(self._mem, a.seq, keep, -1)
                del have[keep:]
            todo = a.tokens[keep:]
            whole = len(todo) <= budget
            todo = todo[:budget]
            budget -= len(todo)
            for j, tok in enumerate(todo):
                if n == self._n_batch:
                    self._decode(n)
                    live += [k for row, k in waiting if self._take(row, asks[k], drafts[k])]
                    n, waiting = 0, []
                put(batch, n, tok, keep + j, a.seq, whole and j == len(todo) - 1)
                n += 1
            have.extend(todo)
            if whole:
                waiting.append((n - 1, i))
        if n:
            self._decode(n)
        return live + [k for row, k in waiting if self._take(row, asks[k], drafts[k])]

    def _take(self, row: int, ask: Ask, draft: list[int]) -> bool:
        """Add the draft model's choice at ``row`` to ``draft`` if it is sure enough;
        whether the ask drafts on."""
        logits = self._logits(row)
        tok = int(logits.argmax())
        p_min = self.limits.p_min
        if p_min > 0.0 and 1.0 / float(np.exp(logits - logits[tok]).sum()) < p_min:
            return False
        draft.append(tok)
        return len(draft) < ask.n

    def _decode(self, rows: int, *, timed: bool = False) -> None:
        self._batch.n_tokens = rows
        started = time.perf_counter()
        if self._L.llama_decode(self._ctx, self._batch) != 0:
            raise InternalError(f"the draft model '{self.label}' failed to decode")
        if timed:
            self.cost.observe(rows, time.perf_counter() - started)

    def decoded(self, plan: StepPlan) -> None:
        pass  # (it catches up as it drafts: ``draft``)

    def close(self) -> None:
        L = self._L
        L.llama_batch_free(self._batch)
        L.llama_free(self._ctx)
        L.llama_model_free(self._model)
