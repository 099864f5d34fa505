"""One engine process per loaded model (child.py): the daemon's proxy for it.

A native fault in llama.cpp (SIGILL from CPU kernels this CPU cannot run, a
``GGML_ABORT``, a CUDA error, the OOM killer, ggml-rpc losing its server) ends the
process it happens in. So the daemon never loads a model itself: each model's Runner
lives in a child process, and ``EngineProcess`` stands in for it in the daemon,
satisfying the same ``Engine`` contract over a pipe of typed messages (contract.py).

If the child dies, every job it had ends with one Internal error naming the model and
the cause (``engine for smollm2-135m died: SIGILL (illegal instruction)``), pending
calls fail the same way, and ``on_death`` tells the owner, which decides what comes
next (the supervisor restarts it with backoff).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ...chatfmt.chat import ChatPrompt
from ...errors import InternalError
from ...hardware.cpukernels import signal_cause
from ...protocol import Format, Message
from ..core.jobs import Job, Output
from ..spec.proposer import DraftCount
from .contract import (
    HEARTBEAT_S,
    CacheStats,
    Call,
    CancelJob,
    CheckGrammar,
    Closed,
    CloseEngine,
    DropPromptCache,
    Heartbeat,
    LoadFailed,
    LoadOptions,
    MessageReader,
    Notify,
    Outputs,
    Question,
    Ready,
    RenderChat,
    RerankTokens,
    Returned,
    SubmitJob,
    Tokenize,
    TokenizeTexts,
    TokenPieces,
    receive_message,
    send_message,
)

LOAD_TIMEOUT = 300.0
CLOSE_TIMEOUT = 30.0
HANG_AFTER = 60.0
"""The default: an engine with work in hand and no progress for this long is hung (a
step of a large model on a slow device stays well under it; a long prefill is many
steps)."""

log = logging.getLogger(__name__)


Readable = Callable[[int, Callable[[], None]], Callable[[], None]]
"""Call back when file descriptor ``fd`` is readable (``(fd, callback)``, from any
thread); returns what stops that (called from the callback's own thread)."""


class EngineProcess:
    """The daemon's side of a Runner in a child process (an ``Engine``).

    Construct it off the event loop: it waits for the model to load. ``label`` names
    the model in error messages; ``on_death`` is called (on a thread of its own) after
    the child died unasked, once its jobs have had their errors.

    What the child sends is read on a thread of its own, or, with ``readable`` (the
    daemon's event loop), by ``pump`` when the pipe is readable: then a step's outputs
    reach ``notify`` on the loop itself, with no thread in between (the per-token path).
    """

    def __init__(self, path: Path, options: LoadOptions, *, notify: Notify, label: str,
                 on_death: Callable[[EngineProcess], None] | None = None,
                 hang_after: float = HANG_AFTER, readable: Readable | None = None) -> None:
        self.label = label
        self.hang_after = hang_after
        """Seconds an engine with work in hand may go without progress (a step, a call
        answered) before it is taken for hung: killed, and its requests told so."""
        self.options = options
        self.endpoint = options.rpc_endpoints[0] if options.rpc_endpoints else None
        self._notify = notify
        self._on_death = on_death
        # A fresh interpreter (not multiprocessing's spawn, which imports the parent's
        # __main__ again), on a socket pair; exit codes as subprocess reports them.
        mine, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "everycycle.engine.host.child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=2,
                close_fds=True)  # (stdout: the daemon's stderr; `run`'s stdout is text only)
        self._conn = Connection(mine.detach())
        self.pid: int | None = self._proc.pid
        try:
            send_message(self._conn, (str(path), options))
        except OSError:
            pass  # it died at once: the first read says how
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._jids: dict[int, int] = {}  # id(job) -> its jid
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._progress = time.monotonic()
        """When the engine last moved: a step, an output, a call answered."""
        self._steps = -1
        self._hung: str | None = None
        """What it was doing when it was taken for hung (a step, a render)."""
        self.dead: str | None = None
        """Why the child is gone; None while it serves."""
        self.exit_cause: str | None = None
        """How it ended when it died unasked: ``SIGILL (illegal instruction)``, …"""
        first = self._first_message()
        self._reader = MessageReader(self._conn.fileno())
        """Reads what follows Ready (which ``Connection`` read: it reads no further)."""
        info = first.info
        self.pid = info.pid
        self.parallel = info.parallel
        self.n_ctx_slot = info.n_ctx_slot
        self.weights_bytes = info.weights_bytes
        self.kv_bytes = info.kv_bytes
        self.offloaded = info.offloaded
        self.lookup_exact = info.lookup_exact
        self.vocab_facts = info.vocab
        self.draft_counts: tuple[DraftCount, ...] = ()
        self.images_encoded = 0
        self.prompt_cache: CacheStats | None = None
        self.step_seconds: tuple[float, ...] = ()
        self._finished = threading.Event()
        """Set once the pipe closed and the child's end was handled (``_ended``)."""
        self._stop_reading: Callable[[], None] | None = None
        if readable is None:
            threading.Thread(target=self._read, name=f"engine {label}", daemon=True).start()
        else:
            threading.Thread(target=self._watchdog, name=f"engine {label} watch",
                             daemon=True).start()
            try:
                self._stop_reading = readable(self._conn.fileno(), self.pump)
            except BaseException:
                self._finished.set()
                self._kill()
                raise

    def _first_message(self) -> Ready:
        where = f" on RPC host {self.endpoint}" if self.endpoint else ""
        if not self._conn.poll(LOAD_TIMEOUT):
            self._kill()
            raise InternalError(f"loading {self.label}{where} took over {LOAD_TIMEOUT:g} s")
        try:
            first = receive_message(self._conn)
        except (EOFError, OSError):
            cause = signal_cause(self._wait())
            if self.endpoint:
                raise InternalError(f"RPC host {self.endpoint} went away while the model "
                                    f"loaded (its engine ended with {cause})") from None
            raise InternalError(f"engine for {self.label} died while loading: "
                                f"{cause}") from None
        if isinstance(first, LoadFailed):
            self._wait()
            raise first.error.exception()
        assert isinstance(first, Ready)
        return first

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.kill()
        self._wait()

    def _wait(self) -> int:
        """The child's exit code once it ended (negative: the signal); kills a child that
        lingers after closing its end."""
        try:
            return self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()

    # ------------------------------------------------------------------ the pipe

    def _send(self, message: object) -> None:
        with self._lock:
            if self.dead is not None:
                raise InternalError(self.dead)
            try:
                send_message(self._conn, message)
            except (OSError, ValueError):
                raise InternalError(self._gone_message()) from None

    def _gone_message(self) -> str:
        if self.endpoint:
            return f"RPC host {self.endpoint} went away"
        return f"engine for {self.label} is gone"

    def _read(self) -> None:
        """The reader thread: every message, until the pipe closes."""
        while True:
            try:
                if not self._conn.poll(HEARTBEAT_S):
                    self._watch()
                    continue
                if not all(self._handle(m) for m in self._reader.read()):
                    break
            except (EOFError, OSError):
                break
        self._ended()

    def pump(self) -> None:
        """Handle the messages that have come from the child (where ``readable`` calls
        it: the pipe is readable). When the pipe closes, reading stops and the end is
        handled on a thread of its own (it waits for the child to exit)."""
        try:
            if all(self._handle(m) for m in self._reader.read()):
                return
        except (EOFError, OSError):
            pass
        except Exception:  # a bug costs these messages, never the event loop
            log.exception("engine for %s: a message was not handled", self.label)
            return
        if self._stop_reading is not None:
            self._stop_reading()
            self._stop_reading = None
            threading.Thread(target=self._ended, name=f"engine {self.label} end",
                             daemon=True).start()

    def _watchdog(self) -> None:
        """With ``readable``: look for a hang every heartbeat, messages or none."""
        while not self._finished.wait(HEARTBEAT_S):
            self._watch()

    def _handle(self, message: object) -> bool:
        """One message from the child; False once it said it closed."""
        if isinstance(message, Heartbeat):
            self.prompt_cache, self.step_seconds = message.cache, message.step_seconds
            if message.steps != self._steps:
                self._steps, self._progress = message.steps, time.monotonic()
            else:
                self._watch()
            return True
        self._progress = time.monotonic()
        if isinstance(message, Outputs):
            self._deliver(message)
        elif isinstance(message, Returned):
            with self._lock:
                future = self._calls.pop(message.cid, None)
            if future is not None:
                if message.error is None:
                    future.set_result(message.value)
                else:
                    future.set_exception(message.error.exception())
        elif isinstance(message, Closed):
            return False
        return True

    def _deliver(self, message: Outputs) -> None:
        self.draft_counts = message.draft_counts
        self.images_encoded = message.images_encoded
        batch = []
        with self._lock:
            for o in message.items:
                job = self._jobs.get(o.jid)
                if job is None:
                    continue
                if o.finished:
                    del self._jobs[o.jid]
                    self._jids.pop(id(job), None)
                batch.append((job, o.unpacked(job)))
        if batch:
            self._notify(batch)

    def _watch(self) -> None:
        """Kill the child if it has had work in hand and no progress for ``hang_after``
        seconds (the pipe then closes, and ``_ended`` tells its requests)."""
        with self._lock:
            if (self._closing or self._hung is not None or self.hang_after <= 0
                    or not (self._jobs or self._calls)):
                return
            if time.monotonic() - self._progress < self.hang_after:
                return
            self._hung = "a render or call" if self._calls else "a step"
        log.error("engine for %s made no progress in %s for %g s: killing it", self.label,
                  self._hung, self.hang_after)
        with contextlib.suppress(OSError):
            self._proc.kill()
            # A stopped process dies of SIGKILL too; SIGCONT lets it go at once.
            self._proc.send_signal(signal.SIGCONT)

    def _work_arrives(self) -> None:
        """(Under the lock.) Work handed to an engine with none: its clock starts now."""
        if not (self._jobs or self._calls):
            self._progress = time.monotonic()

    def _ended(self) -> None:
        """The pipe closed: the child ended, asked or not. Fail what it still had."""
        code = self._wait()
        with self._lock:
            died = not self._closing
            if self.dead is None:
                if not died:
                    self.dead = "unloaded"
                elif self._hung is not None:
                    self.exit_cause = "hung"
                    self.dead = (f"engine for {self.label} hung: no progress in "
                                 f"{self._hung} for {self.hang_after:g} s; it was killed "
                                 "and is restarted")
                else:
                    self.exit_cause = signal_cause(code)
                    if code == -9:
                        self.exit_cause += ", perhaps the OOM killer"
                    if self.endpoint:
                        self.dead = (f"RPC host {self.endpoint} went away (its engine ended "
                                     f"with {self.exit_cause})")
                    else:
                        self.dead = f"engine for {self.label} died: {self.exit_cause}"
            jobs, self._jobs = self._jobs, {}
            self._jids.clear()
            calls, self._calls = self._calls, {}
        error = InternalError(self.dead)
        for future in calls.values():
            future.set_exception(error)
        if jobs:
            self._notify([(job, Output("", (), True, "error", error)) for job in jobs.values()])
        with contextlib.suppress(OSError):
            self._conn.close()
        self._finished.set()
        if died and self._on_death is not None:
            self._on_death(self)

    def _call(self, question: Question) -> Any:
        future: Future[Any] = Future()
        cid = next(self._ids)
        with self._lock:
            self._work_arrives()
            self._calls[cid] = future
        try:
            self._send(Call(cid, question))
        except InternalError:
            with self._lock:
                self._calls.pop(cid, None)
            raise
        return future.result()

    # ------------------------------------------------------------------ the Engine

    def submit(self, job: Job) -> None:
        jid = next(self._ids)
        with self._lock:
            self._work_arrives()
            self._jobs[jid] = job
            self._jids[id(job)] = jid
        try:
            self._send(SubmitJob(jid, job.spec))
        except InternalError:
            with self._lock:
                self._jobs.pop(jid, None)
                self._jids.pop(id(job), None)
            raise

    def cancel(self, job: Job, reason: str) -> None:
        with self._lock:
            jid = self._jids.get(id(job))
        if jid is not None:
            with contextlib.suppress(InternalError):
                self._send(CancelJob(jid, reason))

    def tokenize(self, prompt: str, fmt: Format | None = None) -> list[int]:
        result: list[int] = self._call(Tokenize(prompt, fmt))
        return result

    def tokens(self, texts: Sequence[str], *, add_special: bool = False,
               parse_special: bool = False) -> list[list[int]]:
        result: list[list[int]] = self._call(TokenizeTexts(tuple(texts), add_special,
                                                           parse_special))
        return result

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        result: list[bytes] = self._call(TokenPieces(tuple(ids)))
        return result

    def chat_prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None
                    = None, think: bool | None = None, as_prompt: bool = False
                    ) -> tuple[list[int], ChatPrompt]:
        result: tuple[list[int], ChatPrompt] = self._call(
            RenderChat(tuple(messages), tools, think, as_prompt))
        return result

    def rerank_tokens(self, query: str, documents: Sequence[str]) -> list[list[int]]:
        result: list[list[int]] = self._call(RerankTokens(query, tuple(documents)))
        return result

    def check_grammar(self, grammar: str) -> None:
        self._call(CheckGrammar(grammar))

    def drop_prompt_cache(self) -> int:
        freed: int = self._call(DropPromptCache())
        if self.prompt_cache is not None:  # (until its next heartbeat says)
            self.prompt_cache = self.prompt_cache._replace(ram_bytes=0, entries=0)
        return freed

    def rss(self) -> int | None:
        """The child's resident memory (Linux: /proc; elsewhere unknown)."""
        if self.dead is not None or self.pid is None:
            return None
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        with self._lock:
            self._closing = True
        with contextlib.suppress(InternalError):
            self._send(CloseEngine())
        if not self._finished.wait(CLOSE_TIMEOUT):  # the child does not answer: end it
            self._kill()
            self._finished.wait(5)
        with self._lock:
            if self.dead is None:
                self.dead = "unloaded"
