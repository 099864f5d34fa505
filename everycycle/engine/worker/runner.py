"""The engine: a GGUF model resident on an executor, decoding for N slots on its own thread.

llama.cpp's low-level API through llama-cpp-python, with llama.cpp's own sampler
chain. One ``Runner`` owns one ``llama_model`` and ``llama_context`` and the thread
every call into the context happens on. It builds the engine from parts, each with its
own state and explicit inputs:

- ``Scheduler`` (scheduler.py): each step's decisions as plain data (plan.py) — which
  jobs start, park, resume; which rows the one ``llama_decode`` holds;
- ``Drafter`` (spec/drafter.py): asks each speculative method (spec/methods.py) for a
  slot's draft, and counts what they came to;
- ``BatchDecoder`` (batchdecode.py): decodes a plan, stoppable (``Preempt``), timed;
- ``Seating`` (seating.py): jobs on and off slots with their KV cells (prompt cache,
  parking, images);
- ``StepLoop`` (steps.py): the thread's loop, admit → plan → run → apply.

The Runner satisfies the ``Engine`` contract (contract.py): the daemon runs one inside
an engine process of its own (process.py); embedded mode runs one in its own process.
The engine knows nothing of sockets or event loops: ``notify`` is a plain callable.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ... import paths
from ...chatfmt.chat import ChatFormat, ChatPrompt, flat
from ...errors import EverycycleError, InternalError, InvalidRequestError
from ...hardware import cpukernels
from ...protocol import Format, Message, Role
from ..core.jobs import EMBED_MAX_TOKENS, Job, Output
from ..core.scheduler import Scheduler
from ..core.slots import Slot
from ..core.stepcost import Costs, StepCost
from ..host.contract import CacheStats, LoadOptions, Notify, VocabFacts
from ..kvcache import kvdisk, promptcache
from ..llama.llamaload import create_context, devices_for, load_model
from ..llama.logits import RowLogits
from ..llama.probes import batch_probe
from ..llama.vocab import Vocab
from ..spec.drafter import Drafter
from ..spec.draftmodel import DraftLimits, DraftModel
from ..spec.lookup import History, PromptLookup
from ..spec.methods import proposers
from ..spec.mtp import MtpHeads, mtp_layers
from ..spec.proposer import DraftCount
from .batchdecode import BatchDecoder
from .constraint import Constraints
from .lora import Adapters
from .preempt import Preempt
from .rerank import Pairs
from .sampling import Samplers
from .seating import Outputs, Seating
from .steps import Inbox, StepLoop
from .vision import Vision

log = logging.getLogger(__name__)

__all__ = ["EMBED_MAX_TOKENS", "Job", "Output", "Runner"]


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
    drafter_type: type[Drafter] = Drafter
    """What proposes drafts (tests put one that proposes none here)."""

    @classmethod
    def load(cls, path: Path, options: LoadOptions, notify: Notify) -> Runner:
        """A Runner for ``options``: RPC servers registered, devices looked up here."""
        return cls(path, context=options.context, parallel=options.parallel, notify=notify,
                   gpu_devices=devices_for(options.executor, options.device_indices,
                                           options.rpc_endpoints),
                   n_gpu_layers=options.n_gpu_layers,
                   tensor_split=options.tensor_split, n_threads=options.n_threads,
                   kv_cache_type=options.kv_cache_type, extra_bufts=options.extra_bufts,
                   mmproj=Path(options.mmproj) if options.mmproj else None,
                   label=options.name or None, kv_disk=(
                       Path(options.kv_cache_dir) if options.kv_cache_dir else None,
                       options.kv_cache_disk), kv_ram=options.kv_cache_ram,
                   lora=tuple(Path(p) for p in options.lora),
                   draft=Path(options.draft) if options.draft else None,
                   draft_label=options.draft_name, draft_limits=DraftLimits(
                       options.draft_max, options.draft_min, options.draft_p_min),
                   mtp=options.mtp)

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
        n_batch: int = 2048,
        kv_cache_type: str = "f16",
        extra_bufts: bool | None = None,
        mmproj: Path | None = None,
        label: str | None = None,
        kv_disk: tuple[Path | None, int] = (None, 0),
        kv_ram: int = 0,
        lora: Sequence[Path] = (),
        draft: Path | None = None,
        draft_label: str = "",
        draft_limits: DraftLimits | None = None,
        mtp: bool = True,
    ) -> None:
        import llama_cpp as L

        self.label = label or path.name
        """The model in messages: its registry name, else its file's."""

        if extra_bufts is None:  # as the engine loads: where the probe showed they run
            extra_bufts = cpukernels.decide(paths.state_dir()).extra

        self._L = L
        self.path = path
        self.parallel = parallel
        self._n_batch = n_batch
        # A GGUF with MTP layers drafts for itself (spec/mtp.py), text only.
        mtp = mtp and mmproj is None and path.is_file() and mtp_layers(path) > 0
        self._weights = load_model(L, path, gpu_devices=list(gpu_devices),
                                   n_gpu_layers=n_gpu_layers, tensor_split=list(tensor_split),
                                   extra_bufts=extra_bufts, load_mtp=mtp)
        model = self._weights.model
        # A draft's rejected rows are taken back out of the KV cache: a recurrent or
        # hybrid model's state (Mamba, Qwen3-Next) cannot be, so nothing drafts there.
        self.can_draft = not (L.llama_model_is_recurrent(model) or L.llama_model_is_hybrid(model))
        mtp = mtp and self.can_draft
        self.offloaded = self._weights.offloaded
        """(layers on the devices, layers + output head), as llama.cpp reported them."""
        self._model = model
        self.vocab = Vocab(L, model)
        self.vocab_facts = VocabFacts(self.vocab.n_vocab, self.vocab.bos, self.vocab.fim(),
                                      self.vocab.eog_tokens())
        self._pairs = Pairs(L, model, self.vocab)
        self._n_vocab = self.vocab.n_vocab
        self._samplers = Samplers(L, self.vocab.handle, self._n_vocab,
                                  self.vocab_facts.eog)
        self._constraints = Constraints(L, self.vocab.handle, self._n_vocab)
        threads = n_threads or max(1, os.cpu_count() or 1)
        self._threads = threads
        self._embedder: Any = None
        self.costs = Costs()
        """What steps cost here: how long a draft pays, how long a step should take."""
        history = History()
        """Recent finished sequences, for prompt-lookup drafts across requests."""
        ctx, self.kv_bytes = create_context(L, self._weights, path, context=context,
                                            parallel=parallel, n_batch=n_batch,
                                            threads=threads, kv_cache_type=kv_cache_type)
        """The KV cache's size as llama.cpp reports it when creating the context."""
        self.weights_bytes = int(L.llama_model_size(model))
        self._vision: Vision | None = None
        adapters: Adapters | None = None
        drafts: DraftModel | None = None
        heads: MtpHeads | None = None
        try:
            if mtp:
                import llama_cpp.llama_cpp_ext as X

                heads = MtpHeads(L, X, self._weights, ctx, path, context=context,
                                 parallel=parallel, n_batch=n_batch, threads=threads,
                                 kv_cache_type=kv_cache_type,
                                 limits=draft_limits or DraftLimits())
            if mmproj is not None:
                self._vision = Vision(model, mmproj, n_threads=threads,
                                      use_gpu=bool(gpu_devices))
            if lora:
                adapters = Adapters(L, model, lora, self.label)
            if draft is not None:
                offloaded = self.offloaded
                drafts = DraftModel(
                    L, draft, model, label=draft_label or draft.name, target_label=self.label,
                    parallel=parallel, n_ctx_slot=L.llama_n_ctx(ctx) // parallel,
                    n_batch=n_batch, threads=threads, gpu_devices=gpu_devices,
                    # (all on the GPU beside a target all there; else on the CPU)
                    n_gpu_layers=None if offloaded and offloaded[0] >= offloaded[1] else 0,
                    extra_bufts=extra_bufts, kv_cache_type=kv_cache_type,
                    limits=draft_limits or DraftLimits())
        except BaseException:
            if self._vision is not None:
                self._vision.close()
            if heads is not None:
                heads.close()
            L.llama_free(ctx)
            L.llama_model_free(model)
            raise
        self.draft_model = drafts
        """Its draft model (None: none): its weights and KV cache count as the model's."""
        self.mtp = heads
        """Its MTP heads' context (None: it has none, or they are off)."""
        if heads is not None:
            self.kv_bytes += heads.kv_bytes
        if drafts is not None:
            self.weights_bytes += drafts.weights_bytes
            self.kv_bytes += drafts.kv_bytes
        self.adapters = adapters
        """Its LoRA adapters (None: none)."""
        self._n_swa = int(L.llama_model_n_swa(model))
        self._ctx = ctx
        self._mem = L.llama_get_memory(ctx)
        self.n_ctx_slot = L.llama_n_ctx(ctx) // parallel
        cache_dir, limit = kv_disk
        # (not keyed by the context: a state restores into any context that holds it,
        # so a model loaded again with more keeps its saved prefixes)
        disk = (kvdisk.KVDisk(cache_dir, kvdisk.store_key(
            path, kv_cache_type, *cpukernels.build_identity()), limit)
            if cache_dir is not None and limit > 0 else None)
        cache = self._cache = (promptcache.PromptCache(kv_ram, disk)
                               if (disk is not None or kv_ram > 0) and mmproj is None
                               and self._n_swa == 0 else None)
        """Conversations the slots gave up (RAM) or held at close (disk), restored by
        prompts that extend them."""
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        plain = (self._n_swa == 0 and not L.llama_model_is_recurrent(model)
                 and not L.llama_model_is_hybrid(model)
                 and os.environ.get("EVERYCYCLE_PREEMPT") != "0")  # (bench/priority.py's A/B)
        self._inbox = Inbox()
        self._cond = self._inbox.cond
        preempt = Preempt(L, ctx, self._cond) if plain else None
        """Stops a background step for an arriving interactive job (None: never)."""
        self._drafter = self.drafter_type(self.costs, proposers(
            self.costs, history=history, lookup=lambda: self.lookup_type, draft_model=drafts,
            mtp=heads) if self.can_draft else [], self.label)
        self._seating = Seating(
            L, ctx, self._mem, samplers=self._samplers, constraints=self._constraints,
            cache=cache, vision=self._vision, drafter=self._drafter,
            tokenize=partial(self.vocab.tokenize, special=True), n_ctx_slot=self.n_ctx_slot,
            n_swa=self._n_swa, n_batch=n_batch)
        self.loop = StepLoop(
            L=L, ctx=ctx, vocab=self.vocab, logits=RowLogits(L, ctx, self._n_vocab),
            samplers=self._samplers, slots=[Slot(seq=i) for i in range(parallel)],
            inbox=self._inbox, drafter=self._drafter, costs=self.costs,
            scheduler=Scheduler(n_batch=n_batch, n_ctx_slot=self.n_ctx_slot,
                                parallel=parallel, costs=self.costs, drafter=self._drafter),
            batches=BatchDecoder(L, ctx, self._mem, self._batch, self.costs, preempt, adapters),
            seating=self._seating, notify=notify, n_ctx_slot=self.n_ctx_slot,
            probe=self._probe, embed=self._embed, label=self.label)
        # Guards the model against use from other threads (tokenize) while close() frees it.
        self._life = threading.Lock()
        self._freed = False
        self._chat_format: ChatFormat | None = None
        probed = threading.Event()
        self._thread = threading.Thread(target=self.loop.serve, args=(probed,),
                                        name=f"engine:{path.name}", daemon=True)
        self._thread.start()
        probed.wait()

    # ------------------------------------------------------------------ engine thread

    def _probe(self) -> tuple[bool, StepCost]:
        """Whether batches are bit-exact here, and a step's time by rows, measured."""
        toks = self.vocab.tokenize(
            "The quick brown fox jumps over the lazy dog again and again", special=False)
        probed = batch_probe(self._L, self._ctx, self._mem, self._batch,
                             n_vocab=self._n_vocab, n_batch=self._n_batch,
                             n_ctx_slot=self.n_ctx_slot, toks=toks)
        if self.draft_model is not None:
            self.draft_model.probe()
        if self.mtp is not None:
            try:
                self.mtp.probe()
            except EverycycleError as exc:
                log.error("%s: its MTP heads draft nothing: %s", self.label, exc.message)
        return probed

    def _embed(self, jobs: list[Job], out: Outputs, progressed: Callable[[], None]) -> None:
        """Embed every input of ``jobs`` in shared batches, in a context of their own."""
        from .embedder import Embedder

        try:
            if self._embedder is None:
                self._embedder = Embedder(self._L, self._model, n_threads=self._threads,
                                          n_batch=EMBED_MAX_TOKENS)
        except EverycycleError as exc:
            out.extend((job, Output("", (), True, "error", exc)) for job in jobs)
            return
        self._embedder.run(jobs, out, progress=progressed)

    # ------------------------------------------------------------------ any thread

    @property
    def steps(self) -> int:
        """Steps the engine has made (progress, for the daemon's hung-engine watch)."""
        return self.loop.steps

    @property
    def step_seconds(self) -> tuple[float, ...]:
        return self.loop.step_seconds

    @property
    def lookup_exact(self) -> bool:
        """Whether this model, on this build and device, gives each token the same logits
        in a multi-row batch as alone: then prompt-lookup drafts change nothing but speed,
        and greedy jobs use them by default. (Probed on the engine thread at start.)"""
        return self.loop.lookup_exact

    @property
    def draft_counts(self) -> tuple[DraftCount, ...]:
        """Each speculative method's draft tokens verified and confirmed so far."""
        return self._drafter.counts()

    @property
    def prompt_cache(self) -> CacheStats | None:
        """Its prompt cache's figures now (None: it keeps none)."""
        return self._cache.stats if self._cache is not None else None

    @property
    def images_encoded(self) -> int:
        """Images the projector encoded (an image whose cells a slot still holds is not
        encoded again)."""
        return self._vision.images_encoded if self._vision is not None else 0

    @property
    def has_chat_template(self) -> bool:
        """True when the GGUF carries a chat template."""
        return self.vocab.template_source is not None

    def tokenize(self, prompt: str, fmt: Format | None = None) -> list[int]:
        """Prompt to tokens: as the user's one turn through the chat template, unless
        ``fmt`` is RAW or the model has no template (then as is).

        Safe from any thread, also while the runner closes. Raises InternalError once
        the model is unloaded.
        """
        if fmt is Format.RAW:
            with self._life:
                self._check_alive()
                return self.vocab.tokenize(prompt, special=False)
        return self.chat_prompt((Message(Role.USER, prompt),), as_prompt=True)[0]

    def tokens(self, texts: Sequence[str], *, add_special: bool = False,
               parse_special: bool = False) -> list[list[int]]:
        """Each text's tokens (``Engine.tokens``). Safe from any thread."""
        with self._life:
            self._check_alive()
            return [self.vocab.tokenize(t, special=parse_special, add_special=add_special)
                    for t in texts]

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's bytes, a control token's as its text (``Engine.pieces``). Raises
        InvalidRequestError for an id outside the vocabulary."""
        with self._life:
            self._check_alive()
            n_vocab = self.vocab.n_vocab
            for t in ids:
                if not 0 <= t < n_vocab:
                    raise InvalidRequestError(f"token {t} is not in this model's vocabulary "
                                              f"of {n_vocab}")
            return [self.vocab.piece(t, special=True) for t in ids]

    def rerank_tokens(self, query: str, documents: Sequence[str]) -> list[list[int]]:
        """Each (query, document) pair's tokens, laid out for this reranker. Raises
        InvalidRequestError for a model that is not one, InternalError once unloaded."""
        with self._life:
            self._check_alive()
            self._pairs.check(self.label)
            return [self._pairs.tokens(query, doc) for doc in documents]

    def chat_prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None
                    = None, think: bool | None = None, as_prompt: bool = False
                    ) -> tuple[list[int], ChatPrompt]:
        """A conversation (and tools) through the model's chat template, ready for the
        assistant's turn: its tokens, and what the output will hold. ``as_prompt``: the
        one message is a plain prompt, sent as is to a model without a template. Raises
        InvalidRequestError when the template refuses it, InternalError once the model
        is unloaded."""
        if as_prompt and self.vocab.template_source is None:
            with self._life:
                self._check_alive()
                text = flat(messages[0])
                return self.vocab.tokenize(text, special=False), ChatPrompt(text)
        prompt = self._chat().render(messages, tools=tools, think=think)
        with self._life:
            self._check_alive()
            return self.vocab.tokenize(prompt.text, special=True), prompt

    @property
    def chat_renderer(self) -> str:
        """``jinja``, ``llama.cpp`` or ``chatml`` (no template): how chats are rendered."""
        return self._chat().renderer

    def _chat(self) -> ChatFormat:
        with self._life:
            if self._chat_format is None:
                vocab = self.vocab
                self._chat_format = ChatFormat(
                    vocab.template_source, bos=vocab.special_text("bos"),
                    eos=vocab.special_text("eos"), strip_bos=vocab.add_bos,
                    llama_render=vocab.render_chat if vocab.template is not None else None,
                    n_ctx=self.n_ctx_slot, label=self.label)
                if vocab.template_source is None:
                    log.info("%s has no chat template: chats are rendered as ChatML",
                             self.path.name)
            return self._chat_format

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

    def drop_prompt_cache(self) -> int:
        return self._cache.drop_ram() if self._cache is not None else 0

    def check_grammar(self, grammar: str) -> None:
        """Compile ``grammar`` (llguidance's) for this vocabulary to refuse a broken one
        before anything is queued; the job that asked gets it.

        Safe from any thread. Raises InvalidRequestError saying what is wrong.
        """
        with self._life:
            self._check_alive()
            self._constraints.check(grammar)

    def rss(self) -> int | None:
        return None

    def submit(self, job: Job) -> None:
        """Queue ``job``; it starts in the next free slot. Raises InvalidRequestError
        when the prompt does not fit the context."""
        job.spec.check_fits(self.n_ctx_slot)
        self._samplers.check(job.spec.sampling)
        n_adapters = len(self.adapters.paths) if self.adapters is not None else 0
        if len(job.spec.lora) > n_adapters and any(job.spec.lora[n_adapters:]):
            raise InvalidRequestError(f"model '{self.label}' has {n_adapters} LoRA "
                                      f"adapter{'' if n_adapters == 1 else 's'}")
        with self._cond:
            if self._inbox.closing:
                raise InternalError("the model is being unloaded")
            self._inbox.pending.append(job)
            preempt = self.loop.batches.preempt
            if preempt is not None and not job.background:
                preempt.interrupt()
            self._cond.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Ask ``job`` to stop; it ends with ``reason`` within one decode step."""
        with self._cond:
            if job.cancel_reason is None:
                job.cancel_reason = reason
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread (active jobs end cancelled) and free llama.cpp state.

        Idempotent; waits for a tokenization in progress on another thread.
        """
        with self._cond:
            self._inbox.closing = True
            self._cond.notify()
        self._thread.join()
        with self._life:
            if self._freed:
                return
            self._freed = True
            L = self._L
            if self._embedder is not None:
                self._embedder.close()
            if self._vision is not None:
                self._vision.close()
            self._constraints.close()
            if self._cache is not None:  # (on the engine thread's behalf: it has ended)
                self._cache.spill([(slot.cached, partial(
                    promptcache.copy_state, L, self._ctx, slot.seq)) for slot in self.loop.slots])
            if self.draft_model is not None:
                self.draft_model.close()
            if self.mtp is not None:
                self.mtp.close()
            L.llama_batch_free(self._batch)
            L.llama_free(self._ctx)
            L.llama_model_free(self._model)
