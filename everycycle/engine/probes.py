"""What decoding does on this machine: the load-time probe of a context (are multi-row
batches bit-exact, what a step costs by row count), and the child of the CPU-kernel probe
(``python -m everycycle.engine.probes``, run by ``hardware/cpukernels.py``)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InternalError
from ..hardware.cpukernels import FAULT_ENV, write_probe_model
from .stepcost import StepCost


def put(batch: Any, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
    """Row ``i`` of a llama_batch: ``token`` at ``pos`` of sequence ``seq``."""
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = logits


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


# ------------------------------------------------------- the CPU-kernel probe's child


def _illegal_instruction() -> None:
    """Execute ``ud2``: the CPU raises #UD, the kernel sends SIGILL."""
    import ctypes
    import mmap

    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(b"\x0f\x0b")  # ud2
    address = ctypes.addressof(ctypes.c_char.from_buffer(code))
    ctypes.CFUNCTYPE(None)(address)()


def _kernel_child(folder: Path) -> int:
    """Load the probe's model with the CPU's extra buffer types on and decode through
    them; 0 when it ran, 3 when the decode failed (a fault ends the process instead,
    so the folder, which the parent made, is the parent's to remove)."""
    from .jobs import Job, JobSpec, Output, Sampling
    from .runner import Runner

    path = folder / "probe-q4_0.gguf"
    write_probe_model(path)
    done = threading.Event()
    outs: list[Output] = []

    def notify(batch: list[tuple[Job, Output]]) -> None:
        for _, o in batch:
            outs.append(o)
            if o.finished:
                done.set()

    if os.environ.get(FAULT_ENV) == "sigill":
        _illegal_instruction()
    runner = Runner(path, context=256, parallel=1, notify=notify, n_threads=2,
                    extra_bufts=True, n_batch=64)
    try:
        # The load-time probe already decoded 1-, 2-, 4- and 8-row batches; decode a
        # prompt and a few tokens more, through the slot path.
        runner.submit(Job(JobSpec(tokens=list(range(3, 40)), max_tokens=4, sampling=Sampling.of(temperature=0.0), lookup=False)))
        if not done.wait(60) or outs[-1].reason == "error":
            return 3
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(_kernel_child(Path(sys.argv[1])))
