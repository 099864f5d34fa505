"""Every file we write survives concurrent writers and kill -9: real processes, real
files, the real CLI (keys.json, models.toml, the audit log)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehub import FakeHub, serving

from everycycle import paths, statefile
from everycycle.daemon.keys import KeyLimits, KeyStore, keys_file
from everycycle.errors import FileBusyError

EC = [sys.executable, "-m", "everycycle"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"

# One writer process: ROUNDS times add key NAME-i, then remove every other one again.
WRITER = r"""
import sys
from everycycle.daemon.keys import KeyStore, KeyLimits
name, rounds = sys.argv[1], int(sys.argv[2])
store = KeyStore()
for i in range(rounds):
    store.add(f"{name}-{i}", KeyLimits(requests_per_minute=60))
    print(f"added {name}-{i}", flush=True)
    if i % 2:
        store.remove(f"{name}-{i}")
        print(f"removed {name}-{i}", flush=True)
"""


# The same for models.toml, through the functions `models add` and `rm` use.
MODEL_WRITER = r"""
import sys
from everycycle.models.userfile import add_user_entry, remove_user_entry
name, rounds, gguf = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for i in range(rounds):
    add_user_entry(f"{name}-{i}", {"path": gguf, "context": 256})
    print(f"added {name}-{i}", flush=True)
    if i % 2:
        remove_user_entry(f"{name}-{i}")
        print(f"removed {name}-{i}", flush=True)
"""


def _writers(n: int, rounds: int, code: str = WRITER, *args: str
             ) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-c", code, f"w{k}", str(rounds), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for k in range(n)]


def _acknowledged(procs: list[subprocess.Popen[str]]) -> set[str]:
    expected: set[str] = set()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        for line in out.splitlines():
            verb, name = line.split()
            if verb == "added":
                expected.add(name)
            else:
                expected.discard(name)
    return expected


def test_eight_processes_changing_models_toml_lose_nothing(tiny_gguf: Path) -> None:
    expected = _acknowledged(_writers(8, 20, MODEL_WRITER, str(tiny_gguf)))
    entries = tomllib.loads(paths.user_models_file().read_text())["models"]
    assert set(entries) == expected and len(expected) == 8 * 10


def test_eight_processes_changing_the_key_file_lose_nothing() -> None:
    expected = _acknowledged(_writers(8, 20))
    on_file = json.loads(keys_file().read_text())["keys"]
    assert set(on_file) == expected and len(expected) == 8 * 10
    assert not list(keys_file().parent.glob("*.tmp"))  # no temporary file left behind


def test_a_writer_killed_mid_way_leaves_the_file_whole() -> None:
    (victim,) = _writers(1, 10_000)
    assert victim.stdout is not None
    for _ in range(30):  # let it write a while, then kill -9 wherever it is
        victim.stdout.readline()
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    KeyStore().keys()  # parses (raises ConfigError otherwise)
    # Its lock died with it: the next writer does not wait for it (a lock held by the
    # dead would block here for good: the test's timeout is the hang guard).
    KeyStore().add("after", KeyLimits())
    assert "after" in set(KeyStore().keys())


def test_eight_keys_add_at_once_through_the_cli() -> None:
    procs = [subprocess.Popen([*EC, "keys", "add", f"k{i}", "--rpm", "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(8)]
    secrets = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        secrets.append(out.strip())
    listed = subprocess.run([*EC, "keys", "list", "--json"], capture_output=True, text=True,
                            timeout=60, check=True)
    names = {json.loads(line)["name"] for line in listed.stdout.splitlines()}
    assert names >= {f"k{i}" for i in range(8)}
    store = KeyStore()
    for i, secret in enumerate(secrets):  # every secret printed authenticates
        principal = store.authenticate(secret.split()[-1])
        assert principal is not None and principal.name == f"k{i}"


def test_a_held_lock_names_its_holder_and_changes_nothing() -> None:
    KeyStore().add("before", KeyLimits())
    text = keys_file().read_text()
    with statefile.locked(keys_file()):
        out = subprocess.run([*EC, "keys", "add", "blocked"], capture_output=True, text=True,
                             timeout=60, check=False)
    assert out.returncode == 4, out.stderr
    assert f"pid {os.getpid()}" in out.stderr and "nothing was changed" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert keys_file().read_text() == text
    # (flock locks are per open file: a second open in one process waits too)
    with (statefile.locked(keys_file()), pytest.raises(FileBusyError),
          statefile.locked(keys_file(), timeout=0.2)):
        pass


def test_audit_lines_stay_whole_under_concurrent_appends(tmp_path: Path) -> None:
    target = tmp_path / "audit.jsonl"
    code = ("import sys; from pathlib import Path; from everycycle import statefile\n"
            "for i in range(200):\n"
            "    statefile.append(Path(sys.argv[1]), sys.argv[2] * 5000 + str(i),"
            " max_bytes=400_000)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(target), c]) for c in "abcd"]
    for p in procs:
        assert p.wait(120) == 0
    lines = [ln for f in (target.with_name("audit.jsonl.1"), target) if f.exists()
             for ln in f.read_text().splitlines()]
    assert lines and all(len(set(ln.rstrip("0123456789"))) == 1 for ln in lines)
    assert all(len(ln.rstrip("0123456789")) == 5000 for ln in lines)


@pytest.fixture
def hub(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = FakeHub()
    server.add("o/r", COMMIT, "tiny.gguf", tiny_gguf.read_bytes())
    with serving(server, monkeypatch):
        yield server


def test_eight_models_add_at_once_keep_every_entry(hub: FakeHub) -> None:
    procs = [subprocess.Popen([*EC, "models", "add", f"m{i}", "hf://o/r/tiny.gguf"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(8)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    entries = tomllib.loads(paths.user_models_file().read_text())["models"]
    assert set(entries) == {f"m{i}" for i in range(8)}
    procs = [subprocess.Popen([*EC, "rm", f"m{i}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(0, 8, 2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    entries = tomllib.loads(paths.user_models_file().read_text())["models"]
    assert set(entries) == {f"m{i}" for i in range(1, 8, 2)}

