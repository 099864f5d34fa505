"""Two lanes: an interactive request takes a slot before queued background work and
parks a running background request (which resumes where it stopped); every waiting
request hears an estimate of its start; fleet, the audit log and /metrics name lanes."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from daemonhelp import EC, Raw, wait_until
from enginehelp import Collector
from httphelp import EventReader, audit, blocker, fleet_http
from modelshelp import Entry, models_toml

from everycycle.client import SyncClient
from everycycle.daemon.eta import Rates, Work, starts
from everycycle.engine.core.jobs import Job, JobSpec, Output, Sampling, common_prefix
from everycycle.engine.core.scheduler import BACKGROUND_CHUNK
from everycycle.engine.core.stepcost import StepCost
from everycycle.engine.kvcache.promptcache import Spares
from everycycle.engine.worker.runner import Runner
from everycycle.errors import ErrorKind
from everycycle.protocol import Accepted, Error, Generate, Priority, TokenChunk, Tokens, encode


def _job(runner: Runner, tag: str, text: str, n: int, *, background: bool = False,
         temperature: float = 0.0) -> Job:
    return Job(JobSpec(tokens=runner.tokenize(text), max_tokens=n,
                       sampling=Sampling.of(temperature=temperature, seed=7),
                       background_age=600 if background else None), tag=tag)


class Ordered(Collector):
    """A Collector that also keeps the order in which tags produced tokens and ended."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, object]] = []

    def __call__(self, batch: list[tuple[Job, Output]]) -> None:
        super().__call__(batch)
        with self.lock:
            self.log.extend(("end" if o.finished else "tokens", j.tag) for j, o in batch)

    def first(self, what: str, tag: str) -> int:
        return self.log.index((what, tag))


@pytest.fixture
def runner(tiny_gguf: Path) -> Iterator[Runner]:
    r = Runner(tiny_gguf, context=1024, parallel=1, notify=Ordered())
    yield r
    r.close()


def _log(runner: Runner) -> Ordered:
    notify = runner.loop.notify
    assert isinstance(notify, Ordered)
    return notify


def test_an_interactive_job_parks_a_background_one_which_resumes_where_it_stopped(
        runner: Runner) -> None:
    c = _log(runner)
    bg = _job(runner, "bg", "hello there, general", 300, background=True, temperature=1.0)
    runner.submit(bg)
    wait_until(lambda: len(c.outputs.get("bg", [])) >= 10, "the background job to run")
    it = _job(runner, "it", "another question", 20)
    runner.submit(it)
    c.wait("it")
    outs = c.wait("bg")
    assert c.first("end", "it") < c.first("end", "bg")  # it took the slot; bg waited, parked
    assert bg.n_parked == 1
    # Resumed, not restarted: every token generated once, to its max_tokens.
    assert outs[-1].reason == "length" and bg.n_generated == 300
    assert sum(len(o.ids) for o in outs) == 300
    assert it.n_generated == 20 and c.outputs["it"][-1].reason == "length"
    # Its cells were copied out into a buffer that is spare again, for the next park.
    spares = runner.loop.seating.spares
    assert spares.bytes > 0 and not spares._lent


def test_spare_buffers_are_lent_smallest_first_and_kept_within_a_limit() -> None:
    spares = Spares(limit=300)
    first = spares.lend(100)
    assert len(first) == 125  # (room for a job's cells to grow)
    state = spares.view(first, 90)
    assert len(state) == 90 and ctypes.addressof(state) == ctypes.addressof(first)
    spares.give_back(state)
    assert spares.bytes == 125
    big = spares.lend(200)  # (none spare holds it: new)
    assert spares.lend(110) is first and spares.bytes == 0
    spares.spare(first)
    spares.spare(big)  # 125 + 250 > 300: the oldest goes
    assert spares.bytes == 250 and spares.lend(1) is big


