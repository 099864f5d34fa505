"""The daemon's events, live: ``GET /v1/events`` (SSE) and the socket's ``Subscribe``, on a
real daemon, with what a user would see driven for real: a load, requests queued at
positions 1 and 2 then running and finished, an eviction, an engine crash and its
restart; and the state machine and the bus's bounds on their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from daemonhelp import EC, wait_until
from httphelp import EventReader as Reader
from httphelp import blocker, fleet_http

from everycycle.client import SyncClient
from everycycle.daemon import events as ev
from everycycle.protocol import Done, Error, Notice, Subscribe


@pytest.fixture
def stream(spawn_daemon: Any) -> Iterator[tuple[str, Reader]]:
    spawn_daemon("--http", "127.0.0.1:0", "--max-loaded-models", "1", "--http-heartbeat", "1")
    url = fleet_http()
    reader = Reader(f"{url}/v1/events")
    yield url, reader
    reader.close()


def test_a_load_a_queue_an_eviction_and_a_crash_are_seen_as_they_happen(
        stream: tuple[str, Reader], models_file: Path) -> None:
    _, seen = stream
    hold = blocker(models_file)  # loads tiny and holds its one slot
    waiting = [subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "2", "hi"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for _ in range(2)]
    try:
        wait_until(lambda: len({e["request_id"] for e in seen.of("request", state="queued")
                                if e.get("position")}) == 2, "two requests queued")
        assert seen.of("model_loaded", model="tiny")
        positions = sorted({e["position"] for e in seen.of("request", state="queued")
                            if e.get("position")})
        assert positions == [1, 2]
        hold.kill()
        for p in waiting:
            assert p.wait(60) == 0
        queued = {e["request_id"] for e in seen.of("request", state="queued")}
        wait_until(lambda: all(seen.of("request", request_id=r, state="finished")
                               for r in queued), "the queued requests to finish")
        for rid in queued:
            states = [e["state"] for e in seen.of("request", request_id=rid)]
            assert states.index("queued") < states.index("running") < states.index("finished")
            (end,) = seen.of("request", request_id=rid, state="finished")
            assert end["outcome"] == "finished" and end["usage"]["output_tokens"] == 2
    finally:
        hold.kill()
        hold.communicate()
    # Another model past --max-loaded-models 1: tiny is evicted for it, and says why.
    with SyncClient() as c:
        c.load("tiny4")
        wait_until(lambda: seen.of("model_evicted", model="tiny", for_model="tiny4"),
                   "the eviction")
        assert seen.of("model_unloaded", model="tiny", why="evicted")
        # Its engine dies: the death and the restart, in that order.
        pid = next(m.engine_pid for m in c.describe_fleet().loaded_models if m.name == "tiny4")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: seen.of("engine_restarted", model="tiny4"), "the restart")
    died = seen.of("engine_died", model="tiny4")
    assert died and "SIGKILL" in died[0]["cause"]
    assert seen.events.index(died[0]) < seen.events.index(seen.of("engine_restarted")[0])


def test_each_cancel_says_its_cause(stream: tuple[str, Reader], models_file: Path) -> None:
    """A deadline, a client's Cancel, a client that goes away and a model unloaded under
    its requests end them all as Cancelled, each with its own cause (their messages are
    what users always read)."""
    _, seen = stream
    long = {"max_tokens": 8000, "temperature": 1.0}
    with SyncClient() as c:
        c.load("tiny")
        ended = list(c.generate("tiny", "x", request_id="by-deadline", deadline_ms=300, **long))
        assert isinstance(ended[-1], Error) and "deadline of 300 ms" in ended[-1].message
        got: list[Any] = []

        def held(rid: str) -> threading.Thread:
            def run() -> None:
                with SyncClient() as mine:
                    got.extend(mine.generate("tiny", "x", request_id=rid, **long))
            t = threading.Thread(target=run)
            t.start()
            wait_until(lambda: seen.of("request", request_id=rid, state="running"), rid)
            return t

        t = held("by-cancel")
        c.cancel("by-cancel")
        t.join(30)
        t = held("by-unload")
        c.unload("tiny")
        t.join(30)
    before = {e["request_id"] for e in seen.of("request")}
    gone = subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "8000",
                             "--temperature", "1", "x"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert gone.stdout is not None
    gone.stdout.read(1)
    gone.kill()
    gone.communicate()
    (leaving,) = {e["request_id"] for e in seen.of("request")} - before
    causes = {"by-deadline": "deadline", "by-cancel": "client", "by-unload": "unload",
              leaving: "disconnect"}
    wait_until(lambda: all(seen.of("request", request_id=r, state="finished") for r in causes),
               "every request's end")
    for rid, cause in causes.items():
        (end,) = seen.of("request", request_id=rid, state="finished")
        assert (end["outcome"], end.get("cause")) == ("Cancelled", cause), end


def test_a_key_over_its_quota_is_told(spawn_daemon: Any) -> None:
    made = subprocess.run([*EC, "keys", "add", "ci", "--rpm", "1"], capture_output=True,
                          text=True, timeout=60, check=True)
    spawn_daemon("--http", "127.0.0.1:0")
    url = fleet_http()
    seen = Reader(f"{url}/v1/events?types=key_limit")
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 1}
        auth = {"authorization": f"Bearer {made.stdout.strip()}"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth,
                          timeout=60).status_code == 200
        refused = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
        assert refused.status_code == 429
        wait_until(lambda: seen.events, "the key_limit event")
        (hit,) = seen.events
        assert (hit["principal"], hit["limit"], hit["model"]) == (
            "ci", "requests_per_minute", "tiny")
        assert hit["retry_after_s"] > 0
    finally:
        seen.close()


def test_a_type_filter_and_bad_types(stream: tuple[str, Reader]) -> None:
    url, _ = stream
    only = Reader(f"{url}/v1/events?types=model_loaded")
    try:
        with SyncClient() as c:
            c.load("tiny")
            wait_until(lambda: only.events, "the load")
            c.unload("tiny")
        assert {e["type"] for e in only.events} == {"model_loaded"}
        wait_until(lambda: only.comments >= 2, "a heartbeat comment")  # (1 s heartbeat)
    finally:
        only.close()
    r = httpx.get(f"{url}/v1/events?types=request,nope", timeout=30)
    assert r.status_code == 400 and "no event type 'nope'" in r.json()["error"]["message"]


def test_a_socket_subscription_hears_events_until_cancelled(spawn_daemon: Any) -> None:
    spawn_daemon()
    got: list[Any] = []
    with SyncClient() as c, SyncClient() as other:

        def listen() -> None:
            got.extend(c.request(Subscribe("sub-1", ("request",))))

        t = threading.Thread(target=listen)
        t.start()
        wait_until(lambda: bool(got), "the subscription's Accepted")
        list(other.generate("tiny", "hello", max_tokens=2))
        wait_until(lambda: any(isinstance(e, Notice) and '"finished"' in e.data for e in got),
                   "the request's end")
        other.cancel("sub-1")
        t.join(30)
        assert isinstance(got[-1], Done)
        notices = [json.loads(e.data) for e in got if isinstance(e, Notice)]
        assert {n["type"] for n in notices} == {"request"}
        bad = list(other.request(Subscribe("sub-2", ("nope",))))
        assert isinstance(bad[-1], Error) and "no event type" in bad[-1].message


def test_the_state_machine_refuses_illegal_moves() -> None:
    S, I = ev.RequestState, ev.RequestInput
    assert ev.next_state(S.ADMITTING, I.QUEUE) is S.QUEUED
    assert ev.next_state(S.QUEUED, I.START) is S.RUNNING
    assert ev.next_state(S.RUNNING, I.PARK) is S.PARKED
    assert ev.next_state(S.PARKED, I.RESUME) is S.RUNNING
    assert ev.next_state(S.WAITING, I.GIVE_WAY) is S.WAITING  # (staying: no move)
    for state in S:
        if state is not S.FINISHED:
            assert ev.next_state(state, I.FINISH) is S.FINISHED
    for old, happened in ((S.RUNNING, I.QUEUE), (S.FINISHED, I.START), (S.QUEUED, I.LOAD),
                          (S.FINISHED, I.FINISH), (S.QUEUED, I.PARK), (S.RUNNING, I.RESUME),
                          (S.PARKED, I.START)):
        with pytest.raises(ev.IllegalTransition, match=f"cannot {happened.value} while"):
            ev.next_state(old, happened)


def test_every_state_but_the_first_is_reached_and_every_live_one_can_finish() -> None:
    S = ev.RequestState
    reached = {new for (_, _), new in ev.MOVES.items()}
    assert reached == set(S)  # (admitting too: again, after a load or a wait)
    assert all((state, ev.RequestInput.FINISH) in ev.MOVES for state in S
               if state is not S.FINISHED)


def test_a_reader_that_falls_behind_is_cut_off_with_a_last_event() -> None:
    bus = ev.Bus()
    slow = bus.subscribe(limit=3)
    picky = bus.subscribe(frozenset({"model_loaded"}), limit=3)
    for i in range(10):
        bus.publish(ev.ModelUnloaded(model=f"m{i}", why="idle", message="idle"))
    assert bus.subscribers == 1  # the slow one is gone; the picky one took none of them
    items = list(slow.box._items)
    assert len(items) == 4 and isinstance(items[-1], ev.CutOff)
    assert not picky.box
