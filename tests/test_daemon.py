"""The daemon's invariants, each on the real daemon, a real Unix socket and real llama.cpp."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import anyio
import pytest
from daemonhelp import Raw, accepted, running_daemon
from httphelp import audit

from everycycle import paths
from everycycle.client import connect
from everycycle.daemon.keys import load_or_create_token
from everycycle.daemon.server import Daemon, DaemonConfig
from everycycle.daemon.supervisor import Limits
from everycycle.errors import (
    AlreadyRunningError,
    ConfigError,
    DaemonUnavailableError,
    ErrorKind,
    RequestFailedError,
)
from everycycle.protocol import (
    MAX_LINE_BYTES,
    Accepted,
    DescribeFleet,
    Done,
    Error,
    FleetDescription,
    Generate,
    Tokens,
    encode,
    is_terminal,
)

pytestmark = pytest.mark.anyio


def gen(rid: str, model: str = "tiny", prompt: str = "hello", **kw: object) -> bytes:
    return encode(Generate(rid, model, prompt, temperature=0.0, **kw))  # type: ignore[arg-type]


LONG = {"max_tokens": 8000, "temperature": 1.0, "seed": 1}


def long_gen(rid: str, model: str = "tiny", **kw: object) -> bytes:
    # A sampled stream on a random model: long enough to still be running when poked.
    return encode(Generate(rid, model, "the", **{**LONG, **kw}))  # type: ignore[arg-type]


async def test_generate_streams_accepted_then_tokens_then_one_terminal(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(gen("r1", max_tokens=8))
        events = await c.until_terminal("r1")
        assert events[0] == accepted("r1", 0)
        assert all(isinstance(e, Tokens) for e in events[1:])
        assert [is_terminal(e) for e in events] == [False] * (len(events) - 1) + [True]
        # nothing after the terminal event: the next thing on the wire answers the next request
        await c.send(encode(Done("x")).replace(b"Done", b"Shutdown"))
        assert await c.next() == Done("x")


async def test_queue_positions_for_four_requests_on_one_slot(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        # q0 runs until cancelled, so all three others are queued behind it whatever
        # the timing (a short q0 can finish on the tiny model before q3 is admitted).
        await c.send(long_gen("q0"))
        for i in range(1, 4):
            await c.send(long_gen(f"q{i}", max_tokens=30))
        firsts = {rid: await c.next_for(rid) for rid in ("q0", "q1", "q2", "q3")}
        assert firsts == {f"q{i}": accepted(f"q{i}", i) for i in range(4)}
        # (Accepted comes at admission, while the model may still load: wait until q0
        # runs and the three are in its queue before the queue moves)
        async with Raw.open() as probe:
            for _ in range(500):
                await probe.send(encode(DescribeFleet("f")))
                answer = await probe.next()
                assert isinstance(answer, FleetDescription), answer
                if any(m.name == "tiny" and m.queued == 3
                       for m in answer.snapshot.loaded_models):
                    break
                await anyio.sleep(0.01)
            else:
                raise AssertionError("q1-q3 were never all queued")
        await c.send(b'{"Cancel":{"request_id":"c","target":"q0"}}')
        positions: dict[str, list[int]] = {}
        for rid in ("q0", "q1", "q2", "q3"):
            evs = [firsts[rid], *await c.until_terminal(rid)]
            positions[rid] = [e.queue_position for e in evs if isinstance(e, Accepted)]
        assert positions["q0"] == [0]
        assert positions["q1"] == [1, 0]
        assert positions["q2"] == [2, 1, 0]
        assert positions["q3"] == [3, 2, 1, 0]


async def test_cancel_a_running_request(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c, Raw.open() as other:
        await c.send(long_gen("run"))
        assert await c.next() == accepted("run", 0)
        await other.send(b'{"Cancel":{"request_id":"c1","target":"run"}}')
        assert await other.next() == Done("c1")
        end = (await c.until_terminal("run"))[-1]
        assert isinstance(end, Error) and end.kind is ErrorKind.CANCELLED


async def test_cancel_a_queued_request(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(long_gen("a"))
        await c.send(long_gen("b"))
        while await c.next() != accepted("b", 1):
            pass
        await c.send(b'{"Cancel":{"request_id":"c","target":"b"}}')
        b = await c.until_terminal("b")
        assert len(b) == 1 and isinstance(b[0], Error) and b[0].kind is ErrorKind.CANCELLED
        await c.send(b'{"Cancel":{"request_id":"c2","target":"a"}}')
        assert isinstance((await c.until_terminal("a"))[-1], Error)


async def test_cancel_of_an_unknown_request_is_invalid(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(b'{"Cancel":{"request_id":"c","target":"nobody"}}')
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID


@pytest.mark.parametrize("queued", [False, True])
async def test_deadline_while_running_and_while_queued(models_file: Path, queued: bool) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        if queued:
            await c.send(long_gen("blocker"))
        await c.send(long_gen("d", deadline_ms=300))
        end = (await c.until_terminal("d"))[-1]
        assert isinstance(end, Error) and end.kind is ErrorKind.CANCELLED
        assert "deadline of 300 ms" in end.message


async def test_disconnect_frees_the_slot(models_file: Path) -> None:
    async with running_daemon(models_file) as daemon:
        async with Raw.open() as c:
            await c.send(long_gen("gone"))
            assert await c.next() == accepted("gone", 0)
            assert isinstance(await c.next(), Tokens)
        with anyio.fail_after(5):  # freed within a decode step of noticing the disconnect
            while daemon.supervisor.snapshot().active_requests:  # noqa: ASYNC110 - outside view
                await anyio.sleep(0.01)
        async with Raw.open() as c:
            await c.send(gen("next", max_tokens=4))
            assert await c.next() == accepted("next", 0)
            await c.until_terminal("next")
        assert daemon.supervisor.snapshot().active_requests == 0


async def test_queue_full_is_rejected(models_file: Path) -> None:
    async with running_daemon(models_file, limits=Limits(max_queue=1)), Raw.open() as c:
        for rid in ("a", "b", "c"):
            await c.send(long_gen(rid))
        end = (await c.until_terminal("c"))[-1]
        assert isinstance(end, Error) and end.kind is ErrorKind.REJECTED
        assert "queue full" in end.message


async def test_per_connection_inflight_limit(models_file: Path) -> None:
    async with running_daemon(models_file, limits=Limits(max_inflight=1)), Raw.open() as c:
        await c.send(long_gen("a"))
        await c.send(long_gen("b"))
        end = (await c.until_terminal("b"))[-1]
        assert isinstance(end, Error) and end.kind is ErrorKind.REJECTED


async def test_duplicate_request_id_is_invalid(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(long_gen("dup"))
        assert await c.next() == accepted("dup", 0)
        await c.send(long_gen("dup"))
        while True:
            ev = await c.next()
            if isinstance(ev, Error):
                break
        assert ev.kind is ErrorKind.INVALID and "already active" in ev.message


async def test_malformed_line_keeps_the_connection_usable(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(b"{nope")
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID and ev.request_id == ""
        await c.send(b'{"Generate":{"request_id":"m1","model":"tiny","prompt":"x","top_p":9}}')
        ev = await c.next()
        assert isinstance(ev, Error) and ev.request_id == "m1"
        await c.send(gen("ok", max_tokens=2))
        assert (await c.until_terminal("ok"))[0] == accepted("ok", 0)


async def test_overlong_line_gets_invalid_and_closes(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(b"x" * (MAX_LINE_BYTES + 10))
        assert await c.closed()
        ev = c.buffer[0]
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID


async def test_unknown_model_is_invalid_and_model_not_loaded_without_auto_load(
    models_file: Path,
) -> None:
    async with running_daemon(models_file, auto_load=False), Raw.open() as c:
        await c.send(gen("u", model="nope"))
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID
        await c.send(gen("n"))
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.MODEL_NOT_LOADED
        await c.send(gen("o", auto_load=True))
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.MODEL_NOT_LOADED


async def test_auto_load_false_on_the_request(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(gen("n", auto_load=False))
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.MODEL_NOT_LOADED


async def test_load_unload_and_fleet(models_file: Path) -> None:
    async with running_daemon(models_file), connect() as client:
        await client.load("tiny4")
        fleet = await client.describe_fleet()
        assert [m.name for m in fleet.loaded_models] == ["tiny4"]
        model = fleet.loaded_models[0]
        assert model.assigned_executor == "cpu" and model.slots == 4
        assert [e.name for e in fleet.executors] == ["cpu"]
        await client.unload("tiny4")
        assert (await client.describe_fleet()).loaded_models == ()
        with pytest.raises(RequestFailedError) as info:
            await client.unload("tiny4")
        assert info.value.kind is ErrorKind.INVALID
        with pytest.raises(RequestFailedError) as info:
            await client.load("tiny", executor="cuda")
        assert info.value.kind is ErrorKind.INVALID
        with pytest.raises(RequestFailedError) as info:
            await client.load("missing")
        assert info.value.kind is ErrorKind.INVALID


async def test_unload_cancels_active_requests(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(long_gen("a"))
        await c.send(long_gen("b"))
        assert await c.next_for("a") == accepted("a", 0)
        assert isinstance(await c.next_for("a"), Tokens)  # running now: tiny is loaded
        await c.send(b'{"Unload":{"request_id":"u","model":"tiny"}}')
        ends = {rid: (await c.until_terminal(rid))[-1] for rid in ("a", "b")}
        assert all(isinstance(e, Error) and e.kind is ErrorKind.CANCELLED for e in ends.values())
        assert (await c.until_terminal("u")) == [Done("u")]


async def test_shutdown_with_requests_in_flight(models_file: Path) -> None:
    sock = paths.socket_path()
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(long_gen("a"))
        await c.send(long_gen("b"))
        await c.send(b'{"Shutdown":{"request_id":"s"}}')
        for rid in ("a", "b"):
            end = (await c.until_terminal(rid))[-1]
            assert isinstance(end, Error) and end.kind is ErrorKind.CANCELLED
            assert end.message == "daemon shutting down"
        assert (await c.until_terminal("s")) == [Done("s")]
        assert await c.closed()
    assert not sock.exists()
    assert not paths.pid_file_for(sock).exists()


async def test_socket_is_private(models_file: Path) -> None:
    async with running_daemon(models_file):
        sock = paths.socket_path()
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


async def test_a_second_daemon_is_refused(models_file: Path) -> None:
    async with running_daemon(models_file):
        with pytest.raises(AlreadyRunningError, match=f"pid {os.getpid()}"):
            await Daemon(DaemonConfig(models_file=models_file)).run()


async def test_a_stale_socket_is_replaced(models_file: Path) -> None:
    sock = paths.socket_path()
    paths.ensure_private_dir(sock.parent)
    import socket as pysocket

    s = pysocket.socket(pysocket.AF_UNIX)
    s.bind(str(sock))  # bound, never listening: what a killed daemon leaves
    s.close()
    paths.pid_file_for(sock).write_text("999999\n")
    async with running_daemon(models_file), connect() as client:
        assert (await client.describe_fleet()).active_requests == 0


async def test_a_world_writable_socket_dir_is_refused(models_file: Path, tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        await Daemon(DaemonConfig(socket=d / "s.sock", models_file=models_file)).run()


async def test_client_without_daemon_is_unavailable() -> None:
    with pytest.raises(DaemonUnavailableError):
        async with connect():
            pass


async def test_tcp_requires_the_token(models_file: Path) -> None:
    async with running_daemon(models_file, tcp=("127.0.0.1", 0)) as daemon:
        port = daemon.tcp_port
        assert port
        token = load_or_create_token()
        assert stat.S_IMODE(paths.token_file().stat().st_mode) == 0o600
        for first in (b'{"DescribeFleet":{"request_id":"f"}}\n', b'{"Auth":{"token":"wrong"}}\n'):
            stream = await anyio.connect_tcp("127.0.0.1", port)
            async with stream:
                await stream.send(first + b'{"DescribeFleet":{"request_id":"g"}}\n')
                data = b""
                with anyio.fail_after(10):
                    try:
                        while True:
                            data += await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass
                lines = data.splitlines()
                assert len(lines) == 1 and b'"Error"' in lines[0]
        async with connect(tcp=("127.0.0.1", port), token=token) as client:
            fleet = await client.describe_fleet()
            assert fleet.executors[0].name == "cpu"
        audit = [json.loads(x) for x in paths.audit_file().read_text().splitlines()]
        assert [a["outcome"] for a in audit if a.get("event") == "auth"] == ["missing", "refused"]


async def test_tcp_refuses_a_non_loopback_address_without_allow_remote(models_file: Path) -> None:
    with pytest.raises(ConfigError, match="--allow-remote"):
        Daemon(DaemonConfig(models_file=models_file, tcp=("0.0.0.0", 0)))


async def test_audit_log_records_finished_requests(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(gen("au", max_tokens=3))
        await c.until_terminal("au")
    rec = audit()[-1]
    assert rec["request_id"] == "au" and rec["model"] == "tiny" and rec["executor"] == "cpu"
    assert rec["outcome"] == "Finished" and rec["prompt_tokens"] > 0
    assert "prompt" not in rec


async def test_many_requests_interleave_on_one_connection(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        for i in range(4):
            await c.send(gen(f"m{i}", model="tiny4", prompt=f"hello {i}", max_tokens=6))
        for i in range(4):
            evs = await c.until_terminal(f"m{i}")
            assert evs[0] == accepted(f"m{i}", 0) and is_terminal(evs[-1])


async def test_prompt_and_max_tokens_bounds_are_invalid(models_file: Path) -> None:
    limits = Limits(max_prompt_bytes=100, max_tokens=50)
    async with running_daemon(models_file, limits=limits), Raw.open() as c:
        await c.send(gen("big", prompt="x" * 101))
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID and "100 bytes" in ev.message
        await c.send(gen("many", max_tokens=51))
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID and "max_tokens" in ev.message
        await c.send(gen("fits", prompt="x" * 100, max_tokens=50))
        assert (await c.until_terminal("fits"))[0] == accepted("fits", 0)


async def test_prompt_longer_than_the_context_is_invalid(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(gen("long", model="tiny4", prompt="hello " * 400))
        first, *rest = await c.until_terminal("long")
        assert first == accepted("long", 0)  # admitted while tiny4 loads
        [ev] = rest
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID
        assert "context holds 512" in ev.message
        # resident now: refused before anything is queued
        await c.send(gen("long2", model="tiny4", prompt="hello " * 400))
        [ev] = await c.until_terminal("long2")
        assert isinstance(ev, Error) and "context holds 512" in ev.message


async def test_sync_client_streams_and_reports_errors(models_file: Path) -> None:
    from everycycle.client import SyncClient

    def use() -> tuple[list[object], ErrorKind]:
        with SyncClient() as client:
            events = list(client.generate("tiny", "hello", max_tokens=3, temperature=0.0))
            assert client.describe_fleet().loaded_models[0].name == "tiny"
            with pytest.raises(RequestFailedError) as info:
                client.cancel("nobody")
            return events, info.value.kind

    async with running_daemon(models_file):
        events, kind = await anyio.to_thread.run_sync(use)
    assert isinstance(events[0], Accepted) and is_terminal(events[-1])  # type: ignore[arg-type]
    assert kind is ErrorKind.INVALID


async def test_model_paths_only_on_the_unix_socket_and_absolute(models_file: Path,
                                                                tiny_gguf: Path) -> None:
    async with running_daemon(models_file, tcp=("127.0.0.1", 0)) as daemon, Raw.open() as c:
        await c.send(gen("p", model=str(tiny_gguf), max_tokens=2))
        assert (await c.until_terminal("p"))[0] == accepted("p", 0)
        await c.send(gen("rel", model="models/tiny.gguf"))
        ev = await c.next()
        assert isinstance(ev, Error) and "absolute" in ev.message
        await c.send(gen("etc", model="/etc/passwd.gguf"))
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID
        assert daemon.tcp_port
        async with connect(tcp=("127.0.0.1", daemon.tcp_port),
                           token=load_or_create_token()) as client:
            events = [e async for e in client.generate(str(tiny_gguf), "x", max_tokens=2)]
        assert len(events) == 1 and isinstance(events[0], Error)
        assert "not allowed on this connection" in events[0].message


async def test_slots_are_freed_on_every_path(models_file: Path) -> None:
    async with running_daemon(models_file) as daemon:
        async with Raw.open() as c:
            await c.send(gen("fin", max_tokens=3))
            await c.until_terminal("fin")
            await c.send(gen("stop", max_tokens=50, stop=("e", "a", "o", "i", "t", " ")))
            await c.until_terminal("stop")
            await c.send(long_gen("cxl"))
            assert await c.next() == accepted("cxl", 0)
            await c.send(b'{"Cancel":{"request_id":"k","target":"cxl"}}')
            await c.until_terminal("cxl")
            await c.until_terminal("k")
            await c.send(long_gen("dl", deadline_ms=100))
            await c.until_terminal("dl")
            await c.send(long_gen("gone"))
            assert await c.next() == accepted("gone", 0)
        with anyio.fail_after(5):
            while daemon.supervisor.snapshot().active_requests:  # noqa: ASYNC110 - outside view
                await anyio.sleep(0.01)
        (model,) = daemon.supervisor.snapshot().loaded_models
        assert (model.busy, model.queued) == (0, 0)
        async with Raw.open() as c:
            await c.send(gen("after", max_tokens=2))
            assert (await c.until_terminal("after"))[0] == accepted("after", 0)


async def test_shutdown_through_the_async_client_returns_though_the_daemon_closes(
    models_file: Path,
) -> None:
    for _ in range(3):  # Done and the end of the connection arrive together
        async with running_daemon(models_file), connect() as client:
            await client.shutdown()
