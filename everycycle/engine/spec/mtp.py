"""A model's own next-token heads (multi-token prediction, llama.cpp's ``draft-mtp``): a
GGUF with ``nextn`` layers (DeepSeek-V3, GLM-4.5, Qwen3-Next, Hunyuan-V3, …) drafts for
itself. Its MTP layers run in a second llama.cpp context of the same model
(``LLAMA_CONTEXT_TYPE_MTP``), whose KV cache holds those layers only.

Each MTP row reads a token and the target's hidden state one position before it (the
target's ``nextn`` embedding, output for every row of its batch). So after every step
the target decodes, the same rows go through the MTP context, paired with the target's
states (``decoded``); to draft, it reads the slot's last token with the state before
it, then each drafted token with the state the MTP layers gave the one before
(``draft``), as ``common_speculative_impl_draft_mtp`` does. Its own cells of the draft
are removed before the target verifies it; the target's verification writes the
confirmed ones.

It follows the target's cells only where it read every one of them: a slot whose
cells came from elsewhere (the prompt cache, a parked job, an image) drafts with it no
more until a job starts that slot from its first token. Drafts are verified as any
others, so MTP changes speed, never output. Engine thread only.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InternalError
from ...hardware.gguf import read_metadata
from ..core.plan import StepPlan
from ..core.stepcost import StepCost
from ..llama.llamaload import Weights, create_context
from .draftmodel import Ask, DraftLimits


def mtp_layers(path: Path) -> int:
    """How many MTP (``nextn``) layers the GGUF at ``path`` has (0: none)."""
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.nextn_predict_layers", 0) if isinstance(arch, str) else 0
    return value if isinstance(value, int) else 0


class MtpHeads:
    """The MTP context of one target context, and what its cells hold per sequence."""

    def __init__(self, L: Any, X: Any, weights: Weights, target: Any, path: Path, *,
                 context: int, parallel: int, n_batch: int, threads: int,
                 kv_cache_type: str, limits: DraftLimits) -> None:
        self._L, self._X = L, X
        self.limits = limits
        ctx, self.kv_bytes = create_context(L, weights, path, context=context,
                                            parallel=parallel, n_batch=n_batch,
                                            threads=threads, kv_cache_type=kv_cache_type,
                                            mtp_of=target)
        self._ctx, self._target = ctx, target
        self._mem = L.llama_get_memory(ctx)
        X.llama_set_embeddings_nextn(target, True, False)  # (a state for every row)
        X.llama_set_embeddings_nextn(ctx, True, True)  # (for its output rows)
        model = weights.model
        self._n_embd = int(L.llama_model_n_embd_out(model))
        self._n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
        self._n_batch = n_batch
        self._batch = L.llama_batch_ext_init(ctx)
        self._have: list[list[int]] = [[] for _ in range(parallel)]
        """The tokens each sequence's MTP cells hold (the target's, position by position)."""
        self._states: list[tuple[int, np.ndarray] | None] = [None] * parallel
        """Each sequence's target states from its last step: (first position, rows)."""
        self.cost = StepCost()
        """A drafting step's time by its rows, as measured."""
        self._off = False
        """Its probe failed: it follows and drafts nothing (its cost unknown)."""

    # ------------------------------------------------------------ following the target

    def decoded(self, plan: StepPlan) -> None:
        """The target decoded ``plan`` (and its slots took it: each work's first
        ``start`` cached tokens are what came before its rows): its rows go through the
        MTP layers too, each with the target's state before it. Raises InternalError
        where llama.cpp fails."""
        if not plan.n or self._off:
            return
        rows = np.ctypeslib.as_array(self._X.llama_get_embeddings_nextn(self._target),
                                     shape=(plan.n, self._n_embd))
        todo: list[tuple[int, int, int, np.ndarray]] = []  # (seq, token, position, state)
        for w in plan.work:
            seq = w.slot.seq
            before = self._state_before(seq, w.slot.cached, w.start)
            if before is None:
                continue
            states = rows[w.rows].copy()
            for k, token in enumerate(w.tokens):
                todo.append((seq, token, w.start + k, before if k == 0 else states[k - 1]))
            self._have[seq].extend(w.tokens)
            self._states[seq] = (w.start, states)
        for at in range(0, len(todo), self._n_batch):
            self._process(todo[at:at + self._n_batch], outputs=False)

    def _state_before(self, seq: int, cached: Sequence[int], start: int
                      ) -> np.ndarray | None:
        """The target's state at position ``start - 1`` of ``seq``, with the MTP cells
        cut to the first ``start`` of the target's ``cached``; None where they do not
        hold those tokens (the sequence is then cleared, and followed again once a job
        starts it from its first token). A prefix a new job reuses has its cells but not
        the state of its last token (that step was another job's): zeros stand in for it,
        as for the first token (one MTP row less informed; drafts are verified)."""
        have = self._have[seq]
        zero = np.zeros(self._n_embd, np.float32)
        if start == 0:
            if have:
                self._L.llama_memory_seq_rm(self._mem, seq, -1, -1)
                have.clear()
            return zero
        if len(have) >= start and len(cached) >= start and have[:start] == cached[:start]:
            if len(have) > start:
                self._L.llama_memory_seq_rm(self._mem, seq, start, -1)
                del have[start:]
            kept = self._states[seq]
            if kept is not None and kept[0] <= start - 1 < kept[0] + len(kept[1]):
                state: np.ndarray = kept[1][start - 1 - kept[0]]
                return state
            return zero
        if have:
            self._L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            have.clear()
        self._states[seq] = None
        return None

    # ------------------------------------------------------------ drafting

    def draft(self, asks: Sequence[Ask], budget: int) -> list[list[int]]:
        """Each ask's draft: greedy tokens of the MTP layers while they are sure enough
        (``p_min``), up to its ``n`` (fewer than ``n_min``: none); none for a sequence
        the MTP cells do not follow. (``budget`` is a draft model's catching up: the
        MTP cells never read what the target has not.)"""
        drafts: list[list[int]] = [[] for _ in asks]
        if self._off:
            return drafts
        live: list[tuple[int, int, int, np.ndarray]] = []  # (ask, token, position, state)
        for i, a in enumerate(asks):
            start = len(a.tokens) - 1  # (the last token is the one the target decodes next)
            before = self._state_before(a.seq, a.tokens, start)
            if before is not None and start > 0:
                live.append((i, a.tokens[-1], start, before))
        while live:
            states = self._process([(asks[i].seq, tok, pos, h) for i, tok, pos, h in live],
                                   outputs=True)
            going = []
            for row, (i, _, pos, _) in enumerate(live):
                tok = self._take(row)
                if tok is None:
                    continue
                drafts[i].append(tok)
                if len(drafts[i]) < asks[i].n:
                    going.append((i, tok, pos + 1, states[row]))
            live = going
        for a in asks:  # (its cells of the drafts go: the target's verification writes them)
            self._L.llama_memory_seq_rm(self._mem, a.seq, len(a.tokens) - 1, -1)
        n_min = self.limits.n_min
        return [d if len(d) >= n_min else [] for d in drafts]

    def _take(self, row: int) -> int | None:
        """The MTP layers' choice at output ``row``, or None where it is not sure enough."""
        logits = np.ctypeslib.as_array(self._L.llama_get_logits_ith(self._ctx, row),
                                       shape=(self._n_vocab,))
        tok = int(logits.argmax())
        p_min = self.limits.p_min
        if p_min > 0.0 and 1.0 / float(np.exp(logits - logits[tok]).sum()) < p_min:
            return None
        return tok

    def _process(self, rows: Sequence[tuple[int, int, int, np.ndarray]], *,
                 outputs: bool) -> np.ndarray:
        """Decode ``rows`` (sequence, token, position, the state before it) in the MTP
        context; with ``outputs``, each row's logits and its MTP state (returned)."""
        L, batch = self._L, self._batch
        states = np.ascontiguousarray(np.stack([h for *_, h in rows]), dtype=np.float32)
        L.llama_batch_ext_clear(batch)
        row_bytes = self._n_embd * 4
        base = states.ctypes.data
        for r, (seq, tok, pos, _) in enumerate(rows):
            idx = L.llama_batch_ext_add_token(batch, seq, tok)
            if idx < 0:
                raise InternalError(f"the MTP batch refused a row ({idx})")
            L.llama_batch_ext_set_pos(batch, idx, (L.llama_pos * 4)(pos, 0, 0, 0))
            embd = L.llama_embd(ctypes.cast(base + r * row_bytes,
                                            ctypes.POINTER(ctypes.c_float)), 1, self._n_embd)
            if not L.llama_batch_ext_set_embd_token(batch, idx, embd):
                raise InternalError("the MTP batch refused a hidden state")
            if outputs:
                L.llama_batch_ext_set_output_logits(batch, idx, True)
        started = time.perf_counter()
        if L.llama_process(self._ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) != 0:
            raise InternalError("the MTP layers failed to decode")
        if not outputs:
            return states
        self.cost.observe(len(rows), time.perf_counter() - started)
        out = np.empty((len(rows), self._n_embd), np.float32)
        for r in range(len(rows)):
            out[r] = np.ctypeslib.as_array(
                self._X.llama_get_embeddings_nextn_ith(self._ctx, r), shape=(self._n_embd,))
        return out

    def probe(self) -> None:
        """Time drafting steps of 1, 2 and 4 rows (engine thread, at start; the first,
        which allocates, counts for little: ``StepCost`` keeps medians). Raises
        InternalError where llama.cpp fails (the heads are then not asked: ``draft``
        makes nothing)."""
        zero = np.zeros(self._n_embd, np.float32)
        slots = len(self._have)
        self._off = True
        for rows in (1, 1, 1, 1, 2, 2, 2, 4, 4, 4):
            if rows > slots:
                continue
            self._L.llama_memory_clear(self._mem, True)
            self._process([(s, 5, 0, zero) for s in range(rows)], outputs=True)
        self._L.llama_memory_clear(self._mem, True)
        self._off = False
        for have in self._have:
            have.clear()

    def close(self) -> None:
        self._L.llama_batch_ext_free(self._batch)
        self._L.llama_free(self._ctx)
