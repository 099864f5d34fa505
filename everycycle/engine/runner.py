"""The engine: a GGUF model resident on an executor, decoding for N slots on its own thread.

llama.cpp's low-level API through llama-cpp-python, with llama.cpp's own sampler
chain. One ``Runner`` owns one ``llama_model`` and ``llama_context`` and a worker
thread; every call into the context happens on that thread. Each step admits pending
jobs into free slots (``_admit``), puts the pending work of every active slot —
prefill chunks, one token per decoding slot, prompt-lookup drafts — into one
``llama_batch`` (``_build``), runs one ``llama_decode``, samples each slot with its
own chain (``_sample``), and hands that step's outputs to ``notify`` in one call.
Requests leave between steps, so a cancel takes effect within one step. A slot keeps
its KV cells after a request ends; a new request sharing a prefix with them only
prefills the rest.

The Runner satisfies the ``Engine`` contract (contract.py): the daemon runs one inside
an engine process of its own (process.py); embedded mode runs one in its own process.
The engine knows nothing of sockets or event loops: ``notify`` is a plain callable.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EverycycleError, InternalError, InvalidRequestError
from ..protocol import Format, Message
from .contract import LoadOptions, Notify
from .jobs import EMBED_MAX_TOKENS, Job, Output, common_prefix, stop_split
from .llamalog import backend_init, log_capture
from .lookup import History, PromptLookup, StepCost, expected_accepted
from .memory import kv_type_id
from .probes import batch_probe, put
from .sampling import Samplers
from .vocab import Vocab

log = logging.getLogger(__name__)

__all__ = ["EMBED_MAX_TOKENS", "Job", "Output", "Runner"]


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


class Runner:
    """A model loaded on an executor, with ``parallel`` slots and a decode thread.

    Construct it off the event loop (loading takes time). Raises InvalidRequestError
    for a file llama.cpp cannot load.
    """

    dead: str | None = None
    """Why it can no longer serve; always None in-process."""
    pid: int | None = None
    exit_cause: str | None = None
    lookup_type: type[PromptLookup] = PromptLookup
    """What drafts tokens for greedy jobs (tests put an oracle here)."""

    @classmethod
    def load(cls, path: Path, options: LoadOptions, notify: Notify) -> Runner:
        """A Runner for ``options``: RPC servers registered, devices looked up here."""
        from . import executors as ex

        backend_init()
        devices: list[int] = []
        if options.rpc_endpoints:
            from . import rpc

            for i, endpoint in enumerate(options.rpc_endpoints):
                handles = rpc.register(endpoint)
                if i == 0:
                    devices = [handles[options.device_indices[0]]]
        elif options.device_indices:
            devices = ex.device_handles(options.executor, options.device_indices)
        return cls(path, context=options.context, parallel=options.parallel, notify=notify,
                   gpu_devices=devices, n_gpu_layers=options.n_gpu_layers,
                   tensor_split=options.tensor_split, n_threads=options.n_threads,
                   kv_cache_type=options.kv_cache_type, extra_bufts=options.extra_bufts)

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
        extra_bufts: bool = True,
    ) -> None:
        import llama_cpp as L

        self._L = L
        self.path = path
        self.parallel = parallel
        self._notify = notify
        self._n_batch = n_batch
        backend_init()
        mparams = L.llama_model_default_params()
        # Pin the model to the executor's devices: a NULL-terminated list (empty = CPU).
        self._devices = (ctypes.c_void_p * (len(gpu_devices) + 1))(*gpu_devices, None)
        mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p).value
        # The last n_gpu_layers layers go on the devices (n_layer + 1: the output head
        # too); the rest stay on the CPU.
        mparams.n_gpu_layers = (0 if not gpu_devices else 999 if n_gpu_layers is None
                                else n_gpu_layers)
        # The CPU's extra buffer types (AMX, repacked weights): only where a child
        # process showed they run on this CPU (cpukernels.py).
        mparams.use_extra_bufts = extra_bufts
        if tensor_split and len(gpu_devices) > 1:
            size = max(len(tensor_split), int(L.llama_max_devices()))
            self._split = (ctypes.c_float * size)(*tensor_split)
            mparams.tensor_split = ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))
        if not path.is_file():
            raise InvalidRequestError(f"{path} is not a file")
        with log_capture() as loading:
            model = L.llama_model_load_from_file(str(path).encode(), mparams)
        self.offloaded = loading.offloaded
        """(layers on the devices, layers + output head), as llama.cpp reported them."""
        if not model:
            raise InvalidRequestError(f"llama.cpp could not load {path} (not a valid GGUF?)")
        self._model = model
        self.vocab = Vocab(L, model)
        self._n_vocab = self.vocab.n_vocab
        self._samplers = Samplers(L, self.vocab.handle, self._n_vocab)
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
        with log_capture() as reported:
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
        return self.vocab.template is not None

    def tokenize(self, prompt: str, fmt: Format | None = None) -> list[int]:
        """Prompt to tokens: the chat template unless ``fmt`` is RAW or the model has none.

        Safe from any thread, also while the runner closes. Raises InternalError once
        the model is unloaded.
        """
        with self._life:
            self._check_alive()
            if fmt is not Format.RAW and self.vocab.template is not None:
                return self.vocab.tokenize(self.vocab.render_chat(((b"user", prompt),)),
                                           special=True)
            return self.vocab.tokenize(prompt, special=False)

    def tokenize_chat(self, messages: Sequence[Message]) -> list[int]:
        """A conversation to tokens through the model's chat template, ready for the
        assistant's turn. Raises InvalidRequestError when the model has no template
        llama.cpp can render, InternalError once the model is unloaded."""
        with self._life:
            self._check_alive()
            if self.vocab.template is None:
                why = ("has a chat template llama.cpp cannot render" if self.vocab.template_raw
                       else "has no chat template")
                raise InvalidRequestError(
                    f"{self.path.name} {why}: send a `prompt` with format raw instead of "
                    "`messages`"
                )
            turns = tuple((m.role.value.encode(), m.content) for m in messages)
            return self.vocab.tokenize(self.vocab.render_chat(turns), special=True)

    def _check_alive(self) -> None:
        if self._freed:
            raise InternalError("the model is unloaded")

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` as the stream renders it (invalid UTF-8 replaced).

        Raises InternalError once the model is unloaded.
        """
        with self._life:
            self._check_alive()
            return b"".join(self.vocab.piece(t) for t in ids).decode("utf-8", "replace")

    def check_grammar(self, gbnf: str) -> None:
        """Compile ``gbnf`` once to refuse a broken grammar before anything is queued.

        Safe from any thread. Raises InvalidRequestError saying where it is broken.
        """
        with self._life:
            self._check_alive()
            self._samplers.check(gbnf)

    def rss(self) -> int | None:
        return None

    def submit(self, job: Job) -> None:
        """Queue ``job``; it starts in the next free slot. Raises InvalidRequestError
        when the prompt does not fit the context."""
        job.check_fits(self.n_ctx_slot)
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
            self._samplers.close()
            L.llama_batch_free(self._batch)
            L.llama_free(self._ctx)
            L.llama_model_free(self._model)

    # ------------------------------------------------------------------ engine thread

    def _run(self, probed: threading.Event) -> None:
        # Every llama_decode of this context runs on this thread, the load-time probe
        # too. OpenMP keeps a thread pool per calling thread: a decode on another thread
        # would leave a second pool, and with more OpenMP threads than cores libgomp
        # stops spinning at its barriers and sleeps at every one (SmolLM2 on 2 cores:
        # ~150 futex sleeps per token, 25% slower).
        try:
            self.lookup_exact = self._probe()
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

    def _probe(self) -> bool:
        """Whether batches are bit-exact here; times steps by row count meanwhile."""
        toks = self.vocab.tokenize(
            "The quick brown fox jumps over the lazy dog again and again", special=False)
        exact, self._cost = batch_probe(
            self._L, self._ctx, self._mem, self._batch, n_vocab=self._n_vocab,
            n_batch=self._n_batch, n_ctx_slot=self.n_ctx_slot, toks=toks)
        return exact

    def _safe_notify(self, outputs: list[tuple[Job, Output]]) -> None:
        if not outputs:
            return
        try:
            self._notify(outputs)
        except Exception:
            log.exception("notify failed; %d outputs dropped", len(outputs))

    def _loop(self) -> None:
        while True:
            out: list[tuple[Job, Output]] = []
            embeds = self._admit(out)
            if embeds is None:  # closing
                self._safe_notify(out)
                return
            if embeds:
                self._embed(embeds, out)
            active = [s for s in self._slots if s.job is not None]
            n, rows, prefill = self._build(active)
            if n == 0:
                self._safe_notify(out)
                continue
            self._batch.n_tokens = n
            started = time.perf_counter()
            rc = self._L.llama_decode(self._ctx, self._batch)
            if rc != 0:
                err = InternalError(f"llama_decode returned {rc}")
                for s in active:
                    self._finish(s, out, "error", err)
                self._safe_notify(out)
                continue
            if not prefill:
                self._cost.observe(n, time.perf_counter() - started)
            self._sample(rows, out)
            self._safe_notify(out)

    def _admit(self, out: list[tuple[Job, Output]]) -> list[Job] | None:
        """Wait for work; end cancelled jobs; start pending jobs in free slots. Returns
        the embedding jobs to run this step, or None when the runner is closing."""
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
                return None
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
            return embeds

    def _build(self, active: list[_Slot]) -> tuple[int, list[tuple[_Slot, int]], bool]:
        """Fill the batch: a token per decoding slot first, then drafts, then prefill
        chunks. Returns (rows, the slots whose logits come from which row, whether any
        prefill is in it)."""
        batch = self._batch
        n = 0
        rows: list[tuple[_Slot, int]] = []
        for s in active:
            if not s.todo:
                put(batch, n, s.last, s.n_past, s.seq, True)
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
                put(batch, n, tok, s.n_past, s.seq, True)
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
                put(batch, n, tok, s.n_past, s.seq, last)
                s.cached.append(tok)
                s.n_past += 1
                if last:
                    rows.append((s, n))
                n += 1
        return n, rows, prefill

    def _sample(self, rows: list[tuple[_Slot, int]], out: list[tuple[Job, Output]]) -> None:
        """Each slot's next token from its row (or its draft verified)."""
        L = self._L
        for s, row in rows:
            assert s.job is not None
            if s.draft:
                self._verify(s, row, out)
                continue
            if s.sampler is None:
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, row),
                                               shape=(self._n_vocab,))
                tok = int(logits.argmax())
                if s.grammar is not None:
                    try:
                        tok = self._samplers.grammar_greedy(s.grammar, logits, tok)
                    except InvalidRequestError as exc:
                        self._finish(s, out, "error", exc)
                        continue
            elif s.grammar is not None:
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, row),
                                               shape=(self._n_vocab,))
                try:
                    tok = self._samplers.sample_constrained(s.sampler, s.grammar, logits)
                except InvalidRequestError as exc:
                    self._finish(s, out, "error", exc)
                    continue
            else:
                tok = L.llama_sampler_sample(s.sampler, self._ctx, row)
            self._take(s, tok, s.n_past, out)

    def _start(self, job: Job) -> None:
        """Put ``job`` in the free slot whose cached tokens share the longest prefix."""
        L = self._L
        free = [s for s in self._slots if s.job is None]
        slot = max(free, key=lambda s: common_prefix(s.cached, job.tokens))
        reuse = common_prefix(slot.cached, job.tokens)
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
        # Under a grammar, as llama-server does it: the argmax (or a sample), and the
        # whole vocabulary masked only when the grammar refuses that token.
        slot.grammar = (self._samplers.grammar(job.sampling.grammar)
                        if job.sampling.grammar is not None else None)
        slot.sampler = self._samplers.chain(job.sampling)  # (None: plain greedy)
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
                cut, _ = stop_split(text, job.stop)
                if cut is not None:
                    text, reason = text[:cut], "stop"
        out.append((job, Output(text, tuple(ids), True, reason, error)))
        for sampler in (slot.sampler, slot.grammar):
            self._samplers.free(sampler)
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
        slot.held_text += slot.decoder.decode(self.vocab.piece(token))
        if slot.decoder.getstate()[0]:
            return False  # a character is split across tokens: wait for the rest
        text = slot.held_text
        if job.stop:
            cut, hold = stop_split(text, job.stop)
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

    def _take(self, s: _Slot, tok: int, n_past: int, out: list[tuple[Job, Output]]) -> bool:
        """Handle one generated token, sampled with ``n_past`` tokens in the slot's cache;
        True if it ended the job."""
        running = s.job
        assert running is not None
        if self.vocab.is_eog(tok):
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
