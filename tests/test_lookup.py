"""Prompt-lookup decoding: drafts verified in the batch never change greedy output.

The tiny random model rarely repeats itself, so besides the real n-gram drafter these
tests use an oracle drafter (a real PromptLookup subclass) that proposes what greedy
decoding will produce, corrupted where hypothesis says: every draft is then accepted
whole, in part, or not at all, and stop strings, max_tokens and the context limit
land inside accepted drafts. Output (ids, text, finish reason) must equal the output
with lookup off, token for token.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import SpawnDaemon
from daemonhelp import EC
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everycycle import paths
from everycycle.client import SyncClient
from everycycle.engine.core.jobs import Job, JobSpec, Output, Sampling
from everycycle.engine.core.stepcost import Rows, StepCost, expected_accepted, ubatches
from everycycle.engine.spec.lookup import MAX_DRAFT, History, PromptLookup
from everycycle.engine.worker.runner import Runner
from everycycle.hardware import cpukernels
from everycycle.protocol import Format, Tokens

GREEDY = Sampling.of(temperature=0.0, repeat_penalty=1.0)


def counted(runner: Runner) -> tuple[int, int]:
    """Prompt lookup's draft tokens verified and confirmed so far on ``runner``."""
    return next(((c.drafted, c.accepted) for c in runner.draft_counts
                 if c.method == "lookup"), (0, 0))


def test_drafts_come_from_the_last_ngram_seen_before() -> None:
    lk = PromptLookup([5, 6, 7, 8, 9, 1, 2, 5, 6])
    assert lk.draft(10) == []  # the last trigram, 2 5 6, was never seen before
    lk.append(7)  # ... 5 6 7: seen at the start, followed by 8 9 1
    assert lk.draft(3) == [8, 9, 1]
    assert lk.draft(1) == [8]
    assert lk.draft(0) == []
    assert lk.rate == 0.5  # an even start
    lk.verified(3, 3)
    assert lk.rate > 0.8
    lk.verified(6, 1)
    assert 0.5 < lk.rate < 0.8
    for _ in range(4):
        lk.verified(4, 0)  # the text stopped copying: the rate falls within a few drafts
    assert lk.rate < 0.4


def test_the_draft_follows_the_place_whose_earlier_text_matches_best() -> None:
    # 1 2 3 was followed by 4 4 (after 7 8) and later by 5 5 (after 9); the text now
    # ends 7 8 1 2 3, so the draft is 4 4, not the latest continuation.
    lk = PromptLookup([7, 8, 1, 2, 3, 4, 4, 9, 1, 2, 3, 5, 5, 7, 8, 1, 2, 3])
    assert lk.draft(2) == [4, 4]
    lk2 = PromptLookup([0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 6, 1, 2, 3])
    assert lk2.draft(1) == [5]  # neither matches further back: the latest


def test_drafts_from_an_earlier_sequence_where_it_matches_better() -> None:
    history = History()
    prompt = list(range(100, 130))
    answer = [7, 3, 9, 4, 8, 2, 6, 5, 1, 11, 12, 13]
    history.add([*prompt, *answer], len(prompt))
    # The same request again: its own text never had what follows its prompt's end;
    # the earlier one, with the same text before, was followed by its answer.
    lk = PromptLookup(prompt, history)
    assert lk.draft(4) == [7, 3, 9, 4]
    for t in answer[:3]:
        lk.append(t)
    assert lk.draft(4) == [4, 8, 2, 6]
    assert lk.draft(100) == answer[3:]  # up to where that sequence ended
    # Another request sharing only the answer's start: too little matches to trust it.
    other = PromptLookup([1, 2, 3, *answer[:3]], history)
    assert other.draft(4) == []
    # Its own text, matching further back than the earlier sequence, wins.
    own = PromptLookup([*prompt, 7, 3, 9, 0, *prompt, 7, 3, 9], history)
    assert own.draft(2) == [0, 100]


