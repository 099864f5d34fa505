"""Bad model files, unwritable audit logs, killed clients and daemons: nothing is lost."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import anyio
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, Raw, accepted, daemon_process, running_daemon, wait_until
from httphelp import audit

from everycycle import paths
from everycycle.client import SyncClient
from everycycle.errors import ErrorKind
from everycycle.protocol import Error, Generate, Load, Tokens, encode, is_terminal


def bad_models(tmp_path: Path, tiny_gguf: Path) -> Path:
    data = tiny_gguf.read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (tmp_path / "header-only.gguf").write_bytes(data[:64])
    (tmp_path / "random.gguf").write_bytes(os.urandom(4096))
    (tmp_path / "dir.gguf").mkdir()
    # a GGUF whose metadata names a tensor layout the file lacks: a wrong block count
    (tmp_path / "missing-tensor.gguf").write_bytes(
        data.replace(b"llama.block_count\x04\x00\x00\x00\x02", b"llama.block_count\x04\x00\x00\x00\x03", 1)
    )
    f = tmp_path / "bad.toml"
    f.write_text("".join(
        f'[models.{name}]\npath = "{name}.gguf"\ncontext = 256\nparallel = 1\n'
        for name in ("truncated", "header-only", "random", "dir", "missing-tensor", "absent")
    ) + f'[models.tiny]\npath = "{tiny_gguf}"\ncontext = 256\nparallel = 1\n')
    return f


@pytest.mark.anyio
async def test_broken_model_files_give_clear_errors_and_the_daemon_serves_on(
    tmp_path: Path, tiny_gguf: Path
) -> None:
    models = bad_models(tmp_path, tiny_gguf)
    assert b"llama.block_count\x04\x00\x00\x00\x03" in (tmp_path / "missing-tensor.gguf").read_bytes()
    async with running_daemon(models), Raw.open() as c:
        for name in ("truncated", "header-only", "random", "dir", "missing-tensor", "absent"):
            await c.send(encode(Load(f"l-{name}", name)))
            ev = await c.next()
            assert isinstance(ev, Error), name
            assert ev.kind in (ErrorKind.INVALID, ErrorKind.INTERNAL), (name, ev)
            assert ev.message and name in ev.message, (name, ev.message)
        await c.send(encode(Generate("ok", "tiny", "hello", max_tokens=3, temperature=0.0)))
        events = await c.until_terminal("ok")
        assert events[0] == accepted("ok", 0) and is_terminal(events[-1])


@pytest.mark.anyio
async def test_an_unwritable_audit_log_does_not_stop_requests(
    models_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths.audit_file().mkdir(parents=True)  # a directory where the log file should be
    async with running_daemon(models_file), Raw.open() as c:
        for rid in ("a1", "a2"):
            await c.send(encode(Generate(rid, "tiny", "hi", max_tokens=2, temperature=0.0)))
            end = (await c.until_terminal(rid))[-1]
            assert isinstance(end, Tokens) and end.finished
    errors = [r for r in caplog.records if r.levelname == "ERROR" and "audit" in r.getMessage()]
    assert len(errors) == 1


@pytest.fixture
def daemon_proc(spawn_daemon: SpawnDaemon) -> subprocess.Popen[bytes]:
    return spawn_daemon()


def long_run(models_file: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "8000",
                             "--temperature", "1", "x"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.read(1)  # streaming now
    return proc


def active_requests() -> int:
    with SyncClient() as c:
        return c.describe_fleet().active_requests


def test_a_killed_client_frees_its_slot(daemon_proc: subprocess.Popen[bytes],
                                        models_file: Path) -> None:
    client = long_run(models_file)
    client.kill()
    client.communicate()
    wait_until(lambda: active_requests() == 0, "the slot to be freed", timeout=5)
    with SyncClient() as c:
        first = next(iter(c.generate("tiny", "hi", max_tokens=2)))
    assert first == accepted(first.request_id, 0)  # type: ignore[union-attr]


def test_a_killed_daemon_leaves_clients_an_exit_code_and_restarts_cleanly(
    daemon_proc: subprocess.Popen[bytes], models_file: Path
) -> None:
    client = long_run(models_file)
    daemon_proc.kill()
    daemon_proc.wait()
    _, err = client.communicate(timeout=20)
    assert client.returncode == 69 and b"everycycle:" in err, err
    sock = paths.socket_path()
    assert sock.exists() and paths.pid_file_for(sock).exists()  # what a SIGKILL leaves
    with daemon_process("--models", str(models_file)) as again:
        assert active_requests() == 0
        again.send_signal(signal.SIGTERM)
        assert again.wait(20) == 0


def test_sigint_gives_every_request_its_cancelled_event(
    daemon_proc: subprocess.Popen[bytes],
) -> None:
    async def go() -> list[list[object]]:
        async with Raw.open() as c:
            for rid in ("t1", "t2", "t3"):
                await c.send(encode(Generate(rid, "tiny", "x", max_tokens=8000,
                                             temperature=1.0, seed=2)))
            assert await c.next() == accepted("t1", 0)
            daemon_proc.send_signal(signal.SIGINT)
            return [await c.until_terminal(rid) for rid in ("t1", "t2", "t3")]

    results = anyio.run(go)
    for events in results:
        end = events[-1]
        assert isinstance(end, Error) and end.kind is ErrorKind.CANCELLED
        assert end.message == "daemon shutting down"
    assert daemon_proc.wait(20) == 0
    assert not paths.socket_path().exists()
    assert [a["outcome"] for a in audit()][-3:] == ["Cancelled"] * 3


@pytest.mark.anyio
async def test_a_dead_engine_fails_its_requests_and_the_daemon_serves_on(
    models_file: Path,
) -> None:
    async with running_daemon(models_file) as daemon, Raw.open() as c:
        await c.send(encode(Load("l", "tiny")))
        await c.until_terminal("l")
        # Fault injection: the model's engine is gone under the supervisor's feet.
        await anyio.to_thread.run_sync(daemon.supervisor.residency.models["tiny"].engine.close)
        await c.send(encode(Generate("g", "tiny", "hi", max_tokens=2)))
        events = await c.until_terminal("g")
        assert isinstance(events[-1], Error) and events[-1].kind is ErrorKind.INTERNAL
        await c.send(b'{"DescribeFleet":{"request_id":"f"}}')
        assert (await c.next()).snapshot.active_requests == 0  # type: ignore[union-attr]
        await c.send(encode(Generate("ok", "tiny4", "hi", max_tokens=2, temperature=0.0)))
        assert isinstance((await c.until_terminal("ok"))[-1], Tokens)
