"""A Runner in a child process, for models on remote (RPC) executors.

ggml-rpc aborts the process it runs in when its server goes away; so a model placed on
a remote executor runs in a child process of its own, and ``IsolatedRunner`` stands in
for its Runner in the daemon. If the child dies, every job it had ends with an
Internal error naming the host, the daemon and its other models serve on, and the
next request for that model loads it again (or fails, naming the host).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..errors import ErrorKind, EverycycleError, InternalError
from .runner import Job, Output

Notify = Callable[[list[tuple[Job, Output]]], None]
LOAD_TIMEOUT = 300.0


def _wire_error(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, EverycycleError):
        return exc.kind.value, exc.message
    return ErrorKind.INTERNAL.value, f"{type(exc).__name__}: {exc}"


def _from_wire(kind: str, message: str) -> EverycycleError:
    return EverycycleError(message, kind=ErrorKind(kind))


def _child(conn: Connection, path: str, endpoints: Sequence[str], device_index: int,
           options: dict[str, Any]) -> None:
    """The child: register the RPC servers, load the model, then serve the pipe."""
    import os

    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort here is expected: no gdb dump
    from . import rpc
    from .runner import Runner

    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    jobs: dict[int, Job] = {}
    ids: dict[int, int] = {}  # id(job) -> job id
    runner: Runner | None = None

    def notify(batch: list[tuple[Job, Output]]) -> None:
        out = []
        for job, o in batch:
            error = _wire_error(o.error) if o.error is not None else None
            out.append((ids[id(job)], o.text, o.ids, o.finished, o.reason, error, o.embeddings,
                        job.n_prompt, job.n_reused, job.n_generated))
            if o.finished:
                jobs.pop(ids.pop(id(job)), None)
        assert runner is not None  # jobs come only once it is loaded
        send(("out", out, runner.lookup_drafted, runner.lookup_accepted))

    try:
        devices: list[int] = []
        for i, endpoint in enumerate(endpoints):
            handles = rpc.register(endpoint)
            if i == 0:
                devices = [handles[device_index]]
        runner = Runner(Path(path), notify=notify, gpu_devices=devices, **options)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then we end
        send(("failed", *_wire_error(exc)))
        return
    send(("ready", {"parallel": runner.parallel, "n_ctx_slot": runner.n_ctx_slot,
                    "weights_bytes": runner.weights_bytes, "kv_bytes": runner.kv_bytes,
                    "offloaded": runner.offloaded, "lookup_exact": runner.lookup_exact}))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        verb = message[0]
        if verb == "submit":
            _, jid, tokens, max_tokens, sampling, stop, embed_inputs, lookup = message
            job = Job(tokens=tokens, max_tokens=max_tokens, sampling=sampling, stop=stop,
                      embed_inputs=embed_inputs, lookup=lookup)
            jobs[jid] = job
            ids[id(job)] = jid
            try:
                runner.submit(job)
            except EverycycleError as exc:
                jobs.pop(jid, None)
                ids.pop(id(job), None)
                send(("out", [(jid, "", (), True, "error", _wire_error(exc), None, 0, 0, 0)],
                      runner.lookup_drafted, runner.lookup_accepted))
        elif verb == "cancel":
            _, jid, reason = message
            if jid in jobs:
                runner.cancel(jobs[jid], reason)
        elif verb == "call":
            _, cid, method, args = message
            try:
                send(("ret", cid, True, getattr(runner, method)(*args)))
            except BaseException as exc:  # noqa: BLE001 - the caller's error
                send(("ret", cid, False, _wire_error(exc)))
        elif verb == "close":
            break
    runner.close()
    send(("closed",))


class IsolatedRunner:
    """The daemon's side of a Runner in a child process: the same methods the supervisor
    uses. Construct it off the event loop (it waits for the model to load)."""

    def __init__(self, path: Path, *, endpoint: str, device_index: int, notify: Notify,
                 **options: Any) -> None:
        self.endpoint = endpoint
        self._notify = notify
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child_conn, str(path), [endpoint],
                                                      device_index, options), daemon=True)
        self._proc.start()
        child_conn.close()
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self.dead: str | None = None
        """Why the child is gone (it died, or the host went away); None while it serves."""
        if not self._conn.poll(LOAD_TIMEOUT):
            self._proc.kill()
            raise InternalError(f"loading on RPC host {endpoint} took over {LOAD_TIMEOUT:g} s")
        try:
            first = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise InternalError(f"RPC host {endpoint} went away while the model loaded "
                                f"(worker exit code {self._proc.exitcode})") from None
        if first[0] == "failed":
            self._proc.join(5)
            raise _from_wire(first[1], first[2])
        info = first[1]
        self.parallel: int = info["parallel"]
        self.n_ctx_slot: int = info["n_ctx_slot"]
        self.weights_bytes: int = info["weights_bytes"]
        self.kv_bytes: int = info["kv_bytes"]
        self.offloaded: tuple[int, int] | None = info["offloaded"]
        self.lookup_exact: bool = info["lookup_exact"]
        self.lookup_drafted = 0
        self.lookup_accepted = 0
        self._reader = threading.Thread(target=self._read, name=f"rpc {endpoint}", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ the pipe

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            if self.dead is not None:
                raise InternalError(self.dead)
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                raise InternalError(f"RPC host {self.endpoint} went away") from None

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "out":
                self.lookup_drafted, self.lookup_accepted = message[2], message[3]
                batch = []
                for (jid, text, ids, finished, reason, error, embeddings, n_prompt, n_reused,
                     n_generated) in message[1]:
                    with self._lock:
                        job = self._jobs.get(jid)
                        if job is not None and finished:
                            del self._jobs[jid]
                    if job is None:
                        continue
                    job.n_prompt, job.n_reused, job.n_generated = n_prompt, n_reused, n_generated
                    batch.append((job, Output(text, tuple(ids), finished, reason,
                                              _from_wire(*error) if error else None,
                                              embeddings)))
                if batch:
                    self._notify(batch)
            elif message[0] == "ret":
                _, cid, ok, value = message
                with self._lock:
                    future = self._calls.pop(cid, None)
                if future is not None:
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(_from_wire(*value))
            elif message[0] == "closed":
                break
        self._proc.join(5)
        code = self._proc.exitcode
        with self._lock:
            if self.dead is None:
                self.dead = (f"RPC host {self.endpoint} went away (its worker ended"
                             + (f" with exit code {code})" if code else ")"))
            jobs, self._jobs = self._jobs, {}
            calls, self._calls = self._calls, {}
        error = InternalError(self.dead)
        for future in calls.values():
            future.set_exception(error)
        if jobs:
            self._notify([(job, Output("", (), True, "error", error)) for job in jobs.values()])

    def _call(self, method: str, *args: Any) -> Any:
        future: Future[Any] = Future()
        cid = next(self._ids)
        with self._lock:
            self._calls[cid] = future
        try:
            self._send(("call", cid, method, args))
        except InternalError:
            with self._lock:
                self._calls.pop(cid, None)
            raise
        return future.result()

    # ------------------------------------------------------------------ Runner's methods

    def submit(self, job: Job) -> None:
        jid = next(self._ids)
        with self._lock:
            self._jobs[jid] = job
        try:
            self._send(("submit", jid, list(job.tokens), job.max_tokens, job.sampling,
                        tuple(job.stop), job.embed_inputs, job.lookup))
        except InternalError:
            with self._lock:
                self._jobs.pop(jid, None)
            raise

    def cancel(self, job: Job, reason: str) -> None:
        with self._lock:
            jid = next((k for k, v in self._jobs.items() if v is job), None)
        if jid is not None:
            with contextlib.suppress(InternalError):
                self._send(("cancel", jid, reason))

    def tokenize(self, *args: Any) -> Any:
        return self._call("tokenize", *args)

    def tokenize_chat(self, *args: Any) -> Any:
        return self._call("tokenize_chat", *args)

    def check_grammar(self, *args: Any) -> Any:
        return self._call("check_grammar", *args)

    def close(self) -> None:
        with contextlib.suppress(InternalError):
            self._send(("close",))
        self._reader.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        with self._lock:
            if self.dead is None:
                self.dead = "unloaded"
