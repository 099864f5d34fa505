"""What one engine step does, as plain data: the scheduler decides it (``scheduler.py``),
the batch decoder decodes it (``batchdecode.py``), and the step applies its results to the
slots (``steps.py``).

A step has two parts. ``Move``s seat jobs on slots: start a pending job, park a
background job for an interactive one, resume a parked job. A ``StepPlan`` is the one
``llama_decode``: for each slot that works in it, the tokens it puts in the batch, their
rows and positions, and which row's logits choose its next token. Nothing here calls
llama.cpp, and nothing changes a slot until the step has run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .jobs import Job
from .slots import Parked, Run, Slot


@dataclass(frozen=True)
class Draft:
    """A slot's draft for one step: its tokens, the chance each is right given the ones
    before it were, and the method that proposed it (a proposer's ``name``); ``final``:
    no other method is asked after this one."""

    tokens: list[int]
    rate: float = 0.0
    source: str = ""
    final: bool = False


NO_DRAFT = Draft([])


@dataclass(eq=False)
class Work:
    """One slot's rows in a step: ``tokens[i]`` goes in batch row ``rows[i]`` at position
    ``start + i`` of the slot's sequence."""

    slot: Slot
    run: Run
    start: int
    """The run's position before the step (``run.n_past``)."""
    tokens: list[int]
    rows: list[int]
    prompt: int = 0
    """How many of ``tokens`` are prompt tokens read from ``run.todo`` (0: a decode)."""
    draft: int = 0
    """A decode's draft: the last ``draft`` tokens, after the run's own last token."""
    source: str = ""
    """The method that proposed the draft (``Draft.source``)."""
    sample: int | None = None
    """The row whose logits choose the next token (None: the prompt is still read)."""

    @property
    def decode(self) -> bool:
        return self.prompt == 0

    def logits(self, i: int) -> bool:
        """Whether ``tokens[i]``'s row gets logits: every row of a decode (its draft is
        verified row by row), the last of a prompt read through."""
        return self.decode or (self.sample is not None and i == len(self.tokens) - 1)

    def commit(self, accepted: int | None = None) -> int | None:
        """The step ran: the slot's cells hold its tokens, a decode's draft only as far
        as its first ``accepted`` tokens were confirmed (None: all of them). The one
        place a step changes what a slot holds. Returns the position from which the
        slot's KV cells must go (a rejected draft's), or None."""
        run = self.run
        kept = self.tokens if accepted is None else self.tokens[:1 + accepted]
        run.n_past = self.start + len(kept)
        self.slot.cached.extend(kept)
        if self.prompt:
            del run.todo[:self.prompt]
        return run.n_past if len(kept) < len(self.tokens) else None


@dataclass(eq=False)
class StepPlan:
    """One ``llama_decode``: decoding slots' rows first, drafts next, prompt chunks last."""

    work: list[Work] = field(default_factory=list)
    n: int = 0
    """Batch rows in all."""
    lora: tuple[float, ...] = ()
    """The LoRA scales of every job in it (``lora.cells``): the context applies them."""

    def settle(self) -> None:
        """Lay out the batch rows from the work's tokens: each decoding slot's own row
        first, then their drafts, then prompt chunks (a prompt read through samples from
        its last row)."""
        n = 0
        decodes = [w for w in self.work if w.decode]
        for w in decodes:
            w.rows = [n]
            w.sample = n
            n += 1
        for w in decodes:
            w.rows.extend(range(n, n + len(w.tokens) - 1))
            n += len(w.tokens) - 1
        for w in self.work:
            if not w.decode:
                w.rows = list(range(n, n + len(w.tokens)))
                n += len(w.tokens)
                if w.sample is not None:
                    w.sample = n - 1
        self.n = n

    @property
    def filling(self) -> bool:
        """Whether it reads prompt tokens (a step priced by ``Costs.fill``)."""
        return any(w.prompt for w in self.work)

    @property
    def background(self) -> bool:
        """Whether every job in it is a background one (a step ``Preempt`` may stop)."""
        return bool(self.work) and all(w.run.job.background for w in self.work)


@dataclass(frozen=True, eq=False)
class Start:
    """Start pending ``job`` on free ``slot``."""

    job: Job
    slot: Slot


@dataclass(frozen=True, eq=False)
class Park:
    """Take ``slot``'s background job off it, for an interactive job."""

    slot: Slot


@dataclass(frozen=True, eq=False)
class Resume:
    """Put ``parked`` back on free ``slot``."""

    parked: Parked
    slot: Slot


Move = Start | Park | Resume
