"""The engine: a GGUF model resident on an executor, decoding for N slots on its own thread.

llama.cpp's low-level API through llama-cpp-python, with llama.cpp's own sampler
chain. One ``Runner`` owns one ``llama_model`` and ``llama_context`` and a worker
thread; every call into the context happens on that thread. Each step puts the
pending work of every active slot (prefill chunks and one token per decoding slot)
into one ``llama_batch``, runs one ``llama_decode``, samples each slot with its own
chain, and hands that step's outputs to ``notify`` in one call. Requests enter free
slots and leave between steps, so a cancel takes effect within one step. A slot
keeps its KV cells after a request ends; a new request sharing a prefix with them
only prefills the rest.

The engine knows nothing of sockets or event loops: ``notify`` is a plain callable.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EverycycleError, InternalError, InvalidRequestError
from ..protocol import Format, Message
from .lookup import History, PromptLookup, StepCost, expected_accepted
from .memory import kv_type_id

log = logging.getLogger(__name__)

_DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed
EMBED_MAX_TOKENS = 2048
"""The longest input an embedding request may hold, in tokens."""
_PENALTY_LAST_N = 64


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings; llama-server's defaults. ``temperature == 0`` is greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int | None = None
    grammar: str | None = None
    """A GBNF grammar (root rule ``root``) every output must follow."""


@dataclass(frozen=True, slots=True)
class Output:
    """What one step produced for one job: a chunk, and whether it ended the job."""

    text: str
    ids: tuple[int, ...]
    finished: bool = False
    reason: str | None = None
    """``eos``, ``length``, ``stop``, ``context``, ``embedded``, ``cancelled`` or ``error``
    when finished."""
    error: EverycycleError | None = None
    embeddings: list[list[float]] | None = None
    """An embedding job's vectors (reason ``embedded``)."""


