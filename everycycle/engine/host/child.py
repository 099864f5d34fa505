"""The engine process's own side: ``python -m everycycle.engine.host.child FD`` loads one
model into a Runner and serves it over the pipe on fd FD (the typed messages of
contract.py): jobs in, a step's outputs out in one message, calls answered, a heartbeat
every second. ``process.py`` is the daemon's side.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.jobs import Job, Output
from .contract import (
    HEARTBEAT_S,
    Call,
    CancelJob,
    CheckGrammar,
    Closed,
    CloseEngine,
    EngineInfo,
    Heartbeat,
    JobOutput,
    LoadFailed,
    LoadOptions,
    Outputs,
    Ready,
    Returned,
    SubmitJob,
    WireError,
    receive_message,
    send_message,
)

if TYPE_CHECKING:
    from ..worker.runner import Runner


def _isolate() -> None:
    """In the child: ignore the terminal's Ctrl-C (the daemon decides) and keep stdout
    for the daemon's own (nothing of ours goes there). The child ends with the daemon:
    when the daemon's end of the pipe closes, however it died. (Not PR_SET_PDEATHSIG:
    that fires when the *thread* that started the child ends, a worker thread here.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # a fault's gdb dump helps nobody here
    with contextlib.suppress(OSError):
        os.dup2(2, 1)


def main() -> None:
    """``python -m everycycle.engine.host.child FD``: the child's entry. Its first message
    on the pipe (a socket, fd FD) is what to load."""
    conn = Connection(int(sys.argv[1]))
    path, options = receive_message(conn)
    _serve(conn, path, options)


def _serve(conn: Connection, path: str, options: LoadOptions) -> None:
    """The child: load the model, then serve the pipe until told to close or it ends."""
    _isolate()
    from ..worker.runner import Runner

    send_lock = threading.Lock()

    def send(message: object) -> None:
        with send_lock:
            send_message(conn, message)

    jobs: dict[int, Job] = {}
    ids: dict[int, int] = {}  # id(job) -> its jid
    runner: Runner | None = None

    def notify(batch: list[tuple[Job, Output]]) -> None:
        items = []
        for job, o in batch:
            jid = ids[id(job)]
            items.append(JobOutput.of(jid, job, o))
            if o.finished:
                del ids[id(job)]
                jobs.pop(jid, None)
        assert runner is not None  # jobs come only once it is loaded
        send(Outputs(items, runner.draft_counts, runner.images_encoded))

    try:
        runner = Runner.load(Path(path), options, notify)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then we end
        send(LoadFailed(WireError.of(exc)))
        return
    send(Ready(EngineInfo(os.getpid(), runner.parallel, runner.n_ctx_slot,
                          runner.weights_bytes, runner.kv_bytes, runner.offloaded,
                          runner.lookup_exact, runner.vocab_facts)))
    stop = threading.Event()

    def beat() -> None:
        assert runner is not None
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError, ValueError):
                send(Heartbeat(runner.steps, runner.prompt_cache, runner.step_seconds))

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def answer(message: Call) -> None:
        assert runner is not None
        try:
            value = message.question.answer(runner)
            send(Returned(message.cid, value, None))
        except Exception as exc:  # noqa: BLE001 - the caller's error
            with contextlib.suppress(OSError, ValueError):
                send(Returned(message.cid, None, WireError.of(exc)))
    while True:
        try:
            message = receive_message(conn)
        except (EOFError, OSError):
            break
        if isinstance(message, SubmitJob):
            job = Job(message.spec)
            jobs[message.jid] = job
            ids[id(job)] = message.jid
            try:
                runner.submit(job)
            except Exception as exc:  # noqa: BLE001 - that job's error
                jobs.pop(message.jid, None)
                ids.pop(id(job), None)
                failed = Output("", (), True, "error", WireError.of(exc).exception())
                send(Outputs([JobOutput.of(message.jid, job, failed)],
                             runner.draft_counts, runner.images_encoded))
        elif isinstance(message, CancelJob):
            if message.jid in jobs:
                runner.cancel(jobs[message.jid], message.reason)
        elif isinstance(message, Call) and isinstance(message.question, CheckGrammar):
            # On a thread of its own: compiling a grammar may take a while, and the
            # pipe keeps taking submits and cancels meanwhile (the Runner's API is
            # any-thread; the caller waits for its own answer, by its cid).
            threading.Thread(target=answer, args=(message,), name="engine grammar",
                             daemon=True).start()
        elif isinstance(message, Call):
            answer(message)
        elif isinstance(message, CloseEngine):
            break
    stop.set()
    runner.close()
    with contextlib.suppress(OSError, ValueError):
        send(Closed())


if __name__ == "__main__":
    main()
