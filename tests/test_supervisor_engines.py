"""The supervisor against the Engine contract alone: a fake engine (a real class that
satisfies the Protocol, no llama.cpp) dies on demand, and the supervisor's rules for a
dead engine hold — running requests end once, queued ones wait for the restart, a
crash loop fails the model until Load."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import pytest

from everycycle.chatfmt.chat import ChatPrompt
from everycycle.daemon.keys import LOCAL
from everycycle.daemon.supervisor import Outcome, Supervisor
from everycycle.engine.core.jobs import Job, Output
from everycycle.engine.host.contract import Engine, LoadOptions, Notify
from everycycle.engine.spec.proposer import DraftCount
from everycycle.errors import ErrorKind, InternalError
from everycycle.models.registry import load_registry
from everycycle.protocol import (
    Accepted,
    Done,
    Error,
    Format,
    Generate,
    Load,
    Message,
    ServerEvent,
    Tokens,
    is_terminal,
)

_pids = itertools.count(1000)


class FakeEngine:
    """Emits one "x" per millisecond per job, ``parallel`` at a time; ``die`` ends it
    the way an engine process's death does."""

    def __init__(self, notify: Notify, on_death: Callable[[Engine], None]) -> None:
        self.parallel, self.n_ctx_slot = 2, 1000
        self.weights_bytes = self.kv_bytes = 0
        self.offloaded: tuple[int, int] | None = None
        self.lookup_exact = False
        self.draft_counts: tuple[DraftCount, ...] = ()
        self.prompt_cache = None
        self.step_seconds: tuple[float, ...] = ()
        self.drop_prompt_cache = lambda: 0
        self.dead: str | None = None
        self.exit_cause: str | None = None
        self.pid: int | None = next(_pids)
        self._notify, self._on_death = notify, on_death
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.dead is None:
            time.sleep(0.001)
            with self._lock:
                out = []
                for job in list(self._jobs):
                    if job.cancel_reason is not None:
                        out.append((job, Output("", (), True, "cancelled")))
                    elif job.n_generated >= job.spec.max_tokens:
                        out.append((job, Output("", (), True, "length")))
                    else:
                        job.n_generated += 1
                        out.append((job, Output("x", (120,))))
                        continue
                    self._jobs.remove(job)
            if out and self.dead is None:
                self._notify(out)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.dead is not None:
                raise InternalError(self.dead)
            assert len(self._jobs) < self.parallel, "the supervisor overfilled the slots"
            self._jobs.append(job)

    def cancel(self, job: Job, reason: str) -> None:
        job.cancel_reason = reason

    def tokenize(self, prompt: str, fmt: Format | None = None) -> list[int]:
        if self.dead is not None:
            raise InternalError(self.dead)
        return [ord(c) % 256 for c in prompt]

    def chat_prompt(self, messages: Sequence[Message], tools: object = None,
                    think: bool | None = None, as_prompt: bool = False
                    ) -> tuple[list[int], ChatPrompt]:
        text = "".join(m.content for m in messages)
        return self.tokenize(text), ChatPrompt(text)

    def check_grammar(self, grammar: str) -> None:
        pass

    def rss(self) -> int | None:
        return None

    def close(self) -> None:
        with self._lock:
            self.dead = self.dead or "unloaded"
            jobs, self._jobs = self._jobs, []
        self._notify([(job, Output("", (), True, "cancelled")) for job in jobs])

    def die(self, cause: str) -> None:
        with self._lock:
            self.exit_cause = cause
            self.dead = f"engine for m died: {cause}"
            jobs, self._jobs = self._jobs, []
        error = InternalError(self.dead)
        self._notify([(job, Output("", (), True, "error", error)) for job in jobs])
        self._on_death(self)


