"""The CPU-kernel probe: extra buffer types (AMX, repacked weights) only where a child
process showed they run; the verdict cached per CPU, kernel and build; an override."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from daemonhelp import EC, daemon_process, running_daemon

from everycycle import paths
from everycycle.client import connect
from everycycle.hardware import cpukernels
from everycycle.protocol import Tokens


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Path:
    """No verdict yet: neither in the state dir nor remembered by this process."""
    monkeypatch.setattr(cpukernels, "_memo", {})
    cache = paths.state_dir() / cpukernels.CACHE_NAME
    cache.unlink(missing_ok=True)
    monkeypatch.delenv(cpukernels.ENV, raising=False)
    return cache


def test_the_probe_passes_where_the_kernels_run_and_is_cached(fresh: Path,
                                                              tmp_path: Path) -> None:
    verdict = cpukernels.decide(paths.state_dir())
    # This machine's own kernels: the child decoded through them (on an AMX CPU that
    # faults, this is where the verdict turns to off instead).
    done = subprocess.run([*EC[:1], "-m", cpukernels.CHILD, str(tmp_path)], check=False,
                          capture_output=True)
    assert verdict.extra is (done.returncode == 0), done
    assert verdict.source == "probe"
    saved = json.loads(fresh.read_text())
    assert saved == {"key": cpukernels.cache_key(), "extra": verdict.extra,
                     "note": verdict.note}


def test_a_probe_that_dies_by_sigill_turns_the_extra_kernels_off(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The child executes ud2 where it would decode: a real SIGILL from the CPU.
    monkeypatch.setenv(cpukernels.FAULT_ENV, "sigill")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    verdict = cpukernels.decide(paths.state_dir())
    assert verdict.extra is False and verdict.source == "probe"
    assert list(tmp_path.iterdir()) == []  # the dead child's probe model is gone too
    assert verdict.note == ("CPU extra buffer types (AMX, repacked weights) off: a probe "
                            "using them died with SIGILL (illegal instruction)")
    # Cached: the next process reads it and runs no probe (no fault now, same verdict).
    monkeypatch.delenv(cpukernels.FAULT_ENV)
    monkeypatch.setattr(cpukernels, "_memo", {})
    again = cpukernels.decide(paths.state_dir())
    assert (again.extra, again.note, again.source) == (False, verdict.note, "cache")
    # Another CPU, kernel or build: the key differs and the verdict is not used.
    saved = json.loads(fresh.read_text())
    fresh.write_text(json.dumps({**saved, "key": "another machine"}))
    assert cpukernels.cached(paths.state_dir()) is None


def test_the_override(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpukernels.FAULT_ENV, "sigill")  # (a probe would say off)
    monkeypatch.setenv(cpukernels.ENV, "on")
    assert cpukernels.decide(paths.state_dir()) == cpukernels.Verdict(True, None, "override")
    monkeypatch.setenv(cpukernels.ENV, "off")
    off = cpukernels.decide(paths.state_dir())
    assert off.extra is False and off.note is not None and "EVERYCYCLE_CPU_EXTRA=off" in off.note
    assert not fresh.exists()  # no probe ran


@pytest.mark.anyio
async def test_models_load_without_extra_buffers_after_a_sigill(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, models_file: Path) -> None:
    monkeypatch.setenv(cpukernels.FAULT_ENV, "sigill")
    async with running_daemon(models_file) as daemon, connect() as c:
        events = [e async for e in c.generate("tiny", "hello", max_tokens=4,
                                              temperature=0.0)]
        assert isinstance(events[-1], Tokens) and events[-1].finished
        snap = await c.describe_fleet()
        assert daemon.supervisor.residency.models["tiny"].options.extra_bufts is False
    assert snap.cpu_kernels is not None and "SIGILL" in snap.cpu_kernels


def test_fleet_and_models_say_why_in_one_line(
        fresh: Path, models_file: Path) -> None:
    env = {**os.environ, cpukernels.FAULT_ENV: "sigill", "COLUMNS": "120"}
    with daemon_process("--models", str(models_file), env=env):
        fleet = subprocess.run([*EC, "fleet"], capture_output=True, text=True, env=env,
                               timeout=60, check=True)
        as_json = subprocess.run([*EC, "fleet", "--json"], capture_output=True, text=True,
                                 env=env, timeout=60, check=True)
    models = subprocess.run([*EC, "models", "--models", str(models_file)], capture_output=True,
                            text=True, env=env, timeout=60, check=False)
    line = "CPU extra buffer types (AMX, repacked weights) off"
    assert line in fleet.stderr, fleet.stderr
    snapshot = json.loads(as_json.stdout)["FleetDescription"]
    assert snapshot["cpu_kernels"].startswith(line)
    assert line in models.stderr + models.stdout, models