def test_a_conversation_the_resumed_job_overwrites_is_kept_for_its_next_turn(
        tiny_gguf: Path) -> None:
    # One slot, held by background work: each interactive turn parks it, and the parked
    # job resumes into the slot the turn used. The turn's cells go to the prompt
    # cache first, so the next turn of that conversation restores them, not reads them.
    c = Ordered()
    runner = Runner(tiny_gguf, context=1024, parallel=1, notify=c, kv_ram=64 << 20)
    try:
        bg = _job(runner, "bg", "background work, long and steady", 400, background=True,
                  temperature=1.0)
        runner.submit(bg)
        wait_until(lambda: len(c.outputs.get("bg", [])) >= 5, "the background job to run")
        chat = "a person's conversation, turn one, with its system prompt " * 3
        first = _job(runner, "t1", chat, 20)
        runner.submit(first)
        answer = [i for o in c.wait("t1") for i in o.ids]
        wait_until(lambda: ("tokens", "bg") in c.log[c.first("end", "t1"):],
                   "the background job to resume")
        assert runner.prompt_cache is not None and runner.prompt_cache.entries >= 1
        second = Job(JobSpec(tokens=[*first.spec.tokens, *answer,
                                     *runner.tokenize(" and turn two")],
                             max_tokens=5, sampling=Sampling.of(temperature=0.0)), tag="t2")
        runner.submit(second)
        c.wait("t2")
        # The first turn's prompt and its answer but the last token (never decoded)
        # came back from the cache; a slot held by the background job shares none.
        assert second.n_reused >= len(first.spec.tokens) + len(answer) - 1
        runner.cancel(bg, "done")
        c.wait("bg")
    finally:
        runner.close()


def test_an_interactive_job_parks_the_background_job_whose_cells_share_its_prompt(
        tiny_gguf: Path) -> None:
    # Both slots run background work; the one with more cells shares the person's
    # system turn. Parking it (not the cheaper one to copy) lets the person's request
    # reuse those cells: its first token waits for fewer prompt tokens.
    c = Ordered()
    runner = Runner(tiny_gguf, context=2048, parallel=2, notify=c)
    try:
        system = "system: answer briefly, in plain words, and check every fact. " * 3
        # (long enough that neither ends, freeing a slot, before the person comes)
        near = _job(runner, "near", system + "now write about the sea", 900,
                    background=True, temperature=1.0)
        far = _job(runner, "far", "other work", 900, background=True, temperature=1.0)
        runner.submit(near)
        runner.submit(far)
        wait_until(lambda: all(len(c.outputs.get(t, [])) >= 3 for t in ("near", "far")),
                   "both background jobs to run")
        it = _job(runner, "it", system + "what is the capital of France?", 5)
        runner.submit(it)
        c.wait("it")
        shared = common_prefix(near.spec.tokens, it.spec.tokens)
        assert shared >= 20
        assert (near.n_parked, far.n_parked) == (1, 0)
        assert it.n_reused == shared
        for job in (near, far):
            runner.cancel(job, "done")
            c.wait(job.tag)
    finally:
        runner.close()


@pytest.mark.parametrize("queued", [False, True])
def test_with_no_background_work_queued_the_job_nearest_its_end_is_parked(
        tiny_gguf: Path, queued: bool) -> None:
    # The last background jobs of a batch: parking the one that would end last makes
    # the batch end later; the one nearest its end has time to spare. While more
    # background work waits for a slot, the job with the fewest cells (the cheapest to
    # copy out) is parked instead.
    c = Ordered()
    runner = Runner(tiny_gguf, context=4096, parallel=2, notify=c)
    try:
        # "short" has more cells (a longer prompt) and less work left than "long".
        short = _job(runner, "short", "a longer prompt for the job that ends first " * 4,
                     1200, background=True, temperature=1.0)
        long = _job(runner, "long", "other work", 3800, background=True, temperature=1.0)
        jobs = [short, long]
        if queued:
            jobs.append(_job(runner, "queued", "more work", 5, background=True))
        for job in jobs:
            runner.submit(job)
        wait_until(lambda: all(len(c.outputs.get(t, [])) >= 3 for t in ("short", "long")),
                   "both background jobs to run")
        it = _job(runner, "it", "what is the capital of France?", 5)
        assert common_prefix(short.spec.tokens, it.spec.tokens) == common_prefix(
            long.spec.tokens, it.spec.tokens)
        runner.submit(it)
        c.wait("it")
        assert (short.n_parked, long.n_parked) == ((0, 1) if queued else (1, 0))
        assert short.n_generated < short.spec.max_tokens  # (it was running when parked)
        for job in jobs:
            runner.cancel(job, "done")
            c.wait(job.tag)
    finally:
        runner.close()