def test_history_keeps_the_latest_tokens_only() -> None:
    class Small(History):
        LIMIT = 200

    history = Small()
    for i in range(30):
        history.add([1000 + i] * 20 + list(range(i * 100, i * 100 + 20)), 20)
    assert len(history._tokens) <= Small.LIMIT
    late = PromptLookup([1029] * 20 + [2900, 2901, 2902], history)
    assert late.draft(3) == [2903, 2904, 2905]
    early = PromptLookup([1000] * 20 + [0, 1, 2], history)
    assert early.draft(3) == []  # dropped
    assert all(at < len(history._tokens) for places in history._index.values()
               for at in places)


def test_the_length_comes_from_the_cost_and_the_rate() -> None:
    lk = PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    asked: list[tuple[float, int]] = []

    def length(rate: float, available: int) -> int:
        asked.append((rate, available))
        return 2

    assert lk.propose(10, length) == [4, 5]
    assert asked == [(0.5, 10)]
    assert lk.propose(3, length) == [4, 5]
    assert asked[-1] == (0.5, 3)
    # Past the end the text repeats itself: 4 5 6 7 8 1 2 3, then again, up to MAX_DRAFT.
    assert lk.propose(100, lambda rate, available: available) == [4, 5, 6, 7, 8, 1, 2, 3] * 2
    loop = PromptLookup([9, 1, 2, 3, 1, 2, 3])
    assert loop.draft(7) == [1, 2, 3, 1, 2, 3, 1]


