"""A synchronous harness around engine.Runner for tests and benchmarks."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from everycycle.engine.core.jobs import Job, Output
from everycycle.engine.core.stepcost import StepCost


@dataclass
class Collector:
    """Receives a runner's step outputs; ``wait`` blocks until a job finished."""

    outputs: dict[object, list[Output]] = field(default_factory=dict)
    done: dict[object, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, batch: list[tuple[Job, Output]]) -> None:
        with self.lock:
            for job, out in batch:
                self.outputs.setdefault(job.tag, []).append(out)
                if out.finished:
                    self.event(job.tag).set()

    def event(self, tag: object) -> threading.Event:
        return self.done.setdefault(tag, threading.Event())

    def wait(self, tag: object, timeout: float = 30.0) -> list[Output]:
        with self.lock:
            ev = self.event(tag)
        assert ev.wait(timeout), f"job {tag!r} did not finish"
        return self.outputs[tag]

    def text(self, tag: object) -> str:
        return "".join(o.text for o in self.wait(tag))


class Flat(StepCost):
    """Every step costs ``seconds``, whatever its rows (a GPU's profile), whatever is
    measured: every draft the model is likely to confirm pays."""

    def __init__(self, seconds: float = 0.01) -> None:
        super().__init__()
        self._seconds = seconds

    def observe(self, rows: int, seconds: float) -> None:
        if not self._seen:
            for n in (1, 2, 64):
                super().observe(n, self._seconds)