class Peer:
    allow_paths = False
    principal = LOCAL

    def __init__(self) -> None:
        self.events: list[ServerEvent] = []

    def emit(self, event: ServerEvent, outcome: Outcome | None = None) -> None:
        self.events.append(event)

    def of(self, rid: str) -> list[ServerEvent]:
        return [e for e in self.events if getattr(e, "request_id", None) == rid]

    def ended(self, rid: str) -> bool:
        return any(is_terminal(e) for e in self.of(rid))


@pytest.fixture
def registry(tmp_path: Path, tiny_gguf: Path) -> Path:
    f = tmp_path / "m.toml"
    f.write_text(f'[models.m]\npath = "{tiny_gguf}"\ncontext = 1000\nparallel = 2\n')
    return f


def factory(made: list[FakeEngine]) -> Callable[..., Engine]:
    """An engine factory that makes FakeEngines and keeps them in ``made``."""

    def make(name: str, path: Path, options: LoadOptions, notify: Notify,
             on_death: Callable[[Engine], None]) -> Engine:
        made.append(FakeEngine(notify, on_death))
        return made[-1]

    return make


async def until(check: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not check():  # noqa: ASYNC110 - polling an outside view
            await anyio.sleep(0.005)


@pytest.mark.anyio
async def test_a_death_ends_running_requests_once_and_the_queue_waits(registry: Path) -> None:
    made: list[FakeEngine] = []
    sup = Supervisor(load_registry(registry), engine_factory=factory(made))
    peer = Peer()
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        for i in range(4):
            n = 30_000 if i < 2 else 5  # (the first two run until the death)
            tg.start_soon(sup.handle, peer, Generate(f"r{i}", "m", "hi", max_tokens=n))
        await until(lambda: all(any(isinstance(e, Tokens) for e in peer.of(f"r{i}"))
                                for i in (0, 1)))
        assert [e for e in peer.of("r3") if isinstance(e, Accepted)][-1].queue_position == 2
        made[0].die("SIGTEST (a test)")
        await until(lambda: all(peer.ended(f"r{i}") for i in range(4)))
        for rid in ("r0", "r1"):
            last = peer.of(rid)[-1]
            assert last == Error(rid, ErrorKind.INTERNAL, "engine for m died: SIGTEST (a test)")
            assert sum(is_terminal(e) for e in peer.of(rid)) == 1
        for rid in ("r2", "r3"):
            assert isinstance(peer.of(rid)[-1], Tokens) and peer.of(rid)[-1].finished
            assert [e.queue_position for e in peer.of(rid) if isinstance(e, Accepted)][-1] == 0
        assert len(made) == 2  # restarted once
        m = sup.snapshot().loaded_models[0]
        assert (m.engine_restarts, m.engine_exit, m.engine_pid) == (1, "SIGTEST (a test)",
                                                                    made[1].pid)
        assert sup.engine_deaths == {("m", "SIGTEST"): 1}
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_three_deaths_in_a_minute_fail_the_model_until_load(registry: Path) -> None:
    made: list[FakeEngine] = []
    sup = Supervisor(load_registry(registry), engine_factory=factory(made))
    peer = Peer()
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        await sup.handle(peer, Load("l0", "m"))
        for n in range(3):
            await until(lambda n=n: len(made) == n + 1
                        and sup.snapshot().loaded_models[0].state is None)
            made[-1].die("SIGSEGV (segmentation fault)")
        await until(lambda: sup.snapshot().loaded_models[0].state == "failed")
        await sup.handle(peer, Generate("g", "m", "hi", max_tokens=3))
        last = peer.of("g")[-1]
        assert isinstance(last, Error) and last.kind is ErrorKind.INTERNAL
        assert "died 3 times" in last.message and "everycycle load m" in last.message
        await sup.handle(peer, Load("l1", "m"))
        assert peer.of("l1") == [Done("l1")]
        tg.start_soon(sup.handle, peer, Generate("g2", "m", "hi", max_tokens=3))
        await until(lambda: peer.ended("g2"))
        assert isinstance(peer.of("g2")[-1], Tokens)
        assert len(made) == 4
        tg.cancel_scope.cancel()
