"""A step of background jobs stopped for an interactive one (``engine/preempt.py``), on
real llama.cpp: llama_decode is really aborted (libc's strlen as the abort callback) and
the step undone, so the jobs go on exactly as if it never ran; an interactive job that
arrives gets its slot from a step that stops for it."""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from daemonhelp import wait_until
from enginehelp import Collector

from everycycle.engine.core.jobs import Job, JobSpec, Sampling
from everycycle.engine.core.plan import StepPlan
from everycycle.engine.core.stepcost import StepCost
from everycycle.engine.worker.preempt import ABORTED, Preempt
from everycycle.engine.worker.runner import Runner

LONG = ("Once upon a time in a quiet village by the sea there lived an old sailor who "
        "told stories to anyone who would listen, every evening, by the harbour wall. ") * 3


class EveryOtherStep(Preempt):
    """Stops every other step it may stop, as if an interactive job came during each."""

    calls = 0

    def decode(self, plan: StepPlan, pending: Iterable[Job],
               run: Callable[[], int], expected_s: float | None = None) -> int | None:
        self.calls += 1
        if self.calls % 2 == 0:
            return super().decode(plan, pending, run, expected_s)

        def stopped() -> int:
            with self._lock:
                self.interrupt()  # (set before the graph runs: it stops at its first node)
            return run()

        return super().decode(plan, pending, stopped, expected_s)


@pytest.fixture
def runner(tiny_gguf: Path) -> Iterator[Runner]:
    r = Runner(tiny_gguf, context=1024, parallel=2, notify=Collector())
    yield r
    r.close()


def _jobs(runner: Runner, run: int, temperature: float) -> list[Job]:
    """Two background jobs: one with a long prompt (read 16 tokens a step), one short."""
    return [Job(JobSpec(tokens=runner.tokenize(text), max_tokens=40,
                        sampling=Sampling.of(temperature=temperature, seed=11),
                        background_age=600), tag=(run, i))
            for i, text in enumerate((LONG, "hello there"))]


def _ids(tiny_gguf: Path, *, temperature: float, stop: bool) -> tuple[list[list[int]], int]:
    """The two jobs' tokens on a fresh engine (every other step stopped, with ``stop``),
    and the steps stopped."""
    c = Collector()
    runner = Runner(tiny_gguf, context=1024, parallel=2, notify=c)
    try:
        batches = runner.loop.batches
        assert batches.preempt is not None  # (a plain model: its steps may stop)
        if stop:
            batches.preempt = EveryOtherStep(runner._L, runner._ctx, runner._cond)
        jobs = _jobs(runner, 0, temperature)
        with runner._cond:  # (both start in the same step, on both engines)
            for job in jobs:
                runner.submit(job)
        return [[i for o in c.wait(job.tag, 120) for i in o.ids] for job in jobs], \
            batches.preempt.stops
    finally:
        runner.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_stopped_step_is_undone_and_the_jobs_go_on_as_if_it_never_ran(
        tiny_gguf: Path, temperature: float) -> None:
    plain, none = _ids(tiny_gguf, temperature=temperature, stop=False)
    stopped, stops = _ids(tiny_gguf, temperature=temperature, stop=True)
    assert none == 0 and stops >= 20  # half the steps: the long prompt's chunks, the tokens
    assert stopped == plain  # the same tokens, sampled or greedy: nothing lost or redone
    assert all(len(ids) == 40 for ids in stopped)


