"""An interactive job never waits for a background step to end: the step stops.

A decode step is the engine's unit of work, and on a CPU one can take a good part of a
second (a background prompt's chunk beside three decoding slots). An interactive job that
arrives meanwhile used to wait for it; now the step is abandoned.

llama.cpp's CPU backend asks an abort callback after every node of the graph, on one of
its threads; an aborted ``llama_decode`` returns 2 and removes the positions of the
micro-batch it was in from the KV cache. The callback here is libc's ``strlen`` over a
one-byte flag: no Python (and no GIL) runs on ggml's threads, and reading the flag costs
nanoseconds a node. ``strlen`` of ``""`` is 0 (go on); of ``"x"`` is 1 (stop), whose low
byte is the ``bool`` the caller reads.

Only a step of background jobs alone is ever stopped (``StepPlan.background``), and only
while no interactive job waits (one that could not get a slot does not stop steps again
and again). The step is then undone by the batch decoder (``batchdecode.py``): a slot changes
only once its step has run, so undoing one is removing the cells the step's positions
may have been stored in (other micro-batches of the step may have been). No sampler ran,
so sampling, constraints and held-back text are untouched: the jobs go on as if the step
never was. A model whose cache cannot lose its last positions (recurrent, hybrid,
sliding-window) is never stopped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..core.jobs import Job
from ..core.plan import StepPlan

ABORTED = 2
"""What ``llama_decode`` returns for a step it abandoned."""

STOP_BEFORE = 0.75
"""A step is stopped only while less than this share of the time it is expected to take
has passed. Past it, the interactive job waits a quarter step at most (on a 2-core CPU a
step that reads a background prompt chunk takes ~100 ms: 25 ms, against its own prompt's
~90 ms); before it, the background work redoes what the step had done (at most three
quarters of a step, once per interactive request)."""


def _strlen() -> Any:
    """libc's strlen, as a C function pointer (None where it cannot be found)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return ctypes.cast(libc.strlen, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


class Preempt:
    """The flag a background step is stopped by, and whether it was. ``lock`` is the
    engine's: ``interrupt`` is called under it (by ``submit``)."""

    def __init__(self, L: Any, ctx: Any, lock: threading.Condition,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._lock = lock
        self._clock = clock
        """Seconds (``perf_counter``; a test's own clock)."""
        self._flag = ctypes.create_string_buffer(2)
        self._callback: Any = None
        self._armed = False
        self._until = 0.0
        """When the step in flight is STOP_BEFORE done (perf_counter): not stopped after."""
        self.stops = 0
        """Steps stopped so far."""
        address = _strlen()
        if address is not None:
            self._callback = L.ggml_abort_callback(address)
            L.llama_set_abort_callback(ctx, self._callback, ctypes.cast(self._flag,
                                                                        ctypes.c_void_p))

    @property
    def usable(self) -> bool:
        """Whether steps can be stopped here (libc's strlen was found)."""
        return self._callback is not None

    def decode(self, plan: StepPlan, pending: Iterable[Job], run: Callable[[], int],
               expected_s: float | None = None) -> int | None:
        """``run`` the step ``plan`` (``llama_decode``, expected to take ``expected_s``),
        stoppable unless an interactive job waits already. Its result; None when it was
        stopped (its cells are then the caller's to remove)."""
        with self._lock:
            self._armed = not any(not job.background for job in pending)
            self._flag[0] = b"\0"
            self._until = self._clock() + (expected_s * STOP_BEFORE if expected_s
                                           else 3600.0)
        try:
            rc = run()
        finally:
            with self._lock:
                asked, self._armed = self._flag[0] == b"x", False
                self._flag[0] = b"\0"
        if not (asked and rc == ABORTED):
            return rc
        self.stops += 1
        return None

    def interrupt(self) -> None:
        """An interactive job arrived (under the lock): stop the step in flight, if it
        may be stopped and is not nearly done (STOP_BEFORE: then finishing it costs the
        job little wait, and the background work nothing)."""
        if self._armed and self._clock() < self._until:
            self._flag[0] = b"x"