def test_a_draft_that_does_not_pay_is_predicted_and_checked_for_free() -> None:
    lk = PromptLookup([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    lk.verified(4, 0)
    lk.verified(1, 0)
    low = lk.rate
    never = lambda rate, available: 0
    assert lk.propose(10, never) == []  # predicted instead: 4 5 6 7 1 2 3 ...
    assert lk.rate == low  # a prediction is no draft: nothing learnt until it is checked
    rates = []
    always = lambda rate, available: available
    for t in (4, 5, 6):  # the text copies: the prediction comes true, token by token
        lk.append(t)
        rates.append(lk.rate)
        assert lk.propose(10, always) == []  # not yet: SURVIVE tokens first
    lk.append(7)
    rates.append(lk.rate)
    assert low < rates[0] < rates[1] < rates[2] < rates[3]
    # Once the rate says a draft pays, the sequence drafts at once, mid-prediction.
    assert lk.propose(4, never) == []
    pays = lambda rate, available: available if rate >= rates[-1] else 0
    assert lk.propose(4, pays) == [1, 2, 3, 4]
    lk2 = PromptLookup([1, 2, 3, 4, 1, 2, 3])
    assert lk2.propose(10, never) == []  # predicts 4 1 2 3
    lk2.append(9)  # wrong at once: the prediction settles as 0 of 4
    assert lk2.rate < 0.5
    assert lk2.propose(10, lambda r, a: a) == []  # 2 3 9: never seen


def test_step_cost_by_row_count() -> None:
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4.0 and expected_accepted(0.0, 5) == 0.0
    ms = 1e-3
    cost = StepCost.fit([(1, 15 * ms), (1, 14 * ms), (1, 90 * ms), (2, 25 * ms),
                         (4, 33 * ms), (8, 57 * ms)])
    assert cost.estimate(1) == pytest.approx(15 * ms)  # a median: 90 ms was noise
    assert cost.estimate(3) == pytest.approx(29 * ms)  # between the row counts seen
    assert cost.estimate(12) == pytest.approx(81 * ms)  # the slope from 4 to 8 rows
    # A CPU (rows nearly as dear as a step): a draft pays only on text that copies.
    assert cost.draft_len(1, 1.0, 0.5, 10) == 0
    assert 2 <= cost.draft_len(1, 1.0, 0.9, 10) <= 6
    assert cost.draft_len(8, 8.0, 0.9, 10) == 0  # a row is worth an eighth of a step
    # Blocks: 4 rows cost less than 3 (repacked kernels); then a draft of 3 wins.
    for _ in range(5):
        cost.observe(3, 45 * ms)
    assert cost.draft_len(1, 1.0, 0.8, 3) == 3
    # A GPU: the step takes as long for 1 row as for 17; drafts are long.
    gpu = StepCost.fit([(1, 5 * ms), (4, 5 * ms), (8, 5.1 * ms), (17, 5.2 * ms)])
    assert gpu.draft_len(1, 1.0, 0.9, 16) == 16
    assert gpu.draft_len(1, 1.0, 0.5, 16) >= 4  # the tail of a long draft adds little
    assert gpu.draft_len(8, 8.0, 0.5, 16) >= 4
    assert StepCost().draft_len(1, 1.0, 0.99, 16) == 0  # nothing measured: no drafts
    one = StepCost.fit([(1, 10 * ms)])  # one row count: assume rows cost as much
    assert one.estimate(3) == pytest.approx(30 * ms)
    for i in range(5000):  # a long-running engine: the table grows only as asked
        one.observe(1 + i % 9, 10 * ms)
        one.draft_len(1 + i % 9, 1.0, 0.9, 16)
    assert len(one._table) <= 128


def test_one_slow_step_past_the_known_row_counts_does_not_set_the_slope() -> None:
    """gemma-3 Q4_K_M on this CPU: the probe knows 1, 2, 4 and 8 rows; one 13-row step
    was slow (238 ms). Past 13 rows the guess is capped at the cheapest cost per row
    seen (8 rows': 13 ms), not the 8-to-13 slope (27 ms a row), so 16 rows stay within
    reach; they cost 170 ms, and once seen the drafts fill them."""
    ms = 1e-3
    cost = StepCost.fit([(1, 30 * ms), (2, 57 * ms), (4, 74 * ms), (8, 104 * ms)] * 5
                        + [(13, 238 * ms)])
    assert cost.estimate(16) == pytest.approx(16 * 13 * ms)
    assert cost.estimate(14) == pytest.approx(14 * 13 * ms)
    for _ in range(3):
        cost.observe(16, 170 * ms)
    assert cost.draft_len(1, 1.0, 1.0, 16) >= 15  # 17 rows: guessed as dear as 16
    cost.observe(17, 270 * ms)  # ... and tried: a block and a one-row leftover
    assert cost.draft_len(1, 1.0, 1.0, 16) == 15
    assert cost.draft_len(1, 1.0, 0.3, 16) == 0  # on text that hardly copies: none


class Oracle(PromptLookup):
    """Drafts the known greedy continuation, corrupting every ``spoil``-th token."""

    expected: ClassVar[dict[tuple[int, ...], list[int]]] = {}
    spoil = 0

    def __init__(self, tokens: Sequence[int], history: History | None = None) -> None:
        super().__init__(tokens)
        self.prompt = tuple(tokens)
        self.generated: list[int] = []
        self.made = 0

    def append(self, token: int) -> None:
        super().append(token)
        if hasattr(self, "prompt"):
            self.generated.append(token)

    def propose(self, limit: int, length: Callable[[float, int], int]) -> list[int]:
        return self.draft(min(limit, MAX_DRAFT))  # always verify: these tests are about it

    def draft(self, limit: int) -> list[int]:
        want = self.expected.get(self.prompt, [])
        pos = len(self.generated)
        out = list(want[pos:pos + limit])
        for i in range(len(out)):
            self.made += 1
            if self.spoil and self.made % self.spoil == 0:
                out[i] = (out[i] + 1) % 256 + 3
        return out


class OracleRunner(Runner):
    lookup_type = Oracle


class Collect:
    """Outputs per job, and an event when each finishes."""

    def __init__(self) -> None:
        self.outputs: dict[int, list[Output]] = {}
        self.done: dict[int, threading.Event] = {}
        self.jobs: list[Job] = []
        """Every job run, kept alive: outputs are keyed by id(job), which a job made
        after another was freed could reuse."""

    def __call__(self, batch: list[tuple[Job, Output]]) -> None:
        for job, out in batch:
            self.outputs.setdefault(id(job), []).append(out)
            if out.finished:
                self.done[id(job)].set()

    def run(self, runner: Runner, job: Job, cancel_after: int | None = None
            ) -> tuple[list[int], str, str | None]:
        self.jobs.append(job)
        self.done[id(job)] = threading.Event()
        runner.submit(job)
        if cancel_after is not None:
            while len(self.outputs.get(id(job), [])) < cancel_after:
                if self.done[id(job)].wait(0.001):
                    break
            runner.cancel(job, "test")
        assert self.done[id(job)].wait(60)
        outs = self.outputs[id(job)]
        ids = [i for o in outs for i in o.ids]
        return ids, "".join(o.text for o in outs), outs[-1].reason


@pytest.fixture
def make_pair(tiny_gguf: Path, tiny_batches_exact: bool
              ) -> Iterator[Callable[[], tuple[Runner, Runner, Collect, Collect]]]:
    """Fresh runners, lookup off and the oracle drafter on: the same history each.

    (llama.cpp's float results depend a little on how a prompt was split between the
    cache and the batch, so the two runners must have served exactly the same jobs.
    Lookup's output equals plain greedy decoding only where a draft's batch rows are
    bit-exact: these tests rely on the engine's own probe saying so on this CPU, as the
    engine does before it turns lookup on.)
    """
    if not tiny_batches_exact:
        pytest.skip("batched logits are not bit-exact on this CPU (the load-time probe): "
                    "lookup is off by default here and promises no identical output")
    made: list[Runner] = []

    def make() -> tuple[Runner, Runner, Collect, Collect]:
        off, on = Collect(), Collect()
        a = Runner(tiny_gguf, context=96, parallel=1, notify=off, n_threads=1)
        b = OracleRunner(tiny_gguf, context=96, parallel=1, notify=on, n_threads=1)
        made.extend((a, b))
        return a, b, off, on

    yield make
    for r in made:
        r.close()


words = st.sampled_from(["hello", " world", " the", " a", "ing", "é", "✓", "x", " "])


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(words, min_size=1, max_size=12).map("".join),
       max_tokens=st.integers(1, 80), spoil=st.sampled_from([0, 0, 2, 3, 5, 7]),
       stop=st.lists(st.sampled_from(["e", "wor", "é", "✓", "ll", "zz"]), max_size=2))
def test_greedy_output_is_identical_with_and_without_lookup(
        make_pair: Callable[[], tuple[Runner, Runner, Collect, Collect]], prompt: str,
        max_tokens: int, spoil: int, stop: list[str]) -> None:
    a, b, off, on = make_pair()
    tokens = a.tokenize(prompt, Format.RAW)
    # What greedy decoding gives, to the context's end: the oracle's script.
    script, _, _ = off.run(a, Job(JobSpec(tokens=tokens, max_tokens=96,
                                          sampling=GREEDY, lookup=False)))
    Oracle.expected[tuple(tokens)] = script
    Oracle.spoil = spoil
    want = off.run(a, Job(JobSpec(tokens=tokens, max_tokens=max_tokens,
                                  sampling=GREEDY, stop=tuple(stop), lookup=False)))
    b_script = on.run(b, Job(JobSpec(tokens=tokens, max_tokens=96, sampling=GREEDY, lookup=False)))
    assert b_script[0] == script  # the same history on both runners
    got = on.run(b, Job(JobSpec(tokens=tokens, max_tokens=max_tokens,
                                sampling=GREEDY, stop=tuple(stop), lookup=True)))
    assert got == want
    if max_tokens > 2 and want[2] == "length":
        assert counted(b)[0] > 0  # drafts were really made and checked
    a.close()
    b.close()


@pytest.mark.parametrize("prompt", ["a prompt the model never saw", "x é x ✓ the"])
def test_a_request_asked_again_drafts_its_earlier_answer(tiny_gguf: Path, prompt: str
                                                         ) -> None:
    got = Collect()
    runner = Runner(tiny_gguf, context=256, parallel=1, notify=got, n_threads=1)
    try:
        tokens = runner.tokenize(prompt, Format.RAW)
        first = got.run(runner, Job(JobSpec(tokens=tokens, max_tokens=80,
                                            sampling=GREEDY, lookup=True)))
        assert first[2] == "length"
        before = counted(runner)
        assert before == (0, 0)  # this random model's text never repeats itself
        again = got.run(runner, Job(JobSpec(tokens=tokens, max_tokens=80,
                                            sampling=GREEDY, lookup=True)))
        if runner.lookup_exact:  # the engine's probe: draft rows are bit-exact here
            assert again == first
        # Drafted from the first answer: most of its 79 tokens after the first.
        drafted, accepted = counted(runner)
        assert accepted >= 60 and accepted >= 0.9 * drafted
    finally:
        runner.close()


def test_drafts_were_accepted_and_rejected(
        make_pair: Callable[[], tuple[Runner, Runner, Collect, Collect]]) -> None:
    a, b, off, on = make_pair()
    tokens = a.tokenize("hello world", Format.RAW)
    Oracle.expected[tuple(tokens)] = off.run(
        a, Job(JobSpec(tokens=tokens, max_tokens=96, sampling=GREEDY, lookup=False)))[0]
    Oracle.spoil = 4
    before = counted(b)
    on.run(b, Job(JobSpec(tokens=tokens, max_tokens=60, sampling=GREEDY, lookup=True)))
    drafted, accepted = counted(b)[0] - before[0], counted(b)[1] - before[1]
    assert 0 < accepted < drafted  # some whole, some cut short


def test_the_context_limit_inside_a_draft(
        make_pair: Callable[[], tuple[Runner, Runner, Collect, Collect]]) -> None:
    a, b, off, on = make_pair()
    tokens = a.tokenize("the a " * 12, Format.RAW)
    script = off.run(a, Job(JobSpec(tokens=tokens, max_tokens=1000, sampling=GREEDY, lookup=False)))
    assert script[2] == "context"
    Oracle.expected[tuple(tokens)] = script[0]
    Oracle.spoil = 0
    on.run(b, Job(JobSpec(tokens=tokens, max_tokens=1000, sampling=GREEDY, lookup=False)))
    assert on.run(b, Job(JobSpec(tokens=tokens, max_tokens=1000,
                                 sampling=GREEDY, lookup=True))) == script


def test_cancelling_mid_draft_leaves_the_slot_sound(
        make_pair: Callable[[], tuple[Runner, Runner, Collect, Collect]]) -> None:
    a, b, off, on = make_pair()
    tokens = a.tokenize("x é x", Format.RAW)
    script = off.run(a, Job(JobSpec(tokens=tokens, max_tokens=96, sampling=GREEDY, lookup=False)))
    Oracle.expected[tuple(tokens)] = script[0]
    Oracle.spoil = 3
    on.run(b, Job(JobSpec(tokens=tokens, max_tokens=96, sampling=GREEDY, lookup=False)))
    _, _, reason = on.run(b, Job(JobSpec(tokens=tokens, max_tokens=96,
                                         sampling=GREEDY, lookup=True)), cancel_after=1)
    assert reason in ("cancelled", "context")
    # The next request on that slot (reusing its cache) is unaffected.
    assert on.run(b, Job(JobSpec(tokens=tokens, max_tokens=40, sampling=GREEDY, lookup=True))) == \
        off.run(a, Job(JobSpec(tokens=tokens, max_tokens=40, sampling=GREEDY, lookup=False)))


def test_the_daemon_takes_speculative_per_model_and_request(
        spawn_daemon: SpawnDaemon, tmp_path: Path, tiny_gguf: Path) -> None:
    f = tmp_path / "m.toml"
    f.write_text(f'[models.on]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 1\n'
                 f'[models.off]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 1\n'
                 "speculative = false\n")
    spawn_daemon(models=f)
    with SyncClient() as c:
        outs = []
        for model, flag in (("on", None), ("on", False), ("off", None), ("off", True)):
            ids = [i for e in c.generate(model, "the a the a the a the", max_tokens=40,
                                         temperature=0.0, speculative=flag)
                   if isinstance(e, Tokens) for i in e.chunk.ids]
            outs.append(ids)
        assert len(outs[0]) == 40
        fleet = {m.name: m for m in c.describe_fleet().loaded_models}
        assert "lookup" in {d.method for d in fleet["on"].drafts or ()}
        assert fleet["off"].lookup is False  # off by models.toml, unless a request asks
        assert outs[0] == outs[1] and outs[2] == outs[3]
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[models.x]\npath = "{tiny_gguf}"\nspeculative = "yes"\n')
    out = subprocess.run([*EC, "models", "--models", str(bad)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 2 and "speculative must be a boolean" in out.stderr


def _batches_exact(path: Path, tokens: list[int]) -> bool:
    """Whether the last four of ``tokens`` get bit-identical logits decoded one at a time,
    as one 4-row batch and as two 2-row batches: checked here with llama.cpp's API directly, apart from the
    runner's probe."""
    import llama_cpp as L
    import numpy as np

    mp = L.llama_model_default_params()
    mp.use_extra_bufts = cpukernels.decide(paths.state_dir()).extra  # as the engine loads
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.no_perf = 512, 512, 512, True
    cp.kv_unified, cp.swa_full = False, False
    cp.n_threads = cp.n_threads_batch = os.cpu_count() or 1
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(64, 0, 1)

    def decode(groups: list[list[int]]) -> list[np.ndarray]:
        L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, -1, -1)
        pos, got = 0, []
        for group in groups:
            for i, tok in enumerate(group):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            batch.n_tokens = len(group)
            assert L.llama_decode(ctx, batch) == 0
            got += [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                    .copy() for i in range(len(group))]
            pos += len(group)
        return got[-4:]

    try:
        alone = decode([tokens[:-4]] + [[t] for t in tokens[-4:]])
        together = decode([tokens[:-4], tokens[-4:]])
        pairs = decode([tokens[:-4], tokens[-4:-2], tokens[-2:]])
        return all(np.array_equal(a, b) and np.array_equal(a, c)
                   for a, b, c in zip(alone, together, pairs, strict=True))
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)


@pytest.mark.shipped
def test_lookup_is_on_by_default_only_where_batches_are_exact() -> None:
    """The rule, whatever this CPU's kernels do: prompt lookup is on by default for a
    model exactly where a multi-row batch gives the logits single rows give. (On AMD
    ggml-cpu: SmolLM2 Q4_1 exact, gemma-3 Q4_K_M not; without extra buffer types, as on
    Intel CPUs whose AMX faults, gemma-3 is exact too.)"""
    from everycycle.models.registry import load_registry, local_file

    reg = load_registry()
    for name in ("smollm2-135m", "gemma-3-270m"):
        path = local_file(reg.get(name))
        r = Runner(path, context=512, parallel=1, notify=lambda b: None,
                   extra_bufts=cpukernels.decide(paths.state_dir()).extra)
        try:
            tokens = r.tokenize("The quick brown fox jumps over the lazy dog again and again",
                                Format.RAW)[:12]
        finally:
            r.close()
        assert r.lookup_exact is _batches_exact(path, tokens), name
    assert reg.get("smollm2-135m").speculative and reg.get("gemma-3-270m").speculative


@pytest.mark.shipped
def test_the_default_model_drafts_a_story_that_repeats_itself() -> None:
    """The real drafter and the real step cost, end to end on SmolLM2 (exact batches):
    a story that soon repeats itself is drafted and mostly accepted; the output is
    token for token the one without lookup."""
    from everycycle.models.registry import load_registry, local_file

    path = local_file(load_registry().get("smollm2-135m"))
    outs = []
    for lookup in (False, True):
        got = Collect()
        r = Runner(path, context=1024, parallel=1, notify=got)
        try:
            tokens = r.tokenize("Write a short story about a robot who learns to paint.")
            outs.append(got.run(r, Job(JobSpec(tokens=tokens, max_tokens=200,
                                               sampling=GREEDY, lookup=lookup))))
            (drafted, accepted), exact = counted(r), r.lookup_exact
        finally:
            r.close()
    if exact:  # the engine's probe says this CPU's batches are bit-exact for SmolLM2
        assert outs[0] == outs[1]
    # How long the drafts are follows this machine's measured step times, so the share
    # accepted varies from run to run (77–95% seen); most must be.
    assert drafted > 0 and accepted > drafted / 2


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), max_size=80), st.lists(st.integers(0, 3), max_size=20))
def test_a_prompt_indexed_at_once_is_indexed_as_token_by_token(
        prompt: list[int], more: list[int]) -> None:
    """(the prompt's n-grams are made in bulk: an agent's 20k tokens on the decode thread)"""
    from everycycle.engine.spec.lookup import PromptLookup

    bulk, one_by_one = PromptLookup(prompt), PromptLookup([])
    for t in prompt:
        one_by_one.append(t)
    assert bulk._index == one_by_one._index and bulk._tokens == one_by_one._tokens
    for t in more:
        bulk.append(t)
        one_by_one.append(t)
    assert bulk._index == one_by_one._index
    assert bulk.draft(4) == one_by_one.draft(4)


