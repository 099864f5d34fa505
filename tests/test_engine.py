"""The engine on real llama.cpp with the tiny GGUF: sampling, streaming, stops, slots."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from enginehelp import Collector

from everycycle.engine.core.jobs import Job, JobSpec, Output, Sampling
from everycycle.engine.core.stepcost import StepCost
from everycycle.engine.llama.llamalog import log_capture
from everycycle.engine.worker.runner import Runner
from everycycle.errors import InvalidRequestError
from everycycle.protocol import Format

GREEDY = Sampling.of(temperature=0.0)


@pytest.fixture(scope="module")
def collector() -> Collector:
    return Collector()


@pytest.fixture(scope="module")
def runner(tiny_gguf: Path, collector: Collector) -> Iterator[Runner]:
    r = Runner(tiny_gguf, context=256, parallel=4, notify=collector)
    yield r
    r.close()


def run(runner: Runner, collector: Collector, tag: str, prompt: str, **kw: object) -> str:
    job = Job(JobSpec(tokens=runner.tokenize(prompt, Format.RAW), **kw), tag=tag)  # type: ignore[arg-type]
    runner.submit(job)
    return collector.text(tag)


def test_greedy_is_deterministic(runner: Runner, collector: Collector) -> None:
    a = run(runner, collector, "g1", "hello world", max_tokens=24, sampling=GREEDY)
    b = run(runner, collector, "g2", "hello world", max_tokens=24, sampling=GREEDY)
    assert a and a == b


def test_seeded_sampling_is_deterministic(runner: Runner, collector: Collector) -> None:
    texts = [
        run(runner, collector, f"s{i}", "the", max_tokens=24,
            sampling=Sampling.of(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        for i, seed in enumerate((7, 7, 8))
    ]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_chunks_are_whole_utf8_and_match_detokenized_ids(
    runner: Runner, collector: Collector
) -> None:
    split_seen = False
    for seed in range(6):
        tag = f"u{seed}"
        job = Job(JobSpec(tokens=runner.tokenize("é✓", Format.RAW), max_tokens=64,
                          sampling=Sampling.of(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)), tag=tag)
        runner.submit(job)
        outs = collector.wait(tag)
        ids = [i for o in outs for i in o.ids]
        assert "".join(o.text for o in outs) == runner.detokenize(ids)
        for o in outs:
            o.text.encode("utf-8")  # never a lone surrogate
            if len(o.ids) > 1 and len(o.text) == 1 and ord(o.text) > 0x7F and o.text != "\ufffd":
                split_seen = True  # one character made of several byte tokens
    assert split_seen, "the tiny model should emit a multi-byte character split over tokens"


def test_max_tokens_bounds_the_output(runner: Runner, collector: Collector) -> None:
    job = Job(JobSpec(tokens=runner.tokenize("a", Format.RAW), max_tokens=5,
                      sampling=GREEDY), tag="m")
    runner.submit(job)
    outs = collector.wait("m")
    assert outs[-1].finished and outs[-1].reason in ("length", "eos")
    assert job.n_generated <= 5
    if outs[-1].reason == "length":
        assert job.n_generated == 5


def test_stop_string_ends_the_stream_before_it(runner: Runner, collector: Collector) -> None:
    full = run(runner, collector, "f", "hello", max_tokens=40, sampling=GREEDY)
    stop = full[5:8]
    assert len(stop) == 3
    cut = run(runner, collector, "c", "hello", max_tokens=40, sampling=GREEDY, stop=[stop])
    assert cut == full[: full.index(stop)]
    assert collector.wait("c")[-1].reason == "stop"


def test_cancel_stops_within_a_step(runner: Runner, collector: Collector) -> None:
    job = Job(JobSpec(tokens=runner.tokenize("hello", Format.RAW), max_tokens=4000,
                      sampling=Sampling.of(temperature=1.0, seed=3)), tag="x")
    runner.submit(job)
    runner.cancel(job, "test")
    outs = collector.wait("x")
    assert outs[-1].reason == "cancelled"
    assert job.n_generated < 4000


def test_prompt_longer_than_context_is_invalid(runner: Runner) -> None:
    tokens = runner.tokenize("hello " * 300, Format.RAW)
    with pytest.raises(InvalidRequestError, match="context holds 256"):
        runner.submit(Job(JobSpec(tokens=tokens, max_tokens=4)))


def test_chat_format_applies_the_gguf_template(runner: Runner) -> None:
    assert runner.has_chat_template
    chat = runner.detokenize(runner.tokenize("hi", Format.CHAT))
    raw = runner.detokenize(runner.tokenize("hi", Format.RAW))
    assert "hi" in chat and chat != raw


def test_batched_greedy_output_equals_output_alone(runner: Runner, collector: Collector) -> None:
    if not runner.lookup_exact:  # the engine's own probe: batches differ in the last bits
        pytest.skip("batched logits are not bit-exact on this CPU (the load-time probe)")
    prompts = ["hello", "world", "the a", "ing é", "✓✓"]
    alone = [run(runner, collector, f"alone{i}", p, max_tokens=20, sampling=GREEDY)
             for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        runner.submit(Job(JobSpec(tokens=runner.tokenize(p, Format.RAW), max_tokens=20,
                                  sampling=GREEDY), tag=f"b{i}"))
    together = [collector.text(f"b{i}") for i in range(len(prompts))]
    assert together == alone


def test_a_follow_up_prompt_reuses_the_cached_prefix(runner: Runner, collector: Collector) -> None:
    first = Job(JobSpec(tokens=runner.tokenize("hello world the world", Format.RAW), max_tokens=4,
                        sampling=GREEDY), tag="p1")
    runner.submit(first)
    collector.wait("p1")
    longer = list(first.spec.tokens) + runner.tokenize(" a", Format.RAW)[1:]
    second = Job(JobSpec(tokens=longer, max_tokens=4, sampling=GREEDY), tag="p2")
    runner.submit(second)
    collector.wait("p2")
    assert second.n_reused == len(first.spec.tokens)


def test_a_missing_or_bad_file_is_invalid(tmp_path: Path, collector: Collector) -> None:
    with pytest.raises(InvalidRequestError):
        Runner(tmp_path / "nope.gguf", context=64, parallel=1, notify=collector)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(InvalidRequestError):
        Runner(junk, context=64, parallel=1, notify=collector)


def test_greedy_fast_path_matches_llama_cpps_greedy_sampler(
    runner: Runner, collector: Collector, tiny_gguf: Path
) -> None:
    import llama_cpp as L

    prompt = runner.tokenize("hello world", Format.RAW)
    job = Job(JobSpec(tokens=prompt, max_tokens=24, sampling=GREEDY), tag="argmax")
    runner.submit(job)
    ours = [i for o in collector.wait("argmax") for i in o.ids]

    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(tiny_gguf).encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = 256
    ctx = L.llama_init_from_model(model, cp)
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    arr = (L.llama_token * len(prompt))(*prompt)
    L.llama_decode(ctx, L.llama_batch_get_one(arr, len(prompt)))
    theirs = []
    for _ in range(24):
        tok = L.llama_sampler_sample(chain, ctx, -1)
        theirs.append(tok)
        one = (L.llama_token * 1)(tok)
        L.llama_decode(ctx, L.llama_batch_get_one(one, 1))
    L.llama_sampler_free(chain)
    L.llama_free(ctx)
    L.llama_model_free(model)
    assert ours == theirs


def test_repeat_penalty_goes_through_llama_cpps_penalties_sampler(
    runner: Runner, collector: Collector
) -> None:
    plain = run(runner, collector, "rp0", "the", max_tokens=48, sampling=GREEDY)
    penalised = run(runner, collector, "rp1", "the", max_tokens=48,
                    sampling=Sampling.of(temperature=0.0, repeat_penalty=5.0))
    assert plain != penalised
    # a strong penalty on the last 64 tokens makes repeats rarer
    ids_plain = [i for o in collector.wait("rp0") for i in o.ids]
    ids_pen = [i for o in collector.wait("rp1") for i in o.ids]
    assert len(set(ids_pen)) > len(set(ids_plain))


def test_cancelling_one_slot_leaves_the_others_untouched(
    runner: Runner, collector: Collector
) -> None:
    prompts = ["hello", "world", "the a"]
    alone = [run(runner, collector, f"solo{i}", p, max_tokens=40, sampling=GREEDY)
             for i, p in enumerate(prompts)]
    victim = Job(JobSpec(tokens=runner.tokenize("ing é", Format.RAW), max_tokens=4000,
                         sampling=Sampling.of(temperature=1.0, seed=5)), tag="victim")
    runner.submit(victim)
    jobs = []
    for i, p in enumerate(prompts):
        job = Job(JobSpec(tokens=runner.tokenize(p, Format.RAW), max_tokens=40,
                          sampling=GREEDY), tag=f"mix{i}")
        jobs.append(job)
        runner.submit(job)
    runner.cancel(victim, "test")
    assert collector.wait("victim")[-1].reason == "cancelled"
    mixed = [collector.text(f"mix{i}") for i in range(len(prompts))]
    assert all(mixed)  # each one ran to its end
    if runner.lookup_exact:  # the engine's probe: batches are bit-exact on this CPU
        assert mixed == alone


def test_greedy_under_a_grammar_equals_masking_every_token(runner: Runner) -> None:
    """The fast path (the argmax, masked only when the matcher refuses it) picks what
    masking the whole vocabulary every token picks, over random logits."""
    import numpy as np

    from everycycle.chatfmt import constraint

    grammar = constraint.json_schema('{"type": "object", "properties": {"a": {"type": '
                                     '"string"}, "b": {"type": "array", "items": '
                                     '{"type": "integer"}}}}')
    constraints = runner._constraints
    fast, slow = constraints.matcher(grammar), constraints.matcher(grammar)
    rng = np.random.default_rng(7)
    fast_path = 0
    for step in range(80):
        logits = rng.normal(size=runner._n_vocab).astype(np.float32)
        if step % 2:  # every other step, an allowed token on top: the fast path's case
            allowed = np.flatnonzero(np.isfinite(slow.mask(logits)))
            logits[rng.choice(allowed)] = 10.0
        top = int(logits.argmax())
        fast_path += fast.allows(top)
        tok = fast.greedy(logits, top)
        masked = int(slow.mask(logits).argmax())
        slow.accept(masked)
        assert tok == masked
        if runner.vocab.is_eog(tok):
            break
    assert fast_path > 0  # (the argmax was taken as it was at least once)


class _Watched(Runner):
    """Records the thread of every decode-running call (the load probe, embeddings)."""

    threads: list[str]

    def _probe(self) -> tuple[bool, StepCost]:
        type(self).threads.append(threading.current_thread().name)
        return super()._probe()

    def _embed(self, jobs: list[Job], out: list[tuple[Job, Output]],
               progressed: Callable[[], None]) -> None:
        type(self).threads.append(threading.current_thread().name)
        super()._embed(jobs, out, progressed)


def test_every_decode_runs_on_the_engine_thread(tiny_gguf: Path, collector: Collector) -> None:
    # OpenMP keeps a thread pool per calling thread: a decode on the loading thread
    # leaves a second pool, and libgomp then sleeps at every barrier instead of
    # spinning (a quarter slower on 2 cores).
    _Watched.threads = []
    runner = _Watched(tiny_gguf, context=256, parallel=1, notify=collector)
    try:
        job = Job(JobSpec(tokens=[], max_tokens=1, embed_inputs=[runner.tokenize("hello", Format.RAW)]), tag="embed")
        runner.submit(job)
        assert collector.wait("embed")[-1].reason == "embedded"
        assert _Watched.threads == [f"engine:{tiny_gguf.name}"] * 2
        assert threading.current_thread().name not in _Watched.threads
    finally:
        runner.close()


def test_a_load_on_another_thread_does_not_stall_grammar_checks(
        tiny_gguf: Path, collector: Collector) -> None:
    """What llama.cpp logs is captured per thread: a model loading (which captures its
    KV size and errors for seconds on a big model) no longer holds a process-wide lock
    that another model's grammar check waits for."""
    runner = Runner(tiny_gguf, context=256, parallel=1, notify=collector)
    loading, loaded = threading.Event(), threading.Event()

    def load() -> None:
        with log_capture():  # where Runner.__init__ holds its capture around a load
            loading.set()
            loaded.wait(30)

    slow = threading.Thread(target=load)
    slow.start()
    try:
        assert loading.wait(5)
        checked = threading.Event()
        errors: list[Exception] = []

        def check() -> None:
            try:
                from everycycle.chatfmt import constraint

                runner.check_grammar(constraint.gbnf('root ::= "yes" | "no"'))
                with pytest.raises(InvalidRequestError, match="grammar"):
                    runner.check_grammar("start: (")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            checked.set()

        threading.Thread(target=check).start()
        assert checked.wait(5), "a grammar check waited for another thread's load"
        assert not errors, errors
    finally:
        loaded.set()
        slow.join()
        runner.close()
