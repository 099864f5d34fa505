"""What flows through an engine: a Job (prompt tokens, sampling, stop strings) in,
Outputs (chunks of text with their ids, then a finish reason) out, and the rules for
stop strings and held-back text that every engine applies the same way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ...errors import ContextOverflowError, EverycycleError, InvalidRequestError
from ...protocol.sampling import BY_NAME, PARAMS, TEMPERATURE, Param
from .thinking import ThinkBudget

V = TypeVar("V")

EMBED_MAX_TOKENS = 2048
"""The longest input an embedding request may hold, in tokens."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings: the parameters of ``protocol.sampling.PARAMS`` that are set,
    by name (read as ``sampling[TOP_P]``; unset ones are the table's defaults, which are
    llama-server's), and a grammar. ``temperature == 0`` is greedy."""

    values: Mapping[str, object] = field(default_factory=dict)
    grammar: str | None = None
    """The constraint every output must follow: llguidance's serialized grammar
    (``chatfmt.constraint``: a JSON Schema, GBNF, or a tool format's calls, which may
    start lazily at a trigger word)."""
    ignore_eos: bool = False
    """Never end by itself: every end-of-generation token is barred (llama-server's
    ``ignore_eos``, which benchmarks send for answers of a fixed length)."""

    @classmethod
    def of(cls, grammar: str | None = None, **values: object) -> Sampling:
        """Sampling with these parameters set, by name (``Sampling.of(temperature=0)``);
        a None value is unset."""
        unknown = set(values) - set(BY_NAME)
        if unknown:
            raise TypeError(f"no sampling parameter {', '.join(sorted(unknown))}")
        return cls({k: v for k, v in values.items() if v is not None}, grammar)

    def __getitem__(self, param: Param[V]) -> V:
        return cast(V, self.values.get(param.name, param.default))

    @property
    def greedy(self) -> bool:
        """Temperature 0."""
        return self[TEMPERATURE] <= 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes its choice (no penalty, bias, DRY or XTC):
        an argmax over the logits."""
        return self.greedy and not self.ignore_eos and all(
            self[p] == p.neutral for p in PARAMS if p.neutral is not None)


Logprob = tuple[str, float, tuple[tuple[str, float, int], ...]]
"""A generated token's text and log-probability, and the likeliest alternatives' (with
their ids)."""


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
    logprobs: tuple[Logprob, ...] | None = None
    """One per id, for a job that asked (``Job.logprobs``)."""
    progress: int | None = None
    """A job that asked (``JobSpec.progress``), while its prompt is read: the prompt
    tokens in its slot now (no text then)."""
    parked: bool | None = None
    """A background job gave its slot up to an interactive one (True) or got one back
    (False); no text then."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a job asks for, whole: what crosses to an engine process as it is."""

    tokens: Sequence[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: Sequence[str] = ()
    embed_inputs: Sequence[Sequence[int]] | None = None
    """Set for an embedding job: the token sequences to embed (no generation)."""
    rerank: bool = False
    """An embedding job that ranks: each input is a (query, document) pair's tokens for
    a reranker, answered by its scores."""
    lookup: bool = True
    """Prompt-lookup drafts, verified in the batch (greedy jobs)."""
    draft: bool = True
    """Drafts of the model's draft model, where it has one, verified in the batch."""
    special: bool = False
    """Render control tokens as their text (tool-call and thinking markers may be)."""
    logprobs: int | None = None
    """Report each generated token's log-probability and this many likeliest
    alternatives (None: none)."""
    post_sampling: bool = False
    """With ``logprobs``: the probabilities after the sampler chain (its candidates, as
    llama-server's ``post_sampling_probs``), not the model's own."""
    images: tuple[bytes, ...] = ()
    """Image files for a vision model, one per media marker in ``text`` (in order)."""
    text: str | None = None
    """With ``images``: the rendered prompt, which the engine tokenizes with them."""
    progress: bool = False
    """Report how far the prompt is read (``Output.progress``) after each batch of it."""
    lora: tuple[float, ...] = ()
    """Its model's LoRA adapters' scales, in their order (empty or all zero: none)."""
    think: ThinkBudget | None = None
    """A thinking model's budget: its thinking ends after this many tokens (None: as the
    model ends it)."""
    n_indent: int = 0
    """End before a line (after the first line break) indented less than this (0: no)."""
    t_max_predict_ms: int = 0
    """End once the answer has a line break and this long has passed since its first
    token (0: no limit; llama-server's, for code completion)."""
    background_age: float | None = None
    """A background job (None: interactive): a pending interactive job takes its slot
    (it is parked, and resumes where it stopped), unless it has waited parked this many
    seconds: then it takes the next free slot before them and is parked no more."""

    def check_fits(self, n_ctx_slot: int) -> None:
        """Raise InvalidRequestError unless the job fits a slot of ``n_ctx_slot`` tokens:
        a prompt shorter than the context, embedding inputs of 1-EMBED_MAX_TOKENS."""
        if self.embed_inputs is not None:
            for i, tokens in enumerate(self.embed_inputs):
                if not 0 < len(tokens) <= EMBED_MAX_TOKENS:
                    what = (f"documents[{i}] with the query" if self.rerank
                            else f"input[{i}]")
                    raise InvalidRequestError(
                        f"{what} is {len(tokens)} tokens; at most {EMBED_MAX_TOKENS}")
        elif not self.tokens:
            raise InvalidRequestError("the prompt is empty after tokenization")
        elif len(self.tokens) >= n_ctx_slot:
            raise ContextOverflowError(
                f"prompt is {len(self.tokens)} tokens; the context holds {n_ctx_slot}",
                prompt_tokens=len(self.tokens), context=n_ctx_slot)


@dataclass(eq=False)
class Job:
    """One generation: its spec in, Outputs out through the runner's ``notify``."""

    spec: JobSpec
    tag: Any = None
    """Opaque to the engine: whatever the caller uses to route outputs."""
    # Filled in by the runner, read by callers once the job finished:
    n_prompt: int = 0
    n_reused: int = 0
    n_generated: int = 0
    n_parked: int = 0
    """How often it gave its slot up to an interactive job."""
    n_thought: int = 0
    """Of ``n_generated``, the tokens it thought (with a ``think`` budget)."""
    n_drafted: int = 0
    """Draft tokens verified for it (every source), and those the model confirmed."""
    n_draft_accepted: int = 0
    promoted: bool = False
    """A background job served as an interactive one from now on (it waited too long)."""

    @property
    def background(self) -> bool:
        """Whether it gives way to interactive jobs now."""
        return self.spec.background_age is not None and not self.promoted

    cancel_reason: str | None = None
    """Why it was asked to stop (``Runner.cancel`` sets it once, under the runner's lock;
    the step loop ends the job with it within a step)."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start. Blocks are compared as
    slices (in C) before the tokens of the first differing one: an agent's 20k-token
    prompt against a slot's cells took 2 ms token by token, and it is asked for each
    slot and cached prompt."""
    n = min(len(a), len(b))
    if type(a) is not type(b):  # (a list's slice never equals a tuple's)
        a, b = list(a[:n]), list(b[:n])
    i = 0
    while i < n:
        j = min(i + 1024, n)
        if a[i:j] != b[i:j]:
            break
        i = j
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stop_split(text: str, stops: Sequence[str]) -> tuple[int | None, int]:
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
