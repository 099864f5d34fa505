"""Two lanes: an interactive request takes a slot before queued background work and
parks a running background request (which resumes where it stopped); every waiting
request hears an estimate of its start; fleet, the audit log and /metrics name lanes."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from daemonhelp import EC, Raw, wait_until
from enginehelp import Collector
from httphelp import audit, blocker

from everycycle.client import SyncClient
from everycycle.engine.jobs import Job, JobSpec, Output, Sampling
from everycycle.engine.runner import Runner
from everycycle.protocol import Accepted, Generate, Priority, Tokens, encode


def _job(runner: Runner, tag: str, text: str, n: int, *, background: bool = False,
         temperature: float = 0.0) -> Job:
    return Job(JobSpec(tokens=runner.tokenize(text), max_tokens=n,
                       sampling=Sampling.of(temperature=temperature, seed=7),
                       background_until=time.time() + 600 if background else None), tag=tag)


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
    notify = runner._notify
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
    assert not c.event("bg").is_set()  # it took the only slot while bg waited, parked
    outs = c.wait("bg")
    assert bg.n_parked == 1
    # Resumed, not restarted: every token generated once, to its max_tokens.
    assert outs[-1].reason == "length" and bg.n_generated == 300
    assert sum(len(o.ids) for o in outs) == 300
    assert it.n_generated == 20 and c.outputs["it"][-1].reason == "length"


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


def test_a_background_job_past_its_age_is_not_parked(runner: Runner) -> None:
    c = _log(runner)
    old = Job(JobSpec(tokens=runner.tokenize("old work"), max_tokens=60,
                      sampling=Sampling.of(temperature=0.0),
                      background_until=time.time() - 1), tag="old")
    runner.submit(old)
    wait_until(lambda: len(c.outputs.get("old", [])) >= 3, "the old job to run")
    it = _job(runner, "it", "question", 5)
    runner.submit(it)
    c.wait("it")
    assert old.n_parked == 0 and c.wait("old")[-1].reason == "length"
    assert c.first("end", "old") < c.first("tokens", "it")  # served as an interactive one


def _models(tmp_path: Path, tiny_gguf: Path, parallel: int = 1) -> Path:
    f = tmp_path / "lanes.toml"
    f.write_text(f'default = "tiny"\n[models.tiny]\npath = "{tiny_gguf}"\n'
                 f"context = 4096\nparallel = {parallel}\n")
    return f


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


async def _accepted(raw: Raw, rid: str) -> Accepted:
    event = await raw.next_for(rid)
    assert isinstance(event, Accepted), event
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
            assert (await _accepted(raw, "b1")).queue_position == 2
            assert (await _accepted(raw, "b2")).queue_position == 3
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
        hold.communicate()
    records = [r for r in audit() if r["request_id"] in ("i1", "b1", "b2")]
    assert [r["request_id"] for r in records] == ["i1", "b1", "b2"]


def test_with_background_age_zero_background_work_is_served_as_interactive(
        spawn_daemon: object, tmp_path: Path, tiny_gguf: Path) -> None:
    models = _models(tmp_path, tiny_gguf)
    spawn_daemon("--background-age", "0", models=models)  # type: ignore[operator]
    bg = _run(models, "--background", "-n", "3000", "--temperature", "1", "batch work")
    try:
        it = subprocess.Popen([*EC, "run", "--models", str(models), "-v", "-n", "4",
                               "hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with SyncClient() as c:
            wait_until(lambda: any(r.state == "queued" for r in
                                   c.describe_fleet().requests or ()),
                       "the interactive request to queue behind the old background one")
        bg.kill()
        out, err = it.communicate(timeout=60)
        assert it.returncode == 0 and out
        assert b"queued: position 1, about " in err  # run -v says when it should start
    finally:
        bg.kill()
        bg.communicate()


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


def test_an_estimate_is_an_extension_the_seed_lines_do_not_carry() -> None:
    assert encode(Accepted("r", 2)) == b'{"Accepted":{"request_id":"r","queue_position":2}}\n'
    line = json.loads(encode(Accepted("r", 2, 14000)))
    assert line == {"Accepted": {"request_id": "r", "queue_position": 2, "eta_ms": 14000}}
    rid = uuid.uuid4().hex
    assert b'"priority"' not in encode(Generate(rid, "m", "x"))
