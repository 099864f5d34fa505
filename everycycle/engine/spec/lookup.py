"""Prompt-lookup drafts: guess the next tokens by finding the sequence's last n-gram
earlier in the prompt or the text generated so far (or, where it matches further back,
in one of the model's recent answers: ``History``), and proposing what followed it.

Pure bookkeeping (no llama.cpp): the runner verifies every draft with the model itself
in the same batch, so a wrong guess costs a few batch rows and never changes the
output.

How long a draft should be depends on two things, both measured, never assumed:
- how well this sequence copies: the chance that a drafted token is right given that
  the ones before it were (``PromptLookup.rate``, from its recent drafts);
- what a batch row costs (``StepCost``: the engine's step time by row count). On a GPU
  a step costs about the same for 1 row or 30; on a CPU each row costs nearly as much
  as a one-row step, and some kernels work in blocks of rows (gemma-3's Q4_K on
  ggml-cpu: 4 rows cost less than 3).
``StepCost.draft_len`` picks the length that gives the most expected tokens per second
of the step; none at all where no length beats not drafting. A sequence that does not
draft still *predicts* its draft and checks it against the tokens it then generates
(free), so its rate stays current and, once a prediction has come true for SURVIVE
tokens, it drafts as soon as a draft pays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

NGRAM = 3
MAX_DRAFT = 16
CANDIDATES = 8
"""Earlier places of an n-gram kept: the draft follows the one whose preceding text
matches the sequence's furthest back (up to CONTEXT tokens more)."""
CONTEXT = 16
DECAY = 0.9
"""Per drafted token: how fast a sequence forgets how well its older drafts did."""
SURVIVE = 4
"""Tokens a prediction must get right before the sequence may draft in its midst: two
or three common words in a row are no sign that the text copies (SmolLM2 explaining
code: 4% slower without this wait, on bench/lookup.py's "rename var")."""


def accepted_prefix(draft: Sequence[int], greedy: Callable[[int], int]) -> list[int]:
    """The tokens one-at-a-time greedy decoding takes from a verified draft: the
    model's choice at each row (``greedy(i)``; row 0 is the slot's own) while it
    agrees with the draft, then the first choice that differs (or follows it all)."""
    taken: list[int] = []
    for i in range(len(draft) + 1):
        tok = greedy(i)
        taken.append(tok)
        if i == len(draft) or tok != draft[i]:
            break
    return taken


