"""What decoding does on this machine: the load-time probe of a context (are multi-row
batches bit-exact, what a step costs by row count). The CPU-kernel probe's child is
``kernelprobe.py``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import InternalError
from ..core.stepcost import StepCost
from .batchrow import put


def batch_probe(L: Any, ctx: Any, mem: Any, batch: Any, *, n_vocab: int, n_batch: int,
                n_ctx_slot: int, toks: Sequence[int]) -> tuple[bool, StepCost]:
    """Decode a few tokens one at a time, then as one batch and as two (as drafts are
    verified), and compare the logits bit for bit; time every step. Returns (exact,
    the step cost by row count). Runs on the engine thread; leaves sequence 0 empty.

    Some llama.cpp kernels round differently for several rows than for one: gemma-3
    Q4_K_M on ggml-cpu does.
    """
    toks = list(toks[:12])
    if len(toks) < 6 or n_batch < len(toks):
        return False, StepCost()
    prompt, tail = toks[:-4], toks[-4:]
    timed: list[tuple[int, float]] = []

    def run(groups: list[list[int]]) -> list[np.ndarray]:
        L.llama_memory_seq_rm(mem, 0, -1, -1)
        pos = 0
        got: list[np.ndarray] = []
        for group in groups:
            for i, tok in enumerate(group):
                put(batch, i, tok, pos + i, 0, True)
            batch.n_tokens = len(group)
            started = time.perf_counter()
            if L.llama_decode(ctx, batch) != 0:
                raise InternalError("llama_decode failed while loading")
            timed.append((len(group), time.perf_counter() - started))
            got.extend(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i),
                                             shape=(n_vocab,)).copy()
                       for i in range(len(group)))
            pos += len(group)
        return got[len(prompt) - 1:]

    try:
        alone = run([prompt] + [[t] for t in tail])
        together = run([prompt, tail])
        pairs = run([prompt, tail[:2], tail[2:]])
        if min(n_batch, n_ctx_slot) > 16:
            run([(toks * 3)[:16]])  # (timed only: a full draft's rows)
    except InternalError:
        return False, StepCost()
    finally:
        L.llama_memory_seq_rm(mem, 0, -1, -1)
    # The timings (every row with logits, as a draft's) seed the step cost by row
    # count: 1, 2, 4, 8 and 16 rows (kernels in blocks of rows make 16 cheaper than a
    # guess from 8 says: gemma-3's Q4_K on ggml-cpu). The first decode allocates.
    exact = all(np.array_equal(a, b) and np.array_equal(a, c)
                for a, b, c in zip(alone, together, pairs, strict=True))
    return exact, StepCost.fit(timed[1:])
