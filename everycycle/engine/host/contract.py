"""The engine contract: what the supervisor may ask of a loaded model, and the typed
messages that carry it to an engine process and back.

Two classes satisfy ``Engine``: ``Runner`` (llama.cpp in this process: inside an
engine process, and in embedded mode) and ``EngineProcess`` (the daemon's proxy for a
Runner in a child process of its own). The supervisor depends on this Protocol only.
Messages are NamedTuples, typed; a step's ``Outputs``, the per-token message, crosses as
plain tuples (``send_message``, ``MessageReader``).
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from multiprocessing.connection import Connection
from typing import Any, NamedTuple, Protocol

from ...chatfmt.chat import ChatPrompt
from ...chatfmt.infill import FimTokens
from ...errors import AllocationError, ErrorKind, EverycycleError
from ...protocol import Format, Message
from ..core.jobs import Job, JobSpec, Logprob, Output
from ..spec.proposer import DraftCount

Notify = Callable[[list[tuple[Job, Output]]], None]
"""Called on an engine's own thread with one step's outputs (must not block)."""


class CacheStats(NamedTuple):
    """What a model's prompt cache holds and has done (promptcache.py), for the fleet
    and /metrics."""

    ram_bytes: int
    entries: int
    hits: int
    evictions: int


class VocabFacts(NamedTuple):
    """What the daemon needs of a model's vocabulary without asking: its size, the BOS
    token tokenizing adds (None: none), its fill-in-the-middle tokens, and the tokens
    that end a generation."""

    n_vocab: int
    bos: int | None
    fim: FimTokens
    eog: tuple[int, ...] = ()


class Engine(Protocol):
    """A model resident on an executor, decoding for ``parallel`` slots."""

    parallel: int
    vocab_facts: VocabFacts
    n_ctx_slot: int
    """Tokens one slot holds."""
    weights_bytes: int
    kv_bytes: int
    offloaded: tuple[int, int] | None
    """(layers on the devices, layers + output head), as llama.cpp reported them."""
    dead: str | None
    """Why it can no longer serve (its process died, its RPC host went away); None while
    it serves."""
    pid: int | None
    """The engine process's id; None in-process."""
    exit_cause: str | None
    """How its process ended when it died unasked (``SIGILL (illegal instruction)``);
    None while it serves, after ``close``, and in-process."""

    @property
    def lookup_exact(self) -> bool:
        """Whether a multi-row batch gives each token the logits it gets alone."""
        ...

    @property
    def draft_counts(self) -> tuple[DraftCount, ...]:
        """Each speculative method's draft tokens verified so far, and those the model
        confirmed (``spec/methods.py`` lists the methods)."""
        ...

    @property
    def images_encoded(self) -> int:
        """Images its vision projector encoded."""
        ...

    @property
    def prompt_cache(self) -> CacheStats | None:
        """Its prompt cache's figures, as last reported (None: it keeps none)."""
        ...

    @property
    def step_seconds(self) -> tuple[float, ...]:
        """A decode step's seconds by its rows, 1 to ``parallel`` (index 0: one row),
        as last measured (the load probe's, then its own steps'); empty: not known."""
        ...

    def drop_prompt_cache(self) -> int:
        """Give back the RAM its prompt cache holds (to disk as far as it holds, the
        rest gone): another model's load needs it. The bytes given back."""
        ...

    def submit(self, job: Job) -> None:
        """Queue ``job``; outputs come through ``notify``. Raises InvalidRequestError
        when it cannot fit, InternalError when the engine is gone."""

    def cancel(self, job: Job, reason: str) -> None:
        """Ask ``job`` to stop; it ends ``cancelled`` within one decode step."""

    def tokenize(self, prompt: str, fmt: Format | None = None) -> list[int]: ...

    def tokens(self, texts: Sequence[str], *, add_special: bool = False,
               parse_special: bool = False) -> list[list[int]]:
        """Each text's tokens, as llama.cpp's tokenizer gives them: ``add_special``, BOS
        (and EOS) where the vocabulary adds them; ``parse_special``, control tokens'
        text read as those tokens. Raises InternalError once the model is unloaded."""
        ...

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's bytes (a control token's as its text). Raises InvalidRequestError
        for an id outside the vocabulary, InternalError once the model is unloaded."""
        ...

    def chat_prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None
                    = None, think: bool | None = None, as_prompt: bool = False
                    ) -> tuple[list[int], ChatPrompt]:
        """A conversation (and tools) through the model's chat template: its tokens, and
        what the output will hold (``as_prompt``: one plain prompt, sent as is where the
        model has no template). Raises InvalidRequestError when it cannot render."""

    def rerank_tokens(self, query: str, documents: Sequence[str]) -> list[list[int]]:
        """Each (query, document) pair's tokens, laid out for this reranker. Raises
        InvalidRequestError for a model that is not a reranker."""
        ...

    def check_grammar(self, grammar: str) -> None:
        """Compile ``grammar`` (llguidance's) for this model's vocabulary, off the decode
        loop, and keep it for the job that asked. Raises InvalidRequestError saying what
        is wrong."""

    def rss(self) -> int | None:
        """The engine process's resident memory in bytes (None: unknown, or in-process)."""

    def close(self) -> None:
        """Stop (running jobs end cancelled) and free everything. Idempotent."""


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """Everything an engine needs to load a model, picklable (it crosses to the child)."""

    context: int
    parallel: int
    executor: str = "cpu"
    """The ggml backend of the devices below ("cpu": no devices)."""
    device_indices: tuple[int, ...] = ()
    """Indices into the executor's GPU devices; empty on the CPU."""
    n_gpu_layers: int | None = 0
    tensor_split: tuple[float, ...] = ()
    n_threads: int | None = None
    kv_cache_type: str = "f16"
    extra_bufts: bool = True
    """Let llama.cpp use the CPU's extra buffer types (AMX, repacked weights)."""
    rpc_endpoints: tuple[str, ...] = ()
    """RPC servers to register first; the model goes on device ``device_indices[0]`` of
    the first."""
    mmproj: str | None = None
    """A vision projector GGUF to load beside the model (libmtmd): images in."""
    name: str = ""
    """The model's registry name, for messages (empty: the file's name)."""
    kv_cache_dir: str | None = None
    """Where its cached prefixes are saved at unload and restored from (kvdisk.py)."""
    kv_cache_disk: int = 0
    """The bytes they may take there, for all models (0: none are saved)."""
    kv_cache_ram: int = 0
    """The bytes of host RAM its prompt cache may hold (promptcache.py; 0: none)."""
    lora: tuple[str, ...] = ()
    """LoRA adapter GGUFs to load beside the model (lora.py), in its ``lora`` order."""
    draft: str | None = None
    """A draft model's GGUF to load beside it (draftmodel.py), and its name."""
    draft_name: str = ""
    draft_max: int = 3
    """llama-server's --spec-draft-n-max, --spec-draft-n-min, --draft-p-min."""
    draft_min: int = 0
    draft_p_min: float = 0.0
    mtp: bool = True
    """Load the GGUF's MTP layers, where it has them, to draft with (spec/mtp.py)."""


# ---------------------------------------------------------------------- the pipe


def send_message(conn: Connection, message: object) -> None:
    """``message`` on the pipe, pickled as is (Connection.send's ForkingPickler, a
    pickler object per message for handles this pipe never carries, cost a third of an
    engine's per-token Python time), but for a step's ``Outputs``, which go as plain
    tuples: pickling a NamedTuple names its class and calls its ``__getnewargs__`` for
    every one, ten times the cost of the tuple's contents. ``MessageReader`` unpacks it."""
    if type(message) is Outputs:
        items, drafts, *counts = message
        message = ([tuple(o) for o in items], [tuple(astuple(d)) for d in drafts], *counts)
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def receive_message(conn: Connection) -> Any:
    """The next message on the pipe (blocking). Raises EOFError once it closed."""
    return pickle.loads(conn.recv_bytes())


class MessageReader:
    """The daemon's end of an engine's pipe: ``read`` takes what has arrived in one
    system call and returns every whole message in it (Connection's framing: a 4-byte
    big-endian length, or -1 and an 8-byte one, then the pickle). Where
    ``Connection.recv_bytes`` reads each message's length and body apart, through a
    BytesIO, this is one read per wake-up, into one buffer, for all of a step's."""

    CHUNK = 1 << 16

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._chunk = bytearray(self.CHUNK)
        self._view = memoryview(self._chunk)
        self._pending = bytearray()

    def read(self) -> list[Any]:
        """The messages now whole (perhaps none: a long one arrives in parts); blocks
        until some bytes come. Raises EOFError once the pipe closed, OSError if it broke."""
        n = os.readv(self._fd, [self._chunk])
        if n == 0:
            raise EOFError
        buf = self._pending
        if not buf:
            buf = self._pending = bytearray(self._view[:n])
        else:
            buf += self._view[:n]
        out: list[Any] = []
        start, end = 0, len(buf)
        while end - start >= 4:
            (size,) = _LENGTH.unpack_from(buf, start)
            head = 4
            if size == -1:
                if end - start < 12:
                    break
                (size,) = _LONG_LENGTH.unpack_from(buf, start + 4)
                head = 12
            if end - start < head + size:
                break
            with memoryview(buf) as whole:
                out.append(_unpacked(pickle.loads(whole[start + head:start + head + size])))
            start += head + size
        del buf[:start]
        return out


_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")


def _unpacked(message: Any) -> Any:
    """An ``Outputs`` again from its plain tuples (``send_message``); any other message
    is a NamedTuple already."""
    if type(message) is tuple:
        items, drafts, *counts = message
        return Outputs([tuple.__new__(JobOutput, o) for o in items],
                       tuple(DraftCount(*d) for d in drafts), *counts)
    return message


class WireError(NamedTuple):
    kind: str
    message: str
    allocation: bool = False
    """An AllocationError (the load may retry on fewer GPU layers)."""

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        if isinstance(exc, EverycycleError):
            return cls(exc.kind.value, exc.message, isinstance(exc, AllocationError))
        return cls(ErrorKind.INTERNAL.value, f"{type(exc).__name__}: {exc}")

    def exception(self) -> EverycycleError:
        if self.allocation:
            return AllocationError(self.message)
        return EverycycleError(self.message, kind=ErrorKind(self.kind))


# Daemon -> engine process.

class SubmitJob(NamedTuple):
    jid: int
    spec: JobSpec
    """The job's spec, sent whole."""


class CancelJob(NamedTuple):
    jid: int
    reason: str


class Tokenize(NamedTuple):
    """``Engine.tokenize``: answered by the token ids."""

    prompt: str
    fmt: Format | None = None

    def answer(self, engine: Engine) -> list[int]:
        return engine.tokenize(self.prompt, self.fmt)


class TokenizeTexts(NamedTuple):
    """``Engine.tokens``: answered by each text's token ids."""

    texts: Sequence[str]
    add_special: bool = False
    parse_special: bool = False

    def answer(self, engine: Engine) -> list[list[int]]:
        return engine.tokens(self.texts, add_special=self.add_special,
                             parse_special=self.parse_special)


class TokenPieces(NamedTuple):
    """``Engine.pieces``: answered by each token's bytes."""

    ids: Sequence[int]

    def answer(self, engine: Engine) -> list[bytes]:
        return engine.pieces(self.ids)


class RenderChat(NamedTuple):
    """``Engine.chat_prompt``: answered by the tokens and the ChatPrompt."""

    messages: Sequence[Message]
    tools: Sequence[dict[str, Any]] | None = None
    think: bool | None = None
    as_prompt: bool = False

    def answer(self, engine: Engine) -> tuple[list[int], ChatPrompt]:
        return engine.chat_prompt(self.messages, self.tools, self.think, self.as_prompt)


class RerankTokens(NamedTuple):
    """``Engine.rerank_tokens``: answered by each pair's tokens."""

    query: str
    documents: Sequence[str]

    def answer(self, engine: Engine) -> list[list[int]]:
        return engine.rerank_tokens(self.query, self.documents)


class CheckGrammar(NamedTuple):
    """``Engine.check_grammar``: answered by None, or its error."""

    grammar: str

    def answer(self, engine: Engine) -> None:
        engine.check_grammar(self.grammar)


class DropPromptCache(NamedTuple):
    """``Engine.drop_prompt_cache``: answered by the bytes given back."""

    def answer(self, engine: Engine) -> int:
        return engine.drop_prompt_cache()


Question = (Tokenize | TokenizeTexts | TokenPieces | RenderChat | RerankTokens | CheckGrammar
            | DropPromptCache)
"""What a ``Call`` may ask: each answers itself from the child's Runner."""


class Call(NamedTuple):
    """A synchronous question to the engine process."""

    cid: int
    question: Question


class CloseEngine(NamedTuple):
    pass


# Engine process -> daemon.

class EngineInfo(NamedTuple):
    pid: int
    parallel: int
    n_ctx_slot: int
    weights_bytes: int
    kv_bytes: int
    offloaded: tuple[int, int] | None
    lookup_exact: bool
    vocab: VocabFacts


class Ready(NamedTuple):
    info: EngineInfo


class LoadFailed(NamedTuple):
    error: WireError


class JobOutput(NamedTuple):
    """One job's Output of a step, flat (a tuple pickles ten times faster than a
    dataclass: this is the per-token path), its error as a WireError, and the job's
    token counts so far. Made by ``of`` and read by ``unpacked``, nowhere else."""

    jid: int
    text: str
    ids: tuple[int, ...]
    finished: bool
    reason: str | None
    error: WireError | None
    embeddings: list[list[float]] | None
    logprobs: tuple[Logprob, ...] | None
    n_prompt: int
    n_reused: int
    n_generated: int
    progress: int | None = None
    n_parked: int = 0
    parked: bool | None = None
    n_thought: int = 0
    n_drafted: int = 0
    n_draft_accepted: int = 0

    @classmethod
    def of(cls, jid: int, job: Job, o: Output) -> JobOutput:
        return cls(jid, o.text, o.ids, o.finished, o.reason,
                   WireError.of(o.error) if o.error is not None else None, o.embeddings,
                   o.logprobs, job.n_prompt, job.n_reused, job.n_generated, o.progress,
                   job.n_parked, o.parked, job.n_thought, job.n_drafted,
                   job.n_draft_accepted)

    def unpacked(self, job: Job) -> Output:
        """The Output again, its counts set on ``job`` (the daemon's copy)."""
        job.n_prompt, job.n_reused, job.n_generated, job.n_parked, job.n_thought = (
            self.n_prompt, self.n_reused, self.n_generated, self.n_parked, self.n_thought)
        job.n_drafted, job.n_draft_accepted = self.n_drafted, self.n_draft_accepted
        return Output(self.text, self.ids, self.finished, self.reason,
                      self.error.exception() if self.error is not None else None,
                      self.embeddings, self.logprobs, self.progress, self.parked)


class Outputs(NamedTuple):
    items: list[JobOutput]
    draft_counts: tuple[DraftCount, ...] = ()
    images_encoded: int = 0


class Returned(NamedTuple):
    cid: int
    value: Any
    error: WireError | None


class Heartbeat(NamedTuple):
    """Sent every ``HEARTBEAT_S``: the decode loop's step count (a SIGSTOPped or wedged
    engine sends none, or the same count while it has work)."""

    steps: int
    cache: CacheStats | None = None
    """The prompt cache's figures now."""
    step_seconds: tuple[float, ...] = ()
    """``Engine.step_seconds`` now."""


HEARTBEAT_S = 1.0


class Closed(NamedTuple):
    pass

