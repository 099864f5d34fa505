"""A Runner's slots: a ``Slot`` is a sequence in the KV cache and the tokens its cells
hold; a ``Run`` is the job on it and everything kept for that job (its position, the
prompt left to read, samplers, matcher, drafter, and the text it owes the client: whole
UTF-8 characters, stop strings held back). Parking a job takes its ``Run`` away whole."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from .features import Feature
from .jobs import Job, Logprob, common_prefix, stop_split
from .matcher import Matcher

SamplerChain = NewType("SamplerChain", object)
"""A llama.cpp sampler chain (``llama_sampler *``), made and freed by the worker's
``Samplers``."""


def _utf8() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


@dataclass(eq=False)
class Run:
    """A job on a slot, and all the slot keeps for it."""

    job: Job
    n_past: int = 0
    """Positions of the slot's sequence written for this job."""
    todo: list[int] = field(default_factory=list)
    """Prompt tokens left to read."""
    last: int = -1
    """The last token taken: the next decode row's."""
    sampler: SamplerChain | None = None
    """Its llama.cpp sampler chain (None: plain greedy)."""
    grammar: Matcher | None = None
    """Under a constraint: the job's matcher (``constraint.py``)."""
    drafting: dict[str, Any] = field(default_factory=dict)
    """Each speculative method's state for this run, by the method's name (only the
    methods that draft for it: ``spec/drafter.py``)."""
    prompt: object = None
    """A job with images: its libmtmd prompt, once read (the worker's ``vision.Prompt``,
    opaque here)."""
    features: list[Feature] = field(default_factory=list)
    """Its request's features that act token by token (a reasoning budget)."""
    forced: list[int] = field(default_factory=list)
    """Tokens it takes next whatever the model says (a feature's: a thinking budget's
    ending)."""
    decoder: codecs.IncrementalDecoder = field(default_factory=_utf8)
    held_text: str = ""
    held_ids: list[int] = field(default_factory=list)
    held_logprobs: list[Logprob] = field(default_factory=list)
    """With a job that asked for them: one per held id."""
    t_gen: float = 0.0
    """When its first token came (time.monotonic)."""
    new_line: bool = False
    """Whether its answer has a line break yet."""
    indent: int | None = 0
    """The indentation of its answer's line so far, while that line is only indentation
    (None once it has more)."""

    def ends_block(self, text: str, n_indent: int) -> bool:
        """Whether ``text``, next in the answer, begins a line indented less than
        ``n_indent`` after a line break (llama-server's ``n_indent``: a code completion
        ends where its block does). Follows the answer's lines either way."""
        for ch in text:
            if ch == "\n":
                self.new_line, self.indent = True, 0
            elif self.indent is not None:
                if ch in " \t":
                    self.indent += 1
                else:
                    if self.new_line and self.indent < n_indent:
                        return True
                    self.indent = None
        return False

    def take_logprobs(self) -> tuple[Logprob, ...] | None:
        """The held ids' log-probabilities (None when the job asked for none)."""
        if not self.held_logprobs:
            return None
        out, self.held_logprobs = tuple(self.held_logprobs), []
        return out

    def add_text(self, token: int, piece: bytes, stops: Sequence[str]
                 ) -> tuple[str, list[int]] | bool:
        """Add a sampled token and its bytes. Returns the chunk to send now (text, ids),
        True when a stop string ended the job, or False when the text is held back (a
        character split across tokens, or what may be the start of a stop string)."""
        self.held_ids.append(token)
        self.held_text += self.decoder.decode(piece)
        if self.decoder.getstate()[0]:
            return False  # a character is split across tokens: wait for the rest
        text = self.held_text
        if stops:
            cut, hold = stop_split(text, stops)
            if cut is not None:
                self.held_text = text[:cut]
                return True
            if hold:
                return False
        # A token may render as no text (a control token): its chunk still carries the
        # id, so that every generated id reaches the client exactly once.
        chunk = (text, self.held_ids)
        self.held_text, self.held_ids = "", []
        return chunk

    def final_text(self, reason: str, stops: Sequence[str]
                   ) -> tuple[str, list[int], str]:
        """What is held back, at the end: (text, ids, reason); a stop string found in
        the flushed text cuts it there and makes the reason ``stop``."""
        text = self.held_text + self.decoder.decode(b"", True)
        if reason != "stop" and stops:
            cut, _ = stop_split(text, stops)
            if cut is not None:
                text, reason = text[:cut], "stop"
        return text, self.held_ids, reason


@dataclass(eq=False)
class Slot:
    """One sequence of the KV cache: the tokens its cells hold, and its job, if any."""

    seq: int
    cached: list[int] = field(default_factory=list)
    run: Run | None = None
    used: int = 0
    """When a job last started here (the engine's step count then)."""
    lora: tuple[float, ...] = ()
    """The LoRA scales its cells were computed with (``lora.cells``; (): the base model)."""
    parked: Parked | None = None
    """The parked job whose KV cells this free slot still holds."""

    @property
    def job(self) -> Job | None:
        return self.run.job if self.run is not None else None


def best_slot(free: Sequence[Slot], tokens: Sequence[int], lora: tuple[float, ...] = ()
              ) -> tuple[Slot, int]:
    """The free slot whose cached tokens share the longest prefix with ``tokens``,
    computed with the same LoRA scales (``lora``, as ``lora.cells`` keys them; on a tie an
    empty one, else the least recently used: the conversation least likely to come back
    is the one given up), and how many of them it can reuse (at least one token is left
    to get logits from)."""
    def shared(s: Slot) -> int:
        return common_prefix(s.cached, tokens) if s.lora == lora else 0

    slot = max(free, key=lambda s: (shared(s), not s.cached, -s.used))
    return slot, min(shared(slot), len(tokens) - 1)


@dataclass(eq=False)
class Parked:
    """A job off its slot, and everything the slot kept for it."""

    run: Run
    slot: Slot | None
    """The slot whose KV cells are still this job's (None: they were copied out)."""
    cached: list[int]
    """The tokens of its cells."""
    state: Any = None
    """The cells, copied out once another job took the slot (None: not copied)."""
    since: float = 0.0
    """When it was parked (``time.monotonic()``)."""

    @property
    def job(self) -> Job:
        return self.run.job


def parkable(slot: Slot) -> bool:
    """Whether ``slot`` runs a job that gives way to an interactive one: a background
    job, text only (an image's cells are libmtmd's to lay out)."""
    job = slot.job
    return (job is not None and job.background and not job.spec.images
            and job.cancel_reason is None)


Scales = tuple[float, ...]
"""One scale per adapter of the model, in its ``lora`` order (all zero: the base model)."""


def adapted(scales: Scales) -> bool:
    """Whether ``scales`` change the model at all (else its cells are the base model's)."""
    return any(s != 0.0 for s in scales)


def cells(scales: Scales) -> Scales:
    """What KV cells computed under ``scales`` are keyed by: the scales, or () for the
    base model's (however its zero scales are spelled)."""
    return scales if adapted(scales) else ()
