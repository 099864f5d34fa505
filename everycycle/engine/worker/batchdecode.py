"""The batch decoder: decodes a ``StepPlan`` — the batch filled from it, one
``llama_decode`` (a background step stoppable by ``Preempt``), timed into the step
costs. A slot is not touched here: a step that ran is applied by the loop
(``Work.commit``); a step stopped is undone by removing the cells its positions may
have been stored in. Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial
from typing import Any

from ...errors import InternalError
from ..core.jobs import Job
from ..core.plan import StepPlan
from ..core.stepcost import Costs, ubatches
from ..llama.batchrow import put
from .lora import Adapters
from .preempt import Preempt


class BatchDecoder:
    """Runs plans on one llama.cpp context, through its one ``llama_batch``."""

    def __init__(self, L: Any, ctx: Any, mem: Any, batch: Any, costs: Costs,
                 preempt: Preempt | None, adapters: Adapters | None = None) -> None:
        self._L = L
        self._ctx = ctx
        self._mem = mem
        self._batch = batch
        self.costs = costs
        self.preempt = preempt
        """Stops a background step for an arriving interactive job (None: never)."""
        self.adapters = adapters
        """The model's LoRA adapters (None: it has none)."""

    def decode(self, plan: StepPlan, pending: Iterable[Job]) -> int | None:
        """Decode ``plan``; llama_decode's result (0: done), or None when the step was
        stopped for an interactive job in ``pending`` (and undone)."""
        L, batch = self._L, self._batch
        for w in plan.work:
            seq = w.slot.seq
            for i, (tok, row) in enumerate(zip(w.tokens, w.rows, strict=True)):
                put(batch, row, tok, w.start + i, seq, w.logits(i))
        batch.n_tokens = plan.n
        if self.adapters is not None:
            self.adapters.apply(self._ctx, plan.lora)
        decode = partial(L.llama_decode, self._ctx, batch)
        started = time.perf_counter()
        preempt = self.preempt
        if preempt is not None and preempt.usable and plan.background:
            rc = preempt.decode(plan, pending, decode,
                                self.costs.estimate(plan.n, plan.filling))
        else:
            rc = decode()
        if rc is None:
            for w in plan.work:
                L.llama_memory_seq_rm(self._mem, w.slot.seq, w.start, -1)
        elif rc == 0:
            took = time.perf_counter() - started
            if plan.filling:
                self.costs.fill.observe(plan.n, took)
            elif len(ubatches([(w.slot.seq, len(w.tokens)) for w in plan.work])) == 1:
                # (the decode table is of single micro-batches: a step llama.cpp split
                # is priced as its parts, ``StepCost.step``)
                self.costs.decode.observe(plan.n, took)
        return rc

    def forget(self, seq: int, start: int) -> None:
        """Sequence ``seq``'s cells from position ``start`` on are wrong (a draft's rows
        the model did not confirm): removed. Raises InternalError where llama.cpp cannot
        (a recurrent state: such a model drafts nothing)."""
        if not self._L.llama_memory_seq_rm(self._mem, seq, start, -1):
            raise InternalError(f"llama.cpp could not take a rejected draft out of "
                                f"sequence {seq}")
