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

Only a step of background jobs alone is ever stopped, and only while no interactive job
waits (one that could not get a slot does not stop steps again and again). The step is
then undone: each of its slots gets back its position, cached tokens, unread prompt and
draft, and its KV cells from that position on are removed (other micro-batches of the
step may have been stored). No sampler ran, so sampling, constraints and held-back text
are untouched: the jobs go on as if the step never was. A model whose cache cannot lose
its last positions (recurrent, hybrid, sliding-window) is never stopped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .jobs import Job
from .slots import Slot

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


@dataclass
class _Before:
    """A slot as it was before the step."""

    slot: Slot
    n_past: int
    n_cached: int
    todo: list[int]


class Preempt:
    """The flag a background step is stopped by, and what undoes the step. ``lock`` is
    the engine's: ``interrupt`` is called under it (by ``submit``)."""

    def __init__(self, L: Any, ctx: Any, mem: Any, lock: threading.Condition) -> None:
        self._L = L
        self._mem = mem
        self._lock = lock
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

    def snapshot(self, active: list[Slot]) -> list[_Before] | None:
        """Before a step is built: its slots as they are, if it may be stopped (its jobs
        all background ones); else None."""
        if self._callback is None or not active or not all(
                s.job is not None and s.job.background for s in active):
            return None
        return [_Before(s, s.n_past, len(s.cached), list(s.todo)) for s in active]

    def decode(self, before: list[_Before], pending: Iterable[Job], run: Callable[[], int],
               expected_s: float | None = None) -> int | None:
        """``run`` the step (``llama_decode``, expected to take ``expected_s``), stoppable
        unless an interactive job waits already. Its result; None when it was stopped, and
        undone: each slot back as it was (``before``)."""
        with self._lock:
            self._armed = not any(not job.background for job in pending)
            self._flag[0] = b"\0"
            self._until = time.perf_counter() + (expected_s * STOP_BEFORE if expected_s
                                                 else 3600.0)
        try:
            rc = run()
        finally:
            with self._lock:
                asked, self._armed = self._flag[0] == b"x", False
                self._flag[0] = b"\0"
        if not (asked and rc == ABORTED):
            return rc
        for b in before:
            s = b.slot
            self._L.llama_memory_seq_rm(self._mem, s.seq, b.n_past, -1)
            s.n_past = b.n_past
            del s.cached[b.n_cached:]
            s.todo[:] = b.todo
            s.draft = []
        self.stops += 1
        return None

    def interrupt(self) -> None:
        """An interactive job arrived (under the lock): stop the step in flight, if it
        may be stopped and is not nearly done (STOP_BEFORE: then finishing it costs the
        job little wait, and the background work nothing)."""
        if self._armed and time.perf_counter() < self._until:
            self._flag[0] = b"x"