def test_a_step_of_several_sequences_is_priced_as_llama_cpp_splits_it() -> None:
    """Each slot has its own KV stream, so llama.cpp splits a batch into micro-batches
    of consecutive sequence ids and equal rows (``split_equal``): one slot's draft among
    eight decoding slots is a second micro-batch, which on a CPU reads the weights again.
    A draft that pays alone does not pay there; drafts of the same length on every slot
    make one micro-batch again."""
    assert ubatches([(0, 1), (1, 1), (2, 1)]) == [3]
    assert ubatches([(0, 4), (1, 1), (2, 1)]) == [3, 3]
    assert ubatches([(0, 4), (1, 2), (2, 1)]) == [3, 2, 2]
    assert ubatches([(0, 1), (2, 1)]) == [1, 1]  # (a gap in the ids: two micro-batches)
    assert ubatches([(1, 2), (0, 2)]) == [2, 2]  # (1, then 0: no id follows 1)
    ms = 1e-3
    cpu = StepCost.fit([(n, 10 * ms + 2 * ms * n) for n in (1, 2, 4, 8, 16, 32)] * 3)
    assert cpu.draft_len(1, 1.0, 0.9, 4) > 0  # alone: rows are cheap beside a step
    eight = Rows(tuple((seq, 1) for seq in range(8)), 0)
    assert cpu.step(eight.together(3)) == pytest.approx(cpu.step(eight.together(0))
                                                          + 10 * ms + 6 * ms)
    assert cpu.draft_len(eight, 8.0, 0.9, 4) == 0  # a second micro-batch: not worth it
    drafted = Rows(((0, 4), *((seq, 4) for seq in range(1, 7)), (7, 1)), 7)
    assert cpu.draft_len(drafted, 30.0, 0.9, 4) == 3  # joining the others' micro-batch
