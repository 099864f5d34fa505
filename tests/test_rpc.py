"""Past one host: remote executors over llama.cpp's RPC backend, and a fleet of daemons.

The RPC tests need a llama.cpp built with ``-DGGML_RPC=on`` (the CI's Vulkan job has
one): they skip elsewhere, and fail instead with EVERYCYCLE_REQUIRE_RPC=1. The
fleet-of-daemons tests run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, greedy_ids, wait_until

from everycycle.client import SyncClient
from everycycle.daemon.keys import load_or_create_token
from everycycle.hardware import rpc
from everycycle.protocol import Error, ErrorKind, FleetDescription, Tokens, decode_event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def rpc_build() -> None:
    if not rpc.available():
        if os.environ.get("EVERYCYCLE_REQUIRE_RPC") == "1":
            pytest.fail("this job needs llama.cpp's RPC backend, and the build lacks it")
        pytest.skip("this llama.cpp build has no RPC backend (-DGGML_RPC=on): the CI's "
                    "Vulkan job runs these")


@pytest.fixture
def rpc_server(rpc_build: None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real `everycycle rpc-serve` on loopback; yields (endpoint, process)."""
    port = free_port()
    proc = subprocess.Popen([*EC, "rpc-serve", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    endpoint = f"127.0.0.1:{port}"

    def listening() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        return rpc.reachable(endpoint, timeout=0.5)

    try:
        wait_until(listening, "rpc-serve to listen")
        yield endpoint, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stderr:
            proc.stderr.close()


def models_for(tmp_path: Path, tiny_gguf: Path, endpoint: str) -> Path:
    f = tmp_path / "rpc.toml"
    f.write_text('default = "local"\n'
                 f'[models.local]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 2\n'
                 'executor = "cpu"\n'
                 f'[models.remote]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 2\n'
                 f'executor = "rpc:{endpoint}/0"\n'
                 f'[models.split]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 2\n'
                 f'executor = "rpc:{endpoint}/0"\ngpu_layers = 1\n')
    return f




@pytest.mark.rpc
def test_a_remote_executor_serves_like_a_local_one(
        rpc_server: tuple[str, subprocess.Popen[bytes]], spawn_daemon: SpawnDaemon,
        tmp_path: Path, tiny_gguf: Path) -> None:
    endpoint, _ = rpc_server
    spawn_daemon("--rpc", endpoint, models=models_for(tmp_path, tiny_gguf, endpoint))
    with SyncClient() as c:
        remote = next(e for e in c.describe_fleet().executors
                      if e.name == f"rpc:{endpoint}/0")
        assert remote.vendor == "remote" and remote.status is None
        assert remote.memory_total and remote.memory_free
        local_ids = greedy_ids(c, "local")
        assert greedy_ids(c, "remote") == local_ids  # the same CPU arithmetic, over the wire
        m = next(m for m in c.describe_fleet().loaded_models if m.name == "remote")
        assert m.assigned_executor == f"rpc:{endpoint}/0" and m.device_layers == 2
        # One model per RPC server at a time (it serves one client): said, not hung.
        with pytest.raises(Exception, match="serves one model at a time"):
            greedy_ids(c, "split")
        c.unload("remote")
        assert len(greedy_ids(c, "split")) == 24  # one layer remote, one local
        m = next(m for m in c.describe_fleet().loaded_models if m.name == "split")
        assert (m.device_layers, m.total_layers) == (1, 2)


@pytest.mark.rpc
def test_losing_the_remote_host_fails_its_request_and_nothing_else(
        rpc_server: tuple[str, subprocess.Popen[bytes]], spawn_daemon: SpawnDaemon,
        tmp_path: Path, tiny_gguf: Path) -> None:
    endpoint, server = rpc_server
    spawn_daemon("--rpc", endpoint, models=models_for(tmp_path, tiny_gguf, endpoint))
    with SyncClient() as c:
        greedy_ids(c, "remote", 2)
        got = 0
        last = None
        for event in c.generate("remote", "go", max_tokens=30000, temperature=1.0):
            if isinstance(event, Tokens):
                got += 1
                if got == 5:
                    server.send_signal(signal.SIGKILL)
            last = event
        assert isinstance(last, Error) and last.kind is ErrorKind.INTERNAL, last
        assert endpoint in last.message, last.message
        assert len(greedy_ids(c, "local")) == 24  # the daemon and its other models serve on
        # The next request for the remote model says the host is gone.
        events = list(c.generate("remote", "again", max_tokens=2))
        assert isinstance(events[-1], Error) and endpoint in events[-1].message
        row = next(e for e in c.describe_fleet().executors if endpoint in e.name)
        assert row.status == "unreachable"
    out = subprocess.run([*EC, "fleet"], capture_output=True, text=True, timeout=60,
                         check=True, env={**os.environ, "COLUMNS": "160"})
    assert "unreachable" in out.stderr


@pytest.mark.rpc
def test_a_host_down_at_start_is_shown_and_named(rpc_build: None, spawn_daemon: SpawnDaemon,
                                                 tmp_path: Path, tiny_gguf: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nobody listens there
    spawn_daemon("--rpc", endpoint, models=models_for(tmp_path, tiny_gguf, endpoint))
    with SyncClient() as c:
        row = next(e for e in c.describe_fleet().executors if endpoint in e.name)
        assert row.status == "unreachable" and row.device_count == 0
        events = list(c.generate("remote", "x", max_tokens=2))
        assert isinstance(events[-1], Error) and events[-1].kind is ErrorKind.INTERNAL
        assert f"RPC host {endpoint} is unreachable" in events[-1].message
        assert len(greedy_ids(c, "local", 4)) == 4


def test_rpc_serve_refuses_what_it_cannot_do_in_one_line() -> None:
    out = subprocess.run([*EC, "rpc-serve", "--host", "0.0.0.0"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and "no authentication" in out.stderr
    assert "Traceback" not in out.stderr
    if not rpc.available():
        out = subprocess.run([*EC, "rpc-serve", "--port", str(free_port())],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and "-DGGML_RPC=on" in out.stderr.splitlines()[-1]
        assert "Traceback" not in out.stderr
    bad = subprocess.run([*EC, "daemon", "--rpc", "nowhere"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 2 and "expected HOST:PORT" in bad.stderr


# ---------------------------------------------------------------------- a fleet of daemons

def test_fleet_shows_several_daemons_in_one_view(spawn_daemon: SpawnDaemon,
                                                 tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    socks = [tmp_path / "a.sock", tmp_path / "b.sock"]
    for port, sock in zip(ports, socks, strict=True):
        spawn_daemon("--tcp", f"127.0.0.1:{port}", sock=sock)
    with SyncClient(socks[0]) as c:
        greedy_ids(c, "tiny", 2)  # one of them has a model loaded
    hosts = [f"127.0.0.1:{p}" for p in ports]
    args = [a for h in hosts for a in ("--host", h)]
    out = subprocess.run([*EC, "fleet", *args, "--json"], capture_output=True, text=True,
                         timeout=60, check=True)
    snaps = [decode_event(line.encode()) for line in out.stdout.splitlines()]
    assert len(snaps) == 2 and all(isinstance(s, FleetDescription) for s in snaps)
    loaded = [len(s.snapshot.loaded_models) for s in snaps]  # type: ignore[union-attr]
    assert loaded == [1, 0]
    assert all(json.loads(line) for line in out.stdout.splitlines())
    table = subprocess.run([*EC, "fleet", *args, "--host", str(socks[1])], capture_output=True,
                           text=True, timeout=60, check=True,
                           env={**os.environ, "COLUMNS": "120"})
    for h in hosts:
        assert h in table.stderr
    assert "total: 3 daemons" in table.stderr and "1 loaded models" in table.stderr
    if not rpc.available():  # the fleet says plainly what this build cannot do
        assert "no RPC backend (needs -DGGML_RPC=on)" in table.stderr
    # A daemon that is down: the others are shown, it is named, and the exit code says so.
    down = subprocess.run([*EC, "fleet", *args, "--host", f"127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert down.returncode == 69 and "total: 2 daemons" in down.stderr
    assert "; 1 unreachable" in down.stderr and "Traceback" not in down.stderr
    # A wrong key is refused by each daemon, in one line each.
    bad = subprocess.run([*EC, "fleet", *args, "--token", "wrong"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode == 69 and bad.stderr.count("invalid token") == 2
    assert load_or_create_token()  # the default key is what --host used above