def test_a_finished_background_conversation_is_kept_before_its_slot_is_wanted(
        tiny_gguf: Path) -> None:
    # Copying a conversation out of a slot takes milliseconds (tens, on a busy CPU); a
    # background job's is copied as it ends, not when an interactive job takes the slot.
    c = Ordered()
    runner = Runner(tiny_gguf, context=1024, parallel=1, notify=c, kv_ram=64 << 20)
    try:
        assert runner.prompt_cache is not None
        bg = _job(runner, "bg", "background work on a long document, part one " * 4, 20,
                  background=True)
        runner.submit(bg)
        c.wait("bg")
        assert runner.prompt_cache.entries == 1
        it = _job(runner, "it", "a person's question", 5)
        runner.submit(it)
        c.wait("it")
        assert runner.prompt_cache.entries == 1  # (nothing more to keep: copied already)
    finally:
        runner.close()


def test_background_prompt_tokens_a_step_reads_follow_the_step_costs(runner: Runner) -> None:
    # A 2-core CPU's step costs (each row nearly a step of its own), one slot: with 3
    # rows decoding, 3 prompt tokens keep the step within twice a step of 3 rows.
    room = runner.loop.scheduler.background_room
    runner.costs.decode = StepCost.fit([(1, .0147), (2, .028), (4, .0427), (8, .0816),
                                 (16, .1546)])
    assert room(3) == 3
    assert room(0) == 2
    # With four slots, twice a step of all four: more when fewer decode.
    four = Runner(runner.path, context=1024, parallel=4, notify=Collector())
    try:
        four.costs.decode = runner.costs.decode
        assert [four.loop.scheduler.background_room(rows) for rows in range(5)
                ] == [8, 7, 6, 5, 4]
    finally:
        four.close()
    # A GPU's (rows nearly free): as many as a step may read of background prompts.
    runner.costs.decode = StepCost.fit([(1, .010), (2, .0101), (16, .011), (64, .013)])
    assert room(3) == BACKGROUND_CHUNK
    runner.costs.decode = StepCost()  # (nothing measured)
    assert room(3) == BACKGROUND_CHUNK


def test_a_parked_job_can_be_cancelled_and_background_jobs_wait_for_interactive_ones(
        runner: Runner) -> None:
    c = _log(runner)
    bg = _job(runner, "bg", "hello there", 500, background=True, temperature=1.0)
    runner.submit(bg)
    wait_until(lambda: len(c.outputs.get("bg", [])) >= 5, "the background job to run")
    it = _job(runner, "it", "a long interactive answer", 400, temperature=1.0)
    runner.submit(it)
    wait_until(lambda: len(c.outputs.get("it", [])) >= 5, "the interactive job to run")
    later = _job(runner, "later", "queued background work", 5, background=True)
    runner.submit(later)
    runner.cancel(bg, "stop")
    assert c.wait("bg")[-1].reason == "cancelled"  # parked: ended within a step
    assert not c.event("it").is_set()
    c.wait("it")
    assert c.wait("later")[-1].reason == "length"
    assert c.first("end", "it") < c.first("tokens", "later")  # it waited for `it`