@dataclass(eq=False)
class Job:
    """One generation: prompt tokens in, Outputs out through the runner's ``notify``."""

    tokens: Sequence[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: Sequence[str] = ()
    tag: Any = None
    """Opaque to the engine: whatever the caller uses to route outputs."""
    embed_inputs: Sequence[Sequence[int]] | None = None
    """Set for an embedding job: the token sequences to embed (no generation)."""
    lookup: bool = True
    """Prompt-lookup drafts, verified in the batch (greedy jobs without a grammar)."""
    # Filled in by the runner, read by callers once the job finished:
    n_prompt: int = 0
    n_reused: int = 0
    n_generated: int = 0
    _cancel_reason: str | None = None


@dataclass(eq=False)
class _Slot:
    seq: int
    cached: list[int] = field(default_factory=list)
    job: Job | None = None
    sampler: Any = None
    grammar: Any = None
    """Greedy decoding under a grammar: the grammar sampler, consulted lazily."""
    todo: list[int] = field(default_factory=list)
    n_past: int = 0
    last: int = -1
    decoder: Any = None
    held_text: str = ""
    held_ids: list[int] = field(default_factory=list)
    lookup: PromptLookup | None = None
    draft: list[int] = field(default_factory=list)
    """This step's draft, in batch rows ``draft_row`` on."""
    draft_row: int = 0


Notify = Callable[[list[tuple[Job, Output]]], None]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _stop_split(text: str, stops: Sequence[str]) -> tuple[int | None, int]:
    """(index of the first stop string in text or None, length of a held-back tail)."""
    first: int | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (first is None or i < first):
            first = i
    if first is not None:
        return first, 0
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return None, hold


class Runner:
    """A model loaded on an executor, with ``parallel`` slots and a decode thread.

    Construct it off the event loop (loading takes time). Raises InvalidRequestError
    for a file llama.cpp cannot load.
    """

    dead: str | None = None
    """Why it can no longer serve; always None here (a worker's IsolatedRunner can die)."""
    lookup_type: type[PromptLookup] = PromptLookup
    """What drafts tokens for greedy jobs (tests put an oracle here)."""

    def __init__(
        self,
        path: Path,
        *,
        context: int,
        parallel: int,
        notify: Notify,
        gpu_devices: Sequence[int] = (),
        n_gpu_layers: int | None = None,
        tensor_split: Sequence[float] = (),
        n_threads: int | None = None,
        n_batch: int = 512,
        kv_cache_type: str = "f16",
    ) -> None:
        import llama_cpp as L

        self._L = L
        self.path = path
        self.parallel = parallel
        self._notify = notify
        self._n_batch = n_batch
        _backend_init()
        mparams = L.llama_model_default_params()
        # Pin the model to the executor's devices: a NULL-terminated list (empty = CPU).
        self._devices = (ctypes.c_void_p * (len(gpu_devices) + 1))(*gpu_devices, None)
        mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p).value
        # The last n_gpu_layers layers go on the devices (n_layer + 1: the output head
        # too); the rest stay on the CPU.
        mparams.n_gpu_layers = (0 if not gpu_devices else 999 if n_gpu_layers is None
                                else n_gpu_layers)
        if tensor_split and len(gpu_devices) > 1:
            size = max(len(tensor_split), int(L.llama_max_devices()))
            self._split = (ctypes.c_float * size)(*tensor_split)
            mparams.tensor_split = ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))
        if not path.is_file():
            raise InvalidRequestError(f"{path} is not a file")
        with _log_capture() as loading:
            model = L.llama_model_load_from_file(str(path).encode(), mparams)
        self.offloaded = loading.offloaded
        """(layers on the devices, layers + output head), as llama.cpp reported them."""
        if not model:
            raise InvalidRequestError(f"llama.cpp could not load {path} (not a valid GGUF?)")
        self._model = model
        self._vocab = L.llama_model_get_vocab(model)
        self._n_vocab = L.llama_vocab_n_tokens(self._vocab)
        threads = n_threads or max(1, os.cpu_count() or 1)
        self._threads = threads
        self._embedder: Any = None
        self.lookup_drafted = 0
        """Prompt-lookup draft tokens proposed, and those the model confirmed."""
        self.lookup_accepted = 0
        self._cost = StepCost()
        """A step's time by row count: how long a draft pays (probed at load)."""
        self._history = History()
        """Recent finished sequences, for prompt-lookup drafts across requests."""
        cparams = L.llama_context_default_params()
        cparams.n_ctx = context * parallel
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = parallel
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.kv_unified = False
        # Sliding-window layers keep only their window (as llama-server does); prefix
        # reuse checks what the window still holds (_start).
        cparams.swa_full = False
        kv_type = kv_type_id(kv_cache_type)
        cparams.type_k = kv_type
        cparams.type_v = kv_type
        if kv_cache_type != "f16":  # a quantized V cache needs flash attention
            cparams.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
        with _log_capture() as reported:
            ctx = L.llama_init_from_model(model, cparams)
        self.kv_bytes = reported.kv_bytes
        """The KV cache's size as llama.cpp reports it when creating the context."""
        self.weights_bytes = int(L.llama_model_size(model))
        self._n_swa = int(L.llama_model_n_swa(model))
        if not ctx:
            L.llama_model_free(model)
            raise InternalError(f"llama.cpp could not create a context for {path}")
        self._ctx = ctx
        self._mem = L.llama_get_memory(ctx)
        self.n_ctx_slot = L.llama_n_ctx(ctx) // parallel
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        self._slots = [_Slot(seq=i) for i in range(parallel)]
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        # Guards the model against use from other threads (tokenize) while close() frees it.
        self._life = threading.Lock()
        self._freed = False
        # Reused by greedy decoding under a grammar (_grammar_greedy).
        self._all_candidates = np.zeros(self._n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"),
                                                              ("p", "<f4")])
        self._one_candidate = _OneCandidate(L)
        self._template_raw = False
        self._template = self._chat_template()
        self.lookup_exact = False
        """Whether this model, on this build and device, gives each token the same logits
        in a multi-row batch as alone: then prompt-lookup drafts change nothing but speed,
        and greedy jobs use them by default. (Probed on the engine thread at start.)"""
        probed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(probed,),
                                        name=f"engine:{path.name}", daemon=True)
        self._thread.start()
        probed.wait()

    # ------------------------------------------------------------------ any thread

    @property
    def has_chat_template(self) -> bool:
        """True when the GGUF carries a chat template llama.cpp can render."""
        return self._template is not None

    def tokenize(self, prompt: str, fmt: Format | None = None) -> list[int]:
        """Prompt to tokens: the chat template unless ``fmt`` is RAW or the model has none.

        Safe from any thread, also while the runner closes. Raises InternalError once
        the model is unloaded.
        """
        with self._life:
            self._check_alive()
            if fmt is not Format.RAW and self._template is not None:
                return self._tokenize(self._render_chat(((b"user", prompt),)), special=True)
            return self._tokenize(prompt, special=False)

    def tokenize_chat(self, messages: Sequence[Message]) -> list[int]:
        """A conversation to tokens through the model's chat template, ready for the
        assistant's turn. Raises InvalidRequestError when the model has no template
        llama.cpp can render, InternalError once the model is unloaded."""
        with self._life:
            self._check_alive()
            if self._template is None:
                why = ("has a chat template llama.cpp cannot render" if self._template_raw
                       else "has no chat template")
                raise InvalidRequestError(
                    f"{self.path.name} {why}: send a `prompt` with format raw instead of "
                    "`messages`"
                )
            turns = tuple((m.role.value.encode(), m.content) for m in messages)
            return self._tokenize(self._render_chat(turns), special=True)

    def _check_alive(self) -> None:
        if self._freed:
            raise InternalError("the model is unloaded")

    def _tokenize(self, text: str, *, special: bool) -> list[int]:
        L = self._L
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self._vocab, data, len(data), buf, n_max, True, special)
        if n < 0:
            buf = (L.llama_token * -n)()
            n = L.llama_tokenize(self._vocab, data, len(data), buf, -n, True, special)
        return list(buf[:n])

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` as the stream renders it (invalid UTF-8 replaced).

        Raises InternalError once the model is unloaded.
        """
        with self._life:
            self._check_alive()
            return b"".join(self._piece(t) for t in ids).decode("utf-8", "replace")

    def submit(self, job: Job) -> None:
        """Queue ``job``; it starts in the next free slot. Raises InvalidRequestError
        when the prompt does not fit the context."""
        if job.embed_inputs is not None:
            if any(not 0 < len(t) <= EMBED_MAX_TOKENS for t in job.embed_inputs):
                raise InvalidRequestError(
                    f"each input must be 1-{EMBED_MAX_TOKENS} tokens")
        elif not job.tokens:
            raise InvalidRequestError("the prompt is empty after tokenization")
        elif len(job.tokens) >= self.n_ctx_slot:
            raise InvalidRequestError(
                f"prompt is {len(job.tokens)} tokens; the context holds {self.n_ctx_slot}"
            )
        with self._cond:
            if self._closing:
                raise InternalError("the model is being unloaded")
            self._pending.append(job)
            self._cond.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Ask ``job`` to stop; it ends with ``reason`` within one decode step."""
        with self._cond:
            if job._cancel_reason is None:
                job._cancel_reason = reason
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread (active jobs end cancelled) and free llama.cpp state.

        Idempotent; waits for a tokenization in progress on another thread.
        """
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        with self._life:
            if self._freed:
                return
            self._freed = True
            L = self._L
            if self._embedder is not None:
                self._embedder.close()
            L.llama_batch_free(self._batch)
            L.llama_free(self._ctx)
            L.llama_model_free(self._model)

    # ------------------------------------------------------------------ helpers

    def _chat_template(self) -> bytes | None:
        """The GGUF's chat template if llama.cpp can render it (probed once)."""
        L = self._L
        tmpl = L.llama_model_chat_template(self._model, None)
        self._template_raw = bool(tmpl)
        if not tmpl:
            return None
        probe = self._apply(tmpl, ((b"user", "x"),))
        return tmpl if probe is not None else None

    def _apply(self, tmpl: bytes, turns: Sequence[tuple[bytes, str]]) -> str | None:
        L = self._L
        contents = [content.encode("utf-8") for _, content in turns]
        msgs = (L.llama_chat_message * len(turns))()
        for i, ((role, _), content) in enumerate(zip(turns, contents, strict=True)):
            msgs[i].role = role
            msgs[i].content = content
        size = 2 * sum(len(c) for c in contents) + 256 * len(turns) + 256
        buf = ctypes.create_string_buffer(size)
        n = L.llama_chat_apply_template(tmpl, msgs, len(turns), True, buf, size)
        if n < 0:
            return None
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = L.llama_chat_apply_template(tmpl, msgs, len(turns), True, buf, n)
        return buf.raw[:n].decode("utf-8", "replace")

    def _render_chat(self, turns: Sequence[tuple[bytes, str]]) -> str:
        assert self._template is not None
        out = self._apply(self._template, turns)
        if out is None:
            raise InvalidRequestError("the model's chat template cannot render this conversation")
        return out

    def _piece(self, token: int) -> bytes:
        L = self._L
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
        return buf.raw[:n]

    def _make_sampler(self, s: Sampling) -> Any:
        """llama.cpp's sampler chain for ``s``; None for plain greedy decoding.

        Plain greedy (temperature 0, no penalty) is an argmax over the logits, which is
        what llama.cpp's greedy sampler computes, without building a candidate array
        over the whole vocabulary (262k entries for Gemma) for every token.
        """
        L = self._L
        if s.temperature <= 0.0 and s.repeat_penalty == 1.0 and s.grammar is None:
            return None
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if s.grammar is not None:  # first: it masks what the grammar does not allow
            L.llama_sampler_chain_add(chain, self._grammar_sampler(s.grammar))
        if s.repeat_penalty != 1.0:
            L.llama_sampler_chain_add(
                chain,
                L.llama_sampler_init_penalties(
                    self._n_vocab, _PENALTY_LAST_N, s.repeat_penalty, 0.0, 0.0
                ),
            )
        if s.temperature <= 0.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if s.top_k > 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(s.top_k))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(s.top_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(s.min_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(s.temperature))
        seed = _DEFAULT_SEED if s.seed is None else s.seed
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
        return chain

    def _grammar_sampler(self, gbnf: str) -> Any:
        """llama.cpp's grammar sampler for ``gbnf`` (root rule ``root``).

        Raises InvalidRequestError with llama.cpp's own parse error, which says where.
        """
        with _log_capture() as captured, _stderr_text() as printed:
            sampler = self._L.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"),
                                                         b"root")
        if not sampler:
            # llama.cpp prints where the parse failed straight to stderr, then logs a
            # generic error; the first says where.
            where = [ln.strip() for ln in printed.text.splitlines() if "error" in ln]
            detail = "; ".join(where or captured.errors) or "llama.cpp could not parse it"
            raise InvalidRequestError(f"grammar: {detail}")
        return sampler

    def _grammar_greedy(self, grammar: Any, logits: np.ndarray, tok: int) -> int:
        """The argmax among the tokens ``grammar`` allows (``tok``, the plain argmax, when
        it allows that one), accepted into the grammar's state. Engine thread only."""
        L = self._L
        if not self._grammar_allows(grammar, tok):
            every = self._all_candidates
            every["id"] = np.arange(self._n_vocab, dtype=np.int32)
            every["logit"] = logits
            every["p"] = 0.0
            arr = L.llama_token_data_array(
                data=every.ctypes.data_as(ctypes.POINTER(L.llama_token_data)),
                size=self._n_vocab, selected=-1, sorted=False)
            L.llama_sampler_apply(grammar, ctypes.byref(arr))
            best = int(every["logit"].argmax())
            if not np.isfinite(every["logit"][best]):
                # Accepting a token the grammar refuses aborts the process: end the job.
                raise InvalidRequestError("the grammar allows no next token")
            tok = int(every["id"][best])
        L.llama_sampler_accept(grammar, tok)
        return tok

    def _grammar_allows(self, grammar: Any, tok: int) -> bool:
        """Whether ``grammar``, in its current state, allows ``tok`` next."""
        one = self._one_candidate
        one.data[0].id, one.data[0].logit, one.data[0].p = tok, 0.0, 0.0
        one.array.size, one.array.selected, one.array.sorted = 1, -1, False
        self._L.llama_sampler_apply(grammar, ctypes.byref(one.array))
        return bool(np.isfinite(one.data[0].logit))

    def check_grammar(self, gbnf: str) -> None:
        """Compile ``gbnf`` once to refuse a broken grammar before anything is queued.

        Safe from any thread. Raises InvalidRequestError saying where it is broken.
        """
        with self._life:
            self._check_alive()
            self._L.llama_sampler_free(self._grammar_sampler(gbnf))

    # ------------------------------------------------------------------ engine thread

    def _batch_is_exact(self) -> bool:
        """Decode a few tokens one at a time, then as one batch and as two (as drafts
        are verified), and compare the logits bit for bit. (Some llama.cpp kernels
        round differently for several rows than for one: gemma-3 Q4_K_M on ggml-cpu
        does.)"""
        L = self._L
        toks = self._tokenize("The quick brown fox jumps over the lazy dog again and again",
                              special=False)[:12]
        if len(toks) < 6 or self._n_batch < len(toks):
            return False
        prompt, tail = toks[:-4], toks[-4:]
        batch = self._batch

        timed: list[tuple[int, float]] = []

        def run(groups: list[list[int]]) -> list[np.ndarray]:
            L.llama_memory_seq_rm(self._mem, 0, -1, -1)
            pos = 0
            got: list[np.ndarray] = []
            for group in groups:
                for i, tok in enumerate(group):
                    self._put(batch, i, tok, pos + i, 0, True)
                batch.n_tokens = len(group)
                started = time.perf_counter()
                if L.llama_decode(self._ctx, batch) != 0:
                    raise InternalError("llama_decode failed while loading")
                timed.append((len(group), time.perf_counter() - started))
                got.extend(np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, i),
                                                 shape=(self._n_vocab,)).copy()
                           for i in range(len(group)))
                pos += len(group)
            return got[len(prompt) - 1:]

        try:
            alone = run([prompt] + [[t] for t in tail])
            together = run([prompt, tail])
            pairs = run([prompt, tail[:2], tail[2:]])
            if min(self._n_batch, self.n_ctx_slot) > 16:
                run([(toks * 3)[:16]])  # (timed only: a full draft's rows)
        except InternalError:
            return False
        finally:
            L.llama_memory_seq_rm(self._mem, 0, -1, -1)
        # The timings (every row with logits, as a draft's) seed the step cost by row
        # count: 1, 2, 4, 8 and 16 rows (kernels in blocks of rows make 16 cheaper than
        # a guess from 8 says: gemma-3's Q4_K on ggml-cpu). The first decode allocates.
        self._cost = StepCost.fit(timed[1:])
        return all(np.array_equal(a, b) and np.array_equal(a, c)
                   for a, b, c in zip(alone, together, pairs, strict=True))

    def _start(self, job: Job) -> None:
        """Put ``job`` in the free slot whose cached tokens share the longest prefix."""
        L = self._L
        free = [s for s in self._slots if s.job is None]
        slot = max(free, key=lambda s: _common_prefix(s.cached, job.tokens))
        reuse = _common_prefix(slot.cached, job.tokens)
        reuse = min(reuse, len(job.tokens) - 1)  # at least one token to get logits from
        if reuse > 0 and self._n_swa > 0:
            # A sliding-window layer has dropped the cells before its window: the
            # prefix can be reused only if the window before position `reuse` is all
            # still there (llama-server's rule), else the slot starts over.
            pos_min = L.llama_memory_seq_pos_min(self._mem, slot.seq)
            if pos_min > 0 and pos_min >= reuse - self._n_swa:
                reuse = 0
        L.llama_memory_seq_rm(self._mem, slot.seq, reuse if reuse else -1, -1)
        del slot.cached[reuse:]
        slot.job = job
        greedy = job.sampling.temperature <= 0.0 and job.sampling.repeat_penalty == 1.0
        if greedy and job.sampling.grammar is not None:
            # Greedy under a grammar, as llama-server does it: take the argmax, and mask
            # the whole vocabulary only when the grammar refuses that token.
            slot.grammar = self._grammar_sampler(job.sampling.grammar)
            slot.sampler = None
        else:
            slot.sampler = self._make_sampler(job.sampling)
        slot.lookup = (self.lookup_type(job.tokens, self._history)
                       if job.lookup and greedy and job.sampling.grammar is None else None)
        slot.draft = []
        slot.todo = list(job.tokens[reuse:])
        slot.n_past = reuse
        slot.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        slot.held_text, slot.held_ids = "", []
        job.n_prompt, job.n_reused, job.n_generated = len(job.tokens), reuse, 0

    def _finish(self, slot: _Slot, out: list[tuple[Job, Output]], reason: str,
                error: EverycycleError | None = None) -> None:
        job = slot.job
        assert job is not None
        text, ids = "", []
        if reason not in ("cancelled", "error"):
            if slot.lookup is not None:  # (a model with lookup off keeps no history)
                self._history.add(slot.cached, job.n_prompt)
            text = slot.held_text + slot.decoder.decode(b"", True)
            ids = slot.held_ids
            if reason != "stop" and job.stop:
                cut, _ = _stop_split(text, job.stop)
                if cut is not None:
                    text, reason = text[:cut], "stop"
        out.append((job, Output(text, tuple(ids), True, reason, error)))
        for sampler in (slot.sampler, slot.grammar):
            if sampler is not None:
                self._L.llama_sampler_free(sampler)
        slot.sampler = slot.grammar = None
        slot.job = None
        slot.todo = []
        if reason == "error":  # the KV cells may be half-written
            self._L.llama_memory_seq_rm(self._mem, slot.seq, -1, -1)
            slot.cached.clear()

    def _emit(self, slot: _Slot, token: int, out: list[tuple[Job, Output]]) -> bool:
        """Add a sampled token's text; True if a stop string ended the job."""
        job = slot.job
        assert job is not None
        slot.held_ids.append(token)
        slot.held_text += slot.decoder.decode(self._piece(token))
        if slot.decoder.getstate()[0]:
            return False  # a character is split across tokens: wait for the rest
        text = slot.held_text
        if job.stop:
            cut, hold = _stop_split(text, job.stop)
            if cut is not None:
                slot.held_text = text[:cut]
                return True
            if hold:
                return False
        # A token may render as no text (a control token): its chunk still carries the
        # id, so that every generated id reaches the client exactly once.
        out.append((job, Output(text, tuple(slot.held_ids))))
        slot.held_text, slot.held_ids = "", []
        return False

    def _run(self, probed: threading.Event) -> None:
        # Every llama_decode of this context runs on this thread, the load-time probe
        # too. OpenMP keeps a thread pool per calling thread: a decode on another thread
        # would leave a second pool, and with more OpenMP threads than cores libgomp
        # stops spinning at its barriers and sleeps at every one (SmolLM2 on 2 cores:
        # ~150 futex sleeps per token, 25% slower).
        try:
            self.lookup_exact = self._batch_is_exact()
        except Exception:
            log.exception("probing batched decoding failed for %s", self.path)
        finally:
            probed.set()
        try:
            self._loop()
        except BaseException as exc:  # the thread must report, never vanish silently
            log.exception("engine thread for %s failed", self.path)
            err = InternalError(f"engine failed: {exc}")
            with self._cond:
                self._closing = True
                jobs = [s.job for s in self._slots if s.job] + list(self._pending)
                self._pending.clear()
            self._safe_notify([(j, Output("", (), True, "error", err)) for j in jobs])

    def _safe_notify(self, outputs: list[tuple[Job, Output]]) -> None:
        if not outputs:
            return
        try:
            self._notify(outputs)
        except Exception:
            log.exception("notify failed; %d outputs dropped", len(outputs))

    def _loop(self) -> None:
        L = self._L
        batch = self._batch
        while True:
            out: list[tuple[Job, Output]] = []
            with self._cond:
                while not (self._closing or self._pending or any(s.job for s in self._slots)):
                    self._cond.wait()
                if self._closing:
                    for s in self._slots:
                        if s.job is not None:
                            self._finish(s, out, "cancelled")
                    for job in self._pending:
                        out.append((job, Output("", (), True, "cancelled")))
                    self._pending.clear()
                    self._safe_notify(out)
                    return
                for s in self._slots:
                    if s.job is not None and s.job._cancel_reason is not None:
                        self._finish(s, out, "cancelled")
                kept: deque[Job] = deque()
                embeds: list[Job] = []
                for job in self._pending:
                    if job._cancel_reason is not None:
                        out.append((job, Output("", (), True, "cancelled")))
                    elif job.embed_inputs is not None:
                        embeds.append(job)  # needs no slot: its own context
                    else:
                        kept.append(job)
                self._pending = kept
                while self._pending and any(s.job is None for s in self._slots):
                    self._start(self._pending.popleft())
            if embeds:
                self._embed(embeds, out)
            # Build one batch: a token per decoding slot first, then prefill chunks.
            n = 0
            rows: list[tuple[_Slot, int]] = []  # slots whose logits come from batch row i
            active = [s for s in self._slots if s.job is not None]
            for s in active:
                if not s.todo:
                    self._put(batch, n, s.last, s.n_past, s.seq, True)
                    s.cached.append(s.last)
                    s.n_past += 1
                    rows.append((s, n))
                    n += 1
            expected = float(len(rows))  # the tokens this step should yield
            for s, _ in rows:  # prompt-lookup drafts after every slot has its row
                if s.lookup is None:
                    continue
                assert s.job is not None
                room = min(self._n_batch - n, self.n_ctx_slot - s.n_past,
                           s.job.max_tokens - s.job.n_generated - 1)
                s.draft = s.lookup.propose(room, partial(self._cost.draft_len, n, expected))
                s.draft_row = n
                if s.draft:
                    expected += expected_accepted(s.lookup.rate, len(s.draft))
                for tok in s.draft:
                    self._put(batch, n, tok, s.n_past, s.seq, True)
                    s.cached.append(tok)
                    s.n_past += 1
                    n += 1
            prefill = False
            for s in active:
                if not s.todo or n >= self._n_batch:
                    continue
                prefill = True
                take = s.todo[: self._n_batch - n]
                del s.todo[: len(take)]
                for j, tok in enumerate(take):
                    last = not s.todo and j == len(take) - 1
                    self._put(batch, n, tok, s.n_past, s.seq, last)
                    s.cached.append(tok)
                    s.n_past += 1
                    if last:
                        rows.append((s, n))
                    n += 1
            if n == 0:
                self._safe_notify(out)
                continue
            batch.n_tokens = n
            started = time.perf_counter()
            rc = L.llama_decode(self._ctx, batch)
            if rc == 0 and not prefill:
                self._cost.observe(n, time.perf_counter() - started)
            if rc != 0:
                err = InternalError(f"llama_decode returned {rc}")
                for s in active:
                    self._finish(s, out, "error", err)
                self._safe_notify(out)
                continue
            for s, row in rows:
                running = s.job
                assert running is not None
                if s.draft:
                    self._verify(s, row, out)
                    continue
                if s.sampler is None:
                    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, row),
                                                   shape=(self._n_vocab,))
                    tok = int(logits.argmax())
                    if s.grammar is not None:
                        try:
                            tok = self._grammar_greedy(s.grammar, logits, tok)
                        except InvalidRequestError as exc:
                            self._finish(s, out, "error", exc)
                            continue
                else:
                    tok = L.llama_sampler_sample(s.sampler, self._ctx, row)
                self._take(s, tok, s.n_past, out)
            self._safe_notify(out)

    def _take(self, s: _Slot, tok: int, n_past: int, out: list[tuple[Job, Output]]) -> bool:
        """Handle one generated token, sampled with ``n_past`` tokens in the slot's cache;
        True if it ended the job."""
        running = s.job
        assert running is not None
        if self._L.llama_vocab_is_eog(self._vocab, tok):
            self._finish(s, out, "eos")
            return True
        running.n_generated += 1
        s.last = tok
        if s.lookup is not None:
            s.lookup.append(tok)
        if self._emit(s, tok, out):
            self._finish(s, out, "stop")
        elif running.n_generated >= running.max_tokens:
            self._finish(s, out, "length")
        elif n_past + 1 >= self.n_ctx_slot:
            self._finish(s, out, "context")
        else:
            return False
        return True

    def _verify(self, s: _Slot, row: int, out: list[tuple[Job, Output]]) -> None:
        """Check a slot's draft against the model's own greedy choices (its own row
        ``row``, then the draft's rows); keep the longest agreeing prefix and drop the
        rest of the draft from the KV cache. The tokens taken are exactly those
        one-at-a-time greedy decoding would have produced."""
        L = self._L
        draft = s.draft
        s.draft = []
        k = len(draft)
        start = s.n_past - k - 1  # the position of the slot's own row (its last token)
        taken: list[int] = []
        for i in range(k + 1):
            at = row if i == 0 else s.draft_row + i - 1
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, at),
                                           shape=(self._n_vocab,))
            tok = int(logits.argmax())
            taken.append(tok)
            if i == k or tok != draft[i]:
                break
        accepted = len(taken) - 1  # draft tokens confirmed
        if accepted < k:
            L.llama_memory_seq_rm(self._mem, s.seq, start + 1 + accepted, -1)
            del s.cached[len(s.cached) - (k - accepted):]
            s.n_past = start + 1 + accepted
        assert s.lookup is not None
        s.lookup.verified(k, accepted)
        self.lookup_drafted += k
        self.lookup_accepted += accepted
        for i, tok in enumerate(taken):
            if self._take(s, tok, start + 1 + i, out):
                return

    def _embed(self, jobs: list[Job], out: list[tuple[Job, Output]]) -> None:
        """Embed every input of ``jobs`` in shared batches (on the engine thread)."""
        from .embedder import Embedder

        try:
            if self._embedder is None:
                self._embedder = Embedder(self._L, self._model, n_threads=self._threads,
                                          n_batch=EMBED_MAX_TOKENS)
            inputs = [tokens for job in jobs for tokens in job.embed_inputs or ()]
            vectors = self._embedder.embed(
                inputs, cancelled=lambda: any(j._cancel_reason for j in jobs))
        except EverycycleError as exc:
            out.extend((job, Output("", (), True, "error", exc)) for job in jobs)
            return
        if vectors is None:
            out.extend((job, Output("", (), True, "cancelled")) for job in jobs)
            return
        i = 0
        for job in jobs:
            n = len(job.embed_inputs or ())
            out.append((job, Output("", (), True, "embedded", embeddings=vectors[i:i + n])))
            i += n

    @staticmethod
    def _put(batch: Any, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits


_backend_lock = threading.Lock()
_backend_state: dict[str, Any] = {}


class _OneCandidate:
    """A one-token llama_token_data_array, to ask a grammar about one token."""

    def __init__(self, L: Any) -> None:
        self.data = (L.llama_token_data * 1)()
        self.array = L.llama_token_data_array(data=self.data, size=1, selected=-1,
                                              sorted=False)


@dataclass
class _Captured:
    kv_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    offloaded: tuple[int, int] | None = None
    """(layers on devices, layers) as llama.cpp reports loading a model (the output
    head counts as a layer there)."""


_KV_SIZE = re.compile(rb"^llama_kv_cache: size = +([0-9.]+) MiB")
_OFFLOADED = re.compile(rb"offloaded (\d+)/(\d+) layers to GPU")
_capture_lock = threading.Lock()
_capturing: list[_Captured] = []


@contextlib.contextmanager
def _log_capture() -> Iterator[_Captured]:
    """Collect what llama.cpp reports while a call runs: the KV cache it allocates and
    its error lines (a grammar's parse error). One capture at a time, process-wide."""
    captured = _Captured()
    with _capture_lock:
        _capturing.append(captured)
        try:
            yield captured
        finally:
            _capturing.clear()


@dataclass
class _Printed:
    text: str = ""


@contextlib.contextmanager
def _stderr_text() -> Iterator[_Printed]:
    """What C code writes to fd 2 meanwhile, kept off the user's terminal. Only around
    short calls, under the capture lock."""
    import tempfile

    printed = _Printed()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield printed
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            printed.text = sink.read().decode("utf-8", "replace")


def _quiet_log(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's log, routed to ``logging`` (it must never reach stdout)."""
    if text and _capturing:
        if level == 2:  # GGML_LOG_LEVEL_INFO
            m = _KV_SIZE.match(text)
            if m:
                _capturing[0].kv_bytes += int(float(m.group(1)) * (1 << 20))
            m = _OFFLOADED.search(text)
            if m:
                _capturing[0].offloaded = (int(m.group(1)), int(m.group(2)))
        elif level == 4:  # GGML_LOG_LEVEL_ERROR
            _capturing[0].errors.append(text.decode("utf-8", "replace").strip())
    if level == 4 and text:  # GGML_LOG_LEVEL_ERROR
        log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())
    elif level == 3 and text:  # GGML_LOG_LEVEL_WARN: model quirks, not the user's concern
        log.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


def _backend_init() -> None:
    """Once per process: route llama.cpp's log and initialise its backends."""
    with _backend_lock:
        if _backend_state:
            return
        import llama_cpp as L

        callback = L.llama_log_callback(_quiet_log)
        _backend_state["log"] = callback  # keep the ctypes callback alive
        L.llama_log_set(callback, ctypes.c_void_p(0))
        L.llama_backend_init()