class Acceptance:
    """How often a drafter's tokens are right: the chance that a drafted token is right
    given the ones before it were, from its recent drafts (each drafted token weighs
    DECAY of the one after it). An even start, weighing one token, so the first draft
    decides."""

    __slots__ = ("_right", "_tried")

    def __init__(self, right: float = 0.5, tried: float = 1.0) -> None:
        self._right, self._tried = right, tried

    @property
    def rate(self) -> float:
        return self._right / self._tried

    def copy(self) -> Acceptance:
        return Acceptance(self._right, self._tried)

    def learn(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` right."""
        keep = DECAY ** accepted  # each right token: one more try, one more right
        gained = (1.0 - keep) / (1.0 - DECAY)
        self._right = keep * self._right + gained
        self._tried = keep * self._tried + gained
        if accepted < drafted:  # and the first wrong one: one more try
            self._right *= DECAY
            self._tried = DECAY * self._tried + 1.0


class PromptLookup:
    """One sequence's n-gram index: where each n-gram was followed by something, its
    last CANDIDATES places."""

    __slots__ = (
        "_acceptance",
        "_history",
        "_hits",
        "_index",
        "_predicted",
        "_tokens",
    )

    def __init__(self, tokens: Sequence[int], history: History | None = None) -> None:
        self._history = history
        """Earlier sequences of the same model, drafted from where they match better."""
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._acceptance = Acceptance()
        """Its drafts and predictions, right and tried."""
        self._predicted: list[int] = []
        """A draft not verified (not worth its rows), checked against what follows."""
        self._hits = 0
        self._extend(tokens)

    def _extend(self, tokens: Sequence[int]) -> None:
        """``append`` for each of ``tokens``, with no prediction pending (the prompt)."""
        start = len(self._tokens)
        self._tokens.extend(tokens)
        _index_tokens(self._tokens, self._index, start)

    @property
    def rate(self) -> float:
        """The chance that a drafted token is right given the ones before it were, from
        recent drafts (verified and predicted)."""
        return self._acceptance.rate

    def append(self, token: int) -> None:
        """``token`` is now the sequence's last (prompt, or generated and accepted)."""
        self._tokens.append(token)
        _index_tokens(self._tokens, self._index, len(self._tokens) - 1)
        predicted = self._predicted
        if predicted:  # checked token by token: the rate is current at every step
            if token == predicted[self._hits]:
                self._hits += 1
                self._acceptance.learn(1, 1)
                if self._hits < len(predicted):
                    return
            else:
                self._acceptance.learn(1, 0)
            self._predicted = []

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the last n-gram before; [] if none."""
        toks = self._tokens
        if limit <= 0 or len(toks) < NGRAM:
            return []
        starts = self._index.get(tuple(toks[-NGRAM:]))
        start, best = _best_place(toks, toks, starts) if starts else (-1, -1)
        if self._history is not None and best < CONTEXT:
            # An earlier sequence whose text before matches further back (say, the same
            # request's answer last time) is the better guess.
            earlier = self._history.draft(toks, limit, best + 1)
            if earlier:
                return earlier
        if not starts:
            return []
        # Past the sequence's end, the text goes on repeating itself (a loop, a table):
        # the token at start + i is then the draft's own, one period back.
        draft = toks[start:start + limit]
        period = len(toks) - start
        while len(draft) < limit:
            draft.append(draft[len(draft) - period])
        return draft

    def propose(self, limit: int, length: Callable[[float, int], int]) -> list[int]:
        """A draft to verify in this step, or []. ``length(rate, available)`` says how
        many of the available draft tokens are worth their rows (StepCost.draft_len);
        a draft not worth any is predicted instead, and checked against the tokens
        that follow (free) until it fails, ends, or the rate makes a draft pay."""
        draft = self.draft(min(limit, MAX_DRAFT))
        if not draft:
            return []
        if self._predicted and self._hits < SURVIVE:
            return []  # a prediction must come true a few tokens before it can turn
        n = length(self.rate, len(draft))
        if n > 0:
            self._predicted = []  # (what it got right is learnt already)
            return draft[:n]
        if not self._predicted:
            self._predicted, self._hits = draft, 0
        return []

    def ready(self, limit: int) -> bool:
        """Whether it has a draft it may propose now, if its rows pay (not waiting for a
        prediction to come true)."""
        if self._predicted and self._hits < SURVIVE:
            return False
        return bool(self.draft(min(limit, MAX_DRAFT, 1)))

    def verified(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` confirmed."""
        self._acceptance.learn(drafted, accepted)


def _index_tokens(toks: Sequence[int], index: dict[tuple[int, ...], list[int]],
                  start: int) -> None:
    """Index the tokens of ``toks`` from ``start`` on: the n-gram ending just before each
    position p (p >= NGRAM) is followed at p; each n-gram keeps its last CANDIDATES
    places. The n-grams are made in C (``zip``): an agent's 20k-token prompt took 13 ms
    on the decode thread, 10 now."""
    start = max(start, NGRAM)
    end = len(toks)
    if end <= start:
        return
    grams: Iterable[tuple[int, ...]] = (
        (tuple(toks[start - NGRAM:start]),) if end - start == 1  # (a token: every step)
        else zip(*(toks[start - NGRAM + i:end - NGRAM + i] for i in range(NGRAM)),
                 strict=True))
    for p, key in enumerate(grams, start):
        seen = index.get(key)
        if seen is None:
            index[key] = [p]
        else:
            seen.append(p)
            if len(seen) > CANDIDATES:
                del seen[0]


def _best_place(source: Sequence[int], toks: Sequence[int], starts: Sequence[int]
                ) -> tuple[int, int]:
    """Of the places ``starts`` in ``source`` that followed ``toks``'s last n-gram, the
    one whose preceding text matches ``toks`` furthest back (up to CONTEXT tokens), the
    latest on a tie; and how far it matches."""
    start, best, end = starts[-1], -1, len(toks) - NGRAM
    for at in reversed(starts):
        m, i, j = 0, at - NGRAM - 1, end - 1
        while m < CONTEXT and i >= 0 and j >= 0 and source[i] == toks[j]:
            m, i, j = m + 1, i - 1, j - 1
        if m > best:
            start, best = at, m
    return start, best


class History:
    """One model's recent finished sequences (each answer with the end of its prompt),
    for drafts across requests: a request asked again, an answer regenerated, a file an
    agent writes out once more. llama-server's ngram-mod keeps such a memory too.

    Only the engine thread uses it. Drafts from it are verified like any other, so it
    changes speed, never output."""

    LIMIT = 1 << 15
    """Tokens kept (about 8 MB with the index); past it, the older half is dropped."""
    PROMPT_TAIL = CONTEXT + NGRAM
    """Prompt tokens kept before each answer: enough to match the answer's start."""
    MIN_CONTEXT = 8
    """Tokens that must match before the n-gram too: another request's text is a
    guess only where it agrees at length."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}

    def add(self, tokens: Sequence[int], prompt: int) -> None:
        """A finished sequence: ``tokens``, of which the first ``prompt`` were its prompt."""
        if len(tokens) <= prompt:
            return
        if len(self._tokens) + len(tokens) > self.LIMIT:
            kept = self._tokens[len(self._tokens) // 2:]
            self._tokens, self._index = [], {}
            self._extend(kept)
        self._extend([-1, *tokens[max(0, prompt - self.PROMPT_TAIL):]])

    def _extend(self, tokens: Sequence[int]) -> None:
        start = len(self._tokens)
        self._tokens.extend(tokens)
        _index_tokens(self._tokens, self._index, start)

    def draft(self, toks: Sequence[int], limit: int, better: int) -> list[int]:
        """Up to ``limit`` tokens that followed ``toks``'s last n-gram in an earlier
        sequence whose text before matches at least ``better`` and MIN_CONTEXT tokens
        further back; [] if none."""
        starts = self._index.get(tuple(toks[-NGRAM:]))
        if not starts:
            return []
        start, best = _best_place(self._tokens, toks, starts)
        if best < max(better, self.MIN_CONTEXT):
            return []
        draft = self._tokens[start:start + limit]
        return draft[:draft.index(-1)] if -1 in draft else draft