@pytest.mark.parametrize("age", [600, 0])
def test_a_parked_job_waits_for_interactive_ones_only_its_age(runner: Runner,
                                                               age: float) -> None:
    c = _log(runner)
    bg = Job(JobSpec(tokens=runner.tokenize("old work"), max_tokens=900,
                     sampling=Sampling.of(temperature=0.0), background_age=age), tag="bg")
    runner.submit(bg)
    wait_until(lambda: len(c.outputs.get("bg", [])) >= 3, "the background job to run")
    runner.submit(_job(runner, "it1", "question one", 400))
    wait_until(lambda: len(c.outputs.get("it1", [])) >= 2, "the first question to run")
    runner.submit(_job(runner, "it2", "question two", 5))
    for tag in ("bg", "it1", "it2"):
        c.wait(tag)
    assert bg.n_parked == 1 and c.outputs["bg"][-1].reason == "length"
    if age:  # the second question goes before the parked job
        assert c.first("end", "it2") < c.first("end", "bg")
    else:  # parked past its age: it resumes at the next free slot, before the question
        assert c.first("end", "it1") < c.first("end", "bg") < c.first("tokens", "it2")


def _models(tmp_path: Path, tiny_gguf: Path, parallel: int = 1) -> Path:
    return models_toml(tmp_path / "lanes.toml",
                       Entry("tiny", tiny_gguf, context=4096, parallel=parallel),
                       default="tiny")


