"""Embeddings: a second llama.cpp context on a loaded model, in embeddings mode.

The runner creates it on its engine thread at the first embedding job and runs every
call into it there. Pooling is the model's own (llama.cpp reads it from the GGUF); a
model that declares none (most causal LMs) is mean-pooled. Vectors are L2-normalized,
as llama.cpp's embedding tool and llama-server do by default. A reranker (rank pooling)
gives each sequence its classifier's outputs instead, unnormalized (rerank.py). Inputs are batched: as
many sequences per ``llama_decode`` as fit ``n_batch`` tokens and ``n_seq_max`` sequences,
whichever requests they came from.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...errors import EverycycleError, InternalError, InvalidRequestError
from ..core.jobs import Job, Output

POOLING_NONE = 0
POOLING_MEAN = 1
POOLING_RANK = 4


class Embedder:
    """Embeddings for one model. Construct and call on the runner's engine thread."""

    def __init__(self, L: Any, model: Any, *, n_threads: int, n_batch: int = 2048,
                 n_seq_max: int = 32) -> None:
        self._L = L
        self.n_batch = n_batch
        self._n_seq_max = n_seq_max
        self._ctx = self._context(model, n_threads, pooling=-1)  # the model's own pooling
        if L.llama_pooling_type(self._ctx) == POOLING_NONE:
            L.llama_free(self._ctx)
            self._ctx = self._context(model, n_threads, pooling=POOLING_MEAN)
        self.pooling = int(L.llama_pooling_type(self._ctx))
        self._n_embd = int(L.llama_model_n_cls_out(model) if self.pooling == POOLING_RANK
                           else L.llama_model_n_embd_out(model)
                           if hasattr(L, "llama_model_n_embd_out")
                           else L.llama_model_n_embd(model))
        """Floats per sequence: its embedding, or a reranker's classifier outputs."""
        self._encoder_only = bool(L.llama_model_has_encoder(model)
                                  and not L.llama_model_has_decoder(model))
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        self._mem = L.llama_get_memory(self._ctx)

    def _context(self, model: Any, n_threads: int, pooling: int) -> Any:
        L = self._L
        params = L.llama_context_default_params()
        params.embeddings = True
        params.pooling_type = pooling
        params.n_ctx = self.n_batch
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch  # a pooled sequence must fit one micro-batch
        params.n_seq_max = self._n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.no_perf = True
        params.kv_unified = True
        ctx = L.llama_init_from_model(model, params)
        if not ctx:
            raise InternalError("llama.cpp could not create an embeddings context")
        return ctx

    def run(self, jobs: Sequence[Job], out: list[tuple[Job, Output]],
            progress: Callable[[], None] = lambda: None) -> None:
        """Embed every input of ``jobs`` in shared batches; each job's Output (its
        vectors, cancelled, or the error) goes on ``out``; ``progress`` is called
        between batches."""

        def cancelled() -> bool:
            progress()
            return any(j.cancel_reason for j in jobs)

        ranks = self.pooling == POOLING_RANK
        for job in [j for j in jobs if j.spec.rerank != ranks]:
            error = InvalidRequestError(
                "this model is a reranker: it scores (query, document) pairs (rerank), "
                "it does not embed" if ranks else "this model is not a reranker")
            out.append((job, Output("", (), True, "error", error)))
        jobs = [j for j in jobs if j.spec.rerank == ranks]
        if not jobs:
            return
        try:
            inputs = [tokens for job in jobs for tokens in job.spec.embed_inputs or ()]
            vectors = self.embed(inputs, cancelled=cancelled)
        except EverycycleError as exc:
            out.extend((job, Output("", (), True, "error", exc)) for job in jobs)
            return
        if vectors is None:
            out.extend((job, Output("", (), True, "cancelled")) for job in jobs)
            return
        i = 0
        for job in jobs:
            n = len(job.spec.embed_inputs or ())
            out.append((job, Output("", (), True, "embedded", embeddings=vectors[i:i + n])))
            i += n

    def embed(self, inputs: Sequence[Sequence[int]],
              cancelled: Callable[[], bool] = lambda: False) -> list[list[float]] | None:
        """One normalized vector per token sequence, in order; None if ``cancelled``
        turned true between batches. Every sequence must be 1..n_batch tokens."""
        out: list[list[float]] = []
        group: list[Sequence[int]] = []
        used = 0
        for tokens in inputs:
            if group and (used + len(tokens) > self.n_batch or len(group) >= self._n_seq_max):
                if cancelled():
                    return None
                out.extend(self._decode(group))
                group, used = [], 0
            group.append(tokens)
            used += len(tokens)
        if group:
            if cancelled():
                return None
            out.extend(self._decode(group))
        return out

    def _decode(self, group: Sequence[Sequence[int]]) -> list[list[float]]:
        L = self._L
        batch = self._batch
        L.llama_memory_clear(self._mem, True)
        n = 0
        for seq, tokens in enumerate(group):
            for pos, tok in enumerate(tokens):
                batch.token[n] = tok
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = True
                n += 1
        batch.n_tokens = n
        rc = (L.llama_encode(self._ctx, batch) if self._encoder_only
              else L.llama_decode(self._ctx, batch))
        if rc != 0:
            raise InternalError(f"embedding failed: llama_decode returned {rc}")
        vectors = []
        for seq in range(len(group)):
            ptr = L.llama_get_embeddings_seq(self._ctx, seq)
            if not ptr:
                raise InternalError("llama.cpp returned no embedding")
            v = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                      shape=(self._n_embd,)).astype(np.float64)
            if self.pooling == POOLING_RANK:  # scores, as llama.cpp gives them
                vectors.append(v.tolist())
                continue
            norm = float(np.linalg.norm(v))
            vectors.append((v / norm if norm > 0 else v).tolist())
        return vectors

    def close(self) -> None:
        L = self._L
        L.llama_batch_free(self._batch)
        L.llama_free(self._ctx)