def test_an_interactive_job_stops_the_background_step_it_arrives_in(runner: Runner) -> None:
    """Background jobs keep the engine busy; interactive ones arrive at random moments.
    Some arrive during a step, which then stops (``stops``); each one is served."""
    c = runner.loop.notify
    preempt = runner.loop.batches.preempt
    assert isinstance(c, Collector) and preempt is not None
    bg = [Job(JobSpec(tokens=runner.tokenize(LONG * 2), max_tokens=600,
                      sampling=Sampling.of(temperature=1.0, seed=i), background_age=600),
              tag=("bg", i)) for i in range(2)]
    for job in bg:
        runner.submit(job)
    wait_until(lambda: len(c.outputs.get(("bg", 0), [])) >= 3, "the background work")
    n = 0
    while preempt.stops == 0 and n < 200:
        job = Job(JobSpec(tokens=runner.tokenize(f"question {n}"), max_tokens=1,
                          sampling=Sampling.of(temperature=0.0)), tag=("it", n))
        threading.Timer(0.001 * (n % 7), runner.submit, (job,)).start()
        c.wait(("it", n), 60)
        n += 1
    assert preempt.stops >= 1
    for job in bg:
        runner.cancel(job, "done")
        c.wait(job.tag, 60)


class Timing(Preempt):
    """Records each stoppable step: whether it read prompt tokens, the time it was
    expected to take (what ``Preempt`` stops within), the time it took."""

    steps: list[tuple[bool, float | None, float]]

    def decode(self, plan: StepPlan, pending: Iterable[Job],
               run: Callable[[], int], expected_s: float | None = None) -> int | None:
        filling = plan.filling
        started = time.perf_counter()
        rc = super().decode(plan, pending, run, expected_s)
        self.steps.append((filling, expected_s, time.perf_counter() - started))
        return rc


def test_a_step_that_reads_a_prompt_is_expected_to_take_what_such_steps_took(
        runner: Runner) -> None:
    """The decode table prices rows with logits; a prompt token costs other than that
    (on a CPU about a row's time, and a background chunk makes a step several times a
    decode step). Steps that read prompt tokens are expected to take what such steps
    measured, so an interactive job arriving early in one stops it."""
    c = runner.loop.notify
    assert isinstance(c, Collector) and runner.loop.batches.preempt is not None
    timing = Timing(runner._L, runner._ctx, runner._cond)
    timing.steps = []
    runner.loop.batches.preempt = timing
    runner.costs.decode = StepCost.fit([(1, 1e-6)])  # a decode table that prices nothing
    job = Job(JobSpec(tokens=runner.tokenize(LONG), max_tokens=4,
                      sampling=Sampling.of(temperature=1.0, seed=1), background_age=600),
              tag="bg")
    runner.submit(job)
    c.wait("bg", 60)
    filled = [(expected, took) for filling, expected, took in timing.steps if filling]
    assert len(filled) >= 8  # (its prompt, 16 tokens a step)
    later = filled[3:]  # (once some were measured)
    assert all(expected is not None for expected, _ in later)
    expected = statistics.median(e for e, _ in later if e is not None)
    assert expected >= 0.25 * statistics.median(t for _, t in later)


def test_a_step_stops_for_an_interactive_job_unless_nearly_done(runner: Runner) -> None:
    """An interactive job arriving after half a step (where finishing was once the rule)
    stops it; one arriving when it is nearly done waits for the rest."""
    now = [0.0]
    preempt = Preempt(runner._L, runner._ctx, threading.Condition(), clock=lambda: now[0])
    try:
        def step(arrive_s: float) -> Callable[[], int]:
            def run() -> int:
                now[0] += arrive_s  # (the step's clock, as the job arrives)
                with preempt._lock:
                    preempt.interrupt()
                return ABORTED if preempt._flag[0] == b"x" else 0
            return run

        assert preempt.decode(StepPlan(), [], step(0.6), expected_s=1.0) is None
        assert preempt.decode(StepPlan(), [], step(0.9), expected_s=1.0) == 0
        assert preempt.stops == 1
    finally:  # (the runner's own Preempt is the context's abort callback again)
        own = runner.loop.batches.preempt
        assert own is not None
        runner._L.llama_set_abort_callback(runner._ctx, own._callback,
                                           ctypes.cast(own._flag, ctypes.c_void_p))