def _run(models: Path, *args: str) -> subprocess.Popen[bytes]:
    """``everycycle run`` as a process, streaming when returned."""
    proc = subprocess.Popen([*EC, "run", "--models", str(models), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.read(1)
    return proc


def test_run_interactive_goes_first_while_run_background_holds_the_slot(
        spawn_daemon: object, tmp_path: Path, tiny_gguf: Path) -> None:
    models = _models(tmp_path, tiny_gguf)
    spawn_daemon("--http", "127.0.0.1:0", models=models)  # type: ignore[operator]
    bg = _run(models, "--background", "-n", "3000", "--temperature", "1", "batch work")
    try:
        with SyncClient() as c:
            lanes = {r.lane for r in c.describe_fleet().requests or ()}
            assert lanes == {"background"}
        started = time.monotonic()
        done = subprocess.run([*EC, "run", "--models", str(models), "-n", "16",
                               "--temperature", "0", "quick question"],
                              capture_output=True, timeout=60, check=True)
        assert done.stdout and time.monotonic() - started < 30
        assert bg.poll() is None  # still generating: it gave the slot up, and took it back
    finally:
        bg.kill()
        bg.communicate()
    wait_until(lambda: len(audit()) >= 2, "both audit records")
    lanes_by_outcome = {(r["lane"], r["outcome"]) for r in audit()}
    assert lanes_by_outcome == {("background", "Cancelled"), ("interactive", "Finished")}


def test_a_parked_request_says_so_in_events_and_fleet_and_can_be_cancelled_there(
        spawn_daemon: object) -> None:
    """Parked is a state of its own: the background request whose slot an interactive
    one took is ``parked`` on /v1/events and in fleet (not ``running``), ``running``
    again once it resumes, and a cancel reaches it while parked."""
    spawn_daemon("--http", "127.0.0.1:0")  # type: ignore[operator]  # (tiny: one slot)
    seen = EventReader(f"{fleet_http()}/v1/events")
    long = {"max_tokens": 8000, "temperature": 1.0}
    got: dict[str, list[object]] = {}

    def generate(rid: str, priority: Priority) -> threading.Thread:
        def run() -> None:
            with SyncClient() as mine:
                got[rid] = list(mine.generate("tiny", "x", request_id=rid,
                                              priority=priority, **long))
        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: seen.of("request", request_id=rid, state="running"), rid)
        return t

    try:
        bg = generate("bg-1", Priority.BACKGROUND)
        it = generate("it-1", Priority.INTERACTIVE)
        wait_until(lambda: seen.of("request", request_id="bg-1", state="parked"), "parked")
        with SyncClient() as c:
            states = {r.request_id: r.state for r in c.describe_fleet().requests or ()}
            assert states == {"bg-1": "parked", "it-1": "running"}
            (model,) = c.describe_fleet().loaded_models
            assert model.busy == 1  # (one slot decodes: the parked request holds none)
            c.cancel("it-1")
            it.join(60)
            wait_until(lambda: len(seen.of("request", request_id="bg-1", state="running"))
                       == 2, "the resume")
            states = [e["state"] for e in seen.of("request", request_id="bg-1")]
            assert states[-2:] == ["parked", "running"]
            third = generate("it-2", Priority.INTERACTIVE)
            wait_until(lambda: len(seen.of("request", request_id="bg-1", state="parked"))
                       == 2, "parked again")
            c.cancel("bg-1")  # (while parked: its engine ends it)
            bg.join(60)
            assert not bg.is_alive()
            last = got["bg-1"][-1]
            assert isinstance(last, Error) and last.kind is ErrorKind.CANCELLED, last
            wait_until(lambda: seen.of("request", request_id="bg-1", state="finished"),
                       "its end")
            (end,) = seen.of("request", request_id="bg-1", state="finished")
            assert end["cause"] == "client"
            c.cancel("it-2")
            third.join(60)
    finally:
        seen.close()


async def _accepted(raw: Raw, rid: str) -> Accepted:
    event = await raw.next_for(rid)
    assert isinstance(event, Accepted), event
    return event


async def _moved(raw: Raw, rid: str, position: int) -> Accepted:
    """The next Accepted that moves ``rid`` from ``position`` (an estimate that changed
    by over a second, on a busy machine, tells the same place again first)."""
    while (event := await _accepted(raw, rid)).queue_position == position:
        pass
    return event


@pytest.mark.anyio
async def test_queue_positions_put_interactive_requests_first_with_an_estimate(
        models_file: Path, spawn_daemon: object) -> None:
    spawn_daemon()  # type: ignore[operator]
    hold = blocker(models_file)  # an interactive request holds tiny's only slot
    try:
        async with Raw.open() as raw:
            def gen(rid: str, priority: Priority | None) -> bytes:
                return encode(Generate(rid, "tiny", "x", max_tokens=50, temperature=0.0,
                                       priority=priority))
            await raw.send(gen("b1", Priority.BACKGROUND))
            first = await _accepted(raw, "b1")
            assert first.queue_position == 1 and first.eta_ms is not None and first.eta_ms > 0
            await raw.send(gen("b2", Priority.BACKGROUND))
            assert (await _accepted(raw, "b2")).queue_position == 2
            await raw.send(gen("i1", None))
            assert (await _accepted(raw, "i1")).queue_position == 1  # before both
            assert (await _moved(raw, "b1", 1)).queue_position == 2
            assert (await _moved(raw, "b2", 2)).queue_position == 3
            with SyncClient() as c:
                queued = {r.request_id: r for r in c.describe_fleet().requests or ()}
            assert queued["b2"].lane == "background" and queued["i1"].lane == "interactive"
            assert queued["b2"].eta_ms is not None and queued["i1"].eta_ms is not None
            hold.kill()
            order = []
            for rid in ("i1", "b1", "b2"):
                events = await raw.until_terminal(rid)
                assert isinstance(events[-1], Tokens) and events[-1].finished
                order.append(rid)
    finally:
        hold.kill()
        hold.wait()
        if hold.stdout is not None:
            hold.stdout.close()
    records = [r for r in audit() if r["request_id"] in ("i1", "b1", "b2")]
    assert [r["request_id"] for r in records] == ["i1", "b1", "b2"]


@pytest.mark.anyio
async def test_a_request_waiting_for_its_model_to_load_hears_when_it_should_start(
        models_file: Path, spawn_daemon: object) -> None:
    spawn_daemon()  # type: ignore[operator]

    def gen(rid: str, model: str) -> bytes:
        return encode(Generate(rid, model, "x", max_tokens=2, temperature=0.0))

    async with Raw.open() as raw:
        await raw.send(gen("cold", "tiny"))
        cold = await _accepted(raw, "cold")
        assert cold.queue_position == 0 and cold.eta_ms is None  # no load measured yet
        await raw.until_terminal("cold")
        with SyncClient() as c:
            c.unload("tiny")
        # Loaded before: its own load time. Never loaded (tiny4, the same file with
        # four slots): its size at the rate tiny's load went.
        for rid, model in (("again", "tiny"), ("other", "tiny4")):
            sent = time.monotonic()
            await raw.send(gen(rid, model))
            told = await _accepted(raw, rid)
            events = await raw.until_terminal(rid)
            took = time.monotonic() - sent
            assert isinstance(events[-1], Tokens) and events[-1].finished
            assert told.queue_position == 0 and told.eta_ms is not None, (rid, told)
            assert 0 < told.eta_ms < 60_000
            # An estimate, not a measurement: the right order of magnitude.
            assert told.eta_ms / 1000 < 20 * took, (rid, told.eta_ms, took)


@pytest.mark.anyio
@pytest.mark.parametrize("age", ["120", "0"])
async def test_queued_background_work_starved_for_its_age_goes_first(
        models_file: Path, spawn_daemon: object, age: str) -> None:
    spawn_daemon("--background-age", age)  # type: ignore[operator]
    hold = blocker(models_file)  # interactive work holds tiny's only slot
    try:
        async with Raw.open() as raw:
            await raw.send(encode(Generate("b1", "tiny", "x", max_tokens=5,
                                           priority=Priority.BACKGROUND)))
            await _accepted(raw, "b1")
            await raw.send(encode(Generate("i1", "tiny", "x", max_tokens=5)))
            await _accepted(raw, "i1")
            hold.kill()
            for rid in ("b1", "i1"):
                await raw.until_terminal(rid)
    finally:
        hold.kill()
        hold.wait()
        if hold.stdout is not None:
            hold.stdout.close()
    order = [r["request_id"] for r in audit() if r["request_id"] in ("b1", "i1")]
    # No background work moved for `age` seconds: at 0 the queued one is served first.
    assert order == (["i1", "b1"] if age == "120" else ["b1", "i1"])


def test_run_v_says_the_position_and_when_it_should_start(
        models_file: Path, spawn_daemon: object) -> None:
    spawn_daemon()  # type: ignore[operator]
    hold = blocker(models_file)
    try:
        it = subprocess.Popen([*EC, "run", "--models", str(models_file), "-v", "-n", "4",
                               "hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with SyncClient() as c:
            wait_until(lambda: any(r.state == "queued" and r.eta_ms is not None
                                   for r in c.describe_fleet().requests or ()),
                       "the request to queue, with an estimate")
        hold.kill()
        out, err = it.communicate(timeout=60)
        assert it.returncode == 0 and out
        assert b"queued: position 1, about " in err, err
    finally:
        hold.kill()
        hold.wait()
        if hold.stdout is not None:
            hold.stdout.close()


def test_http_lanes_by_header_and_service_tier(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    try:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"x-priority": "background", "x-request-id": "h1"})
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            service_tier="flex", extra_headers={"x-request-id": "h2"})
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"x-request-id": "h3"})
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_headers={"x-priority": "urgent"})
        assert "x-priority must be interactive or background" in str(bad.value)
    finally:
        client.close()
    lanes = {r["request_id"]: r["lane"] for r in audit()}
    assert (lanes["h1"], lanes["h2"], lanes["h3"]) == ("background", "background", "interactive")
    metrics = httpx.get(f"{url}/metrics").text
    assert 'everycycle_queue_wait_seconds_count{lane="background",model="tiny"} 2.0' in metrics
    assert 'everycycle_lane_queue_depth{lane="interactive",model="tiny"} 0.0' in metrics


