"""What decode steps cost on this machine, as measured: a step's time by its rows
(``StepCost``), the micro-batches llama.cpp splits a step of several sequences into
(``ubatches``), and the length of draft that pays for its rows (``draft_len``). One
holder (``Costs``) every part of the engine reads. No llama.cpp here.

Measured, never assumed: on a GPU a step costs about the same for 1 row or 30; on a CPU
each row costs nearly as much as a one-row step, and some kernels work in blocks of rows
(gemma-3's Q4_K on ggml-cpu: 4 rows cost less than 3).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

N_UBATCH = 512
"""Rows of a llama.cpp micro-batch (llama-server's ``-ub`` default): what one graph
computes at once, so what the compute buffers are sized for. A step (``n_batch``: 2,048,
llama-server's ``-b``) may hold several: prompts arriving together are read in one step
and start together."""

Shape = Sequence[tuple[int, int]]
"""A decode step's rows by sequence: (sequence id, rows), in the batch's order."""


def ubatches(shape: Shape) -> list[int]:
    """The rows of each llama.cpp micro-batch a decode step of ``shape`` is split into.

    Each slot's sequence has its own KV stream (a context of non-unified cells), so
    llama.cpp splits a batch as ``split_equal(sequential=True)`` does: a micro-batch
    takes sequences of consecutive ids (the first unread one in batch order, then the
    next id up, and so on) and as many rows from each as the shortest of them has left.
    A slot drafting 3 tokens among 8 decoding slots makes two micro-batches (8 rows,
    then its 3): on a CPU each reads the weights again, nearly a step's time."""
    left = dict(shape)
    order = list(left)
    out: list[int] = []
    while order:
        chain = [order[0]]
        for seq in order[1:]:
            if seq == chain[-1] + 1:
                chain.append(seq)
        take = min(left[seq] for seq in chain)
        out.append(take * len(chain))
        for seq in chain:
            left[seq] -= take
        order = [seq for seq in order if left[seq]]
    return out


def expected_accepted(rate: float, length: int) -> float:
    """The expected number of draft tokens accepted from a draft of ``length`` whose
    tokens are each right with probability ``rate`` given the ones before were."""
    if rate >= 1.0:
        return float(length)
    return rate * (1.0 - rate ** length) / (1.0 - rate)  # rate + rate² + … + rate^length


@dataclass(frozen=True)
class Rows:
    """A decode step's rows so far, as a draft for one slot is weighed: every decoding
    slot's sequence and rows (``Shape``), and which of them is the slot's (its own row
    only, so far)."""

    shape: tuple[tuple[int, int], ...]
    at: int
    lead: bool = True
    """Whether the slot has more left to make than every other (or is alone): the
    batch's steps are its steps, so only its draft may make a step longer for all."""
    peers: tuple[int, ...] = ()
    """The slots after it that may draft with the draft model in this step too."""

    @property
    def n(self) -> int:
        return sum(rows for _, rows in self.shape)

    @property
    def joinable(self) -> int:
        """The most rows the slot may have without making a micro-batch of its own: as
        many as the slot with the most has."""
        return max(rows for i, (_, rows) in enumerate(self.shape) if i != self.at) \
            if len(self.shape) > 1 else self.shape[self.at][1]

    def together(self, d: int) -> Shape:
        """The shape with the slot's and its peers' rows (none: the slot's alone) grown by
        drafts of ``d``."""
        grown = {self.at, *self.peers}
        return tuple((seq, rows + d if i in grown else rows)
                     for i, (seq, rows) in enumerate(self.shape))


class StepCost:
    """A decode step's time by its row count: the median of the last few steps seen
    with that many rows (the load probe's, then the engine's own), interpolated
    between row counts seen and extended past the largest."""

    KEEP = 5
    """Steps remembered per row count (a median of them: one slow step is noise)."""
    MARGIN = 0.05
    """How much more a draft must promise than no draft (the estimates are noisy)."""

    def __init__(self) -> None:
        self._seen: dict[int, deque[float]] = {}
        self._table: list[float] = []
        """Seconds for a step of ``i`` rows at index ``i`` (index 0 unused)."""
        self._stale = 0

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> StepCost:
        """From (rows, seconds) probe samples."""
        cost = cls()
        for rows, seconds in samples:
            cost.observe(rows, seconds)
        return cost

    def observe(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` rows (all with logits, no prompt) took ``seconds``."""
        seen = self._seen.get(rows)
        if seen is None:
            seen = self._seen[rows] = deque(maxlen=self.KEEP)
            self._stale = self.KEEP  # a new row count: rebuild at once
        seen.append(seconds)
        self._stale += 1

    def estimate(self, rows: int) -> float | None:
        """The expected seconds for a step of ``rows`` rows; None before any step."""
        if self._stale >= self.KEEP or len(self._table) <= rows:
            self._rebuild(rows)
        return self._table[rows] if self._table else None

    def step(self, shape: Shape) -> float | None:
        """The expected seconds for a decode step of ``shape``: its micro-batches'
        (``ubatches``), each as a step of its rows; None before any step."""
        parts = ubatches(shape)
        if self.estimate(max(parts)) is None:  # (also makes the table long enough)
            return None
        return sum(self._table[rows] for rows in parts)

    def draft_len(self, rows: int | Rows, tokens: float, rate: float, available: int) -> int:
        """How many draft tokens to add to a step that already has ``rows`` rows (one
        sequence's, or ``Rows``: every decoding slot's, this one's among them) and is
        expected to yield ``tokens`` tokens: the length with the most expected tokens
        per second, each draft token right with probability ``rate`` given the ones
        before it were (a draft free to make: prompt lookup's, a grammar's); 0 if none
        beats no draft by MARGIN."""
        return self.draft_plan(rows, tokens, rate, available)[0]

    def draft_plan(self, rows: int | Rows, tokens: float, rate: float, available: int
                   ) -> tuple[int, float]:
        """``draft_len``'s length and the expected tokens per second it gives (without a
        draft: ``tokens`` over the step's time; 0.0 before any step was timed)."""
        alone = (replace(rows, peers=()) if isinstance(rows, Rows)
                 else Rows(((0, rows),), 0))
        return self.joint_plan(alone, tokens, rate, available, lambda d: 0.0)

    def joint_plan(self, rows: Rows, tokens: float, rate: float, available: int,
                   making: Callable[[int], float]) -> tuple[int, float]:
        """A draft length for the slot and its peers alike (``Rows.together``: drafts of
        one length keep the step one micro-batch; a draft model's), each draft token right
        with probability ``rate``, ``making(d)`` the seconds the draft model takes for
        drafts of ``d``: the length with the most expected tokens per second, 0 if none
        beats no draft by MARGIN; and that speed."""
        alone_s = self.step(rows.together(0))
        if alone_s is None or self.step(rows.together(available)) is None:
            return 0, 0.0
        alone = tokens / alone_s
        best_len, best = 0, alone * (1.0 + self.MARGIN)
        gain, p, drafting = 0.0, 1.0, 1 + len(rows.peers)
        for d in range(1, available + 1):
            p *= rate
            gain += p
            took = self.step(rows.together(d))
            assert took is not None
            speed = (tokens + drafting * gain) / (took + making(d))
            if speed > best:
                best_len, best = d, speed
        return best_len, best if best_len else alone

    def _rebuild(self, rows: int) -> None:
        self._stale = 0
        if not self._seen:
            return
        xs = sorted(self._seen)
        ys = [sorted(self._seen[x])[len(self._seen[x]) // 2] for x in xs]
        # A step of more rows that took less says the fewer rows' time was noise (one
        # can always be run as the other): they cost no more. Without this, one slow step
        # at a row count seen rarely (8 rows, once, in the load probe) keeps every draft
        # that would make a step of about that many rows from ever being tried, and so
        # from ever being timed again (tiny 62-layer target, 4 streams: 38 tokens drafted
        # of 1,024, where every draft is right).
        for i in range(len(ys) - 2, -1, -1):
            ys[i] = min(ys[i], ys[i + 1])
        size = len(self._table) or 65
        while size <= max(rows, xs[-1]):  # grown only as far as asked (doubling)
            size *= 2
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) if len(xs) > 1 else None
        # Past the largest row count seen: at the last slope, or at the cheapest cost
        # per row seen (one row aside: ggml computes it as a matrix-vector product),
        # whichever is less; a single row count seen: every row costs as much.
        per_row = min((y / x for x, y in zip(xs, ys, strict=True) if x > 1),
                      default=ys[0] / xs[0])
        table = [0.0] * size
        for n in range(1, size):
            i = bisect.bisect_left(xs, n)
            if i < len(xs) and xs[i] == n:
                table[n] = ys[i]
                continue
            if i == 0:  # fewer rows than any seen: no cheaper than the smallest
                table[n] = ys[0]
            elif i == len(xs):
                table[n] = per_row * n
                if slope is not None:
                    table[n] = min(table[n], ys[-1] + slope * (n - xs[-1]))
            else:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                table[n] = y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        self._table = table


class Costs:
    """What steps cost on this machine, as measured: one holder every part of the engine
    reads (the scheduler, the drafter, the batch runner that measures)."""

    def __init__(self) -> None:
        self.decode = StepCost()
        """A step's time by row count, for steps of decode rows only (probed at load)."""
        self.fill = StepCost()
        """A step's time by its batch tokens, for steps that read prompt tokens (learnt
        as they run): a prompt token costs other than a decode row."""

    def estimate(self, n: int, filling: bool) -> float | None:
        """A step of ``n`` batch tokens: as steps that read prompt tokens took (``filling``:
        3x the decode table's on a CPU), else as a decode step of ``n`` rows."""
        fill = self.fill.estimate(n) if filling else None
        return fill if fill is not None else self.decode.estimate(n)
