"""The child of the CPU-kernel probe (``python -m everycycle.engine.llama.kernelprobe``, run
by ``hardware/cpukernels.py``): it loads a small model with the CPU's extra buffer types
on and decodes through them, in a process of its own, since a kernel that faults ends
the process."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from ...hardware.cpukernels import FAULT_ENV, write_probe_model


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
    from ..core.jobs import Job, JobSpec, Output, Sampling
    from ..worker.runner import Runner

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
