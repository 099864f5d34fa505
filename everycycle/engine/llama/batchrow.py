"""A llama_batch's rows, written one at a time (the step's batch, the probes', the
draft model's)."""

from __future__ import annotations

from typing import Any


def put(batch: Any, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
    """Row ``i`` of a llama_batch: ``token`` at ``pos`` of sequence ``seq``."""
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = logits