SEED_TYPES = Path(__file__).parent / "seedtypes"
DEBIAN_CRATES = Path("/usr/share/cargo/registry")


def test_an_estimate_is_an_extension_the_seed_lines_do_not_carry() -> None:
    assert encode(Accepted("r", 2)) == b'{"Accepted":{"request_id":"r","queue_position":2}}\n'
    line = json.loads(encode(Accepted("r", 2, 14000)))
    assert line == {"Accepted": {"request_id": "r", "queue_position": 2, "eta_ms": 14000}}
    rid = uuid.uuid4().hex
    assert b'"priority"' not in encode(Generate(rid, "m", "x"))


def test_the_seed_types_decode_the_lines_with_an_estimate(tmp_path: Path) -> None:
    """The seed's Rust types (serde, as a seed-era client decodes) read the events a
    queued request gets now, ``eta_ms`` and all."""
    if shutil.which("cargo") is None or not any(DEBIAN_CRATES.glob("serde_json-*")):
        if os.environ.get("EVERYCYCLE_REQUIRE_SEED_TYPES"):
            pytest.fail("cargo and Debian's serde crates are required (.ci/run installs them)")
        pytest.skip("needs cargo and Debian's librust-serde-json-dev (.ci/run installs them)")
    crate = tmp_path / "seedtypes"
    shutil.copytree(SEED_TYPES, crate)
    (crate / ".cargo").mkdir()
    (crate / ".cargo" / "config.toml").write_text(
        '[source.crates-io]\nreplace-with = "debian"\n'
        f'[source.debian]\ndirectory = "{DEBIAN_CRATES}"\n')
    built = subprocess.run(["cargo", "build", "--offline", "--quiet"], cwd=crate,
                           capture_output=True, text=True, timeout=600, check=False)
    assert built.returncode == 0, built.stderr
    lines = b"".join(encode(e) for e in (
        Accepted("r1", 2, 14000), Accepted("r1", 1, 6500), Accepted("r1", 0),
        Tokens("r1", TokenChunk("hi", (5, 6)), True),
        Error("r2", ErrorKind.CANCELLED, "cancelled")))
    lines += (Path(__file__).parent / "data" / "events.golden.jsonl").read_bytes()
    done = subprocess.run([str(crate / "target" / "debug" / "seedtypes")], input=lines,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert b'Accepted { request_id: "r1", queue_position: 2 }' in done.stdout


def test_a_key_limited_to_the_background_lane(spawn_daemon: object) -> None:
    made = subprocess.run([*EC, "keys", "add", "ci", "--background"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert "background lane" in made.stderr
    spawn_daemon("--http", "127.0.0.1:0", "--http-auth")  # type: ignore[operator]
    client = openai.OpenAI(base_url=f"{fleet_http()}/v1", api_key=made.stdout.strip())
    try:
        client.completions.create(model="tiny", prompt="a", max_tokens=2,
                                  extra_headers={"x-request-id": "k1"})
    finally:
        client.close()
    assert {r["request_id"]: r["lane"] for r in audit()}["k1"] == "background"


def test_an_estimate_counts_the_work_running_and_ahead() -> None:
    rates = Rates()
    # Nothing measured: one token a decode step of the engine's (2 slots busy: 0.1 s).
    steps = (0.05, 0.1)
    running = [Work(10, 100, "background", done=50, read=10), Work(10, 100, "background")]
    # The first running frees its slot in 50 steps (5 s): the first waiting takes it
    # (and needs its 500-token prompt and 100 steps: 11 s more); the other running one
    # frees its slot after its prompt and 100 steps, for the second waiting.
    ahead = [Work(500, 100, "background"), Work(10, 100, "background")]
    prefill = 10 / rates.prefill_rate("background")
    first, then = starts(rates, 2, running, ahead, steps)
    assert first == pytest.approx(5.0)
    assert then == pytest.approx(10.0 + prefill)
    assert starts(rates, 2, running[:1], ahead[:1], steps) == [0.0]  # a slot is free
    # Measured for its lane and count, the measurement wins.
    rates.observe(lane="background", read=100, generated=101, beside=2, max_tokens=100,
                  prefill_s=0.1, decode_s=5.0)
    assert rates.decode_rate("background", 2, steps) == pytest.approx(20.0)
    assert rates.decode_rate("interactive", 2, steps) == pytest.approx(10.0)
    # Questions that end early do not shorten a batch job's estimate: each lane's share
    # of max_tokens is its own (none measured: all of it).
    for _ in range(5):
        rates.observe(lane="interactive", read=20, generated=8, beside=1, max_tokens=32,
                      prefill_s=0.1, decode_s=0.1)
    assert rates.expected(32, "interactive") < 10
    assert rates.expected(256, "background") == 256
    assert Rates().expected(256, "background") == 256
