"""Idle unload: keep_alive from the daemon, models.toml and each request; an unload never
cuts a running request; fleet says when each model goes."""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path

import anyio
import pytest
from daemonhelp import EC, running_daemon
from modelshelp import Entry, models_toml

from everycycle.client import connect
from everycycle.models.keepalive import parse_keep_alive
from everycycle.protocol import Error, LoadedModel, Tokens

pytestmark = pytest.mark.anyio


def short_lived(tmp_path: Path, tiny_gguf: Path, keep_alive: str | int) -> Path:
    return models_toml(tmp_path / "short.toml", Entry(
        "tiny", tiny_gguf, context=512, parallel=2,
        more={"keep_alive": keep_alive}), default="tiny")


async def loaded(name: str = "tiny") -> LoadedModel | None:
    async with connect() as c:
        snap = await c.describe_fleet()
    return next((m for m in snap.loaded_models if m.name == name), None)


async def gone_within(seconds: float, name: str = "tiny", *,
                      not_before: float = -math.inf) -> None:
    """Poll the fleet until ``name`` is unloaded, within ``seconds``. Each answer that
    came before the monotonic time ``not_before`` must show it still loaded."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        gone = await loaded(name) is None
        if time.monotonic() < not_before:
            assert not gone, f"{name} unloaded {not_before - time.monotonic():.2f} s early"
        elif gone:
            return
        await anyio.sleep(0.05)
    raise AssertionError(f"{name} still loaded after {seconds} s")


async def test_an_idle_model_is_unloaded_after_its_keep_alive(tmp_path: Path,
                                                              tiny_gguf: Path) -> None:
    models = short_lived(tmp_path, tiny_gguf, "1s")
    async with running_daemon(models), connect() as c:
        used = time.monotonic()  # the request begins and ends after this: its idle clock too
        [e async for e in c.generate("tiny", "hi", max_tokens=2)]
        m = await loaded()
        assert m is not None and m.keep_alive_ms == 1000
        assert m.unload_in_ms is not None and 0 < m.unload_in_ms <= 1000
        await gone_within(10, not_before=used + 1.0)
        # The next request loads it again, and its clock starts again.
        used = time.monotonic()
        assert [e async for e in c.generate("tiny", "hi", max_tokens=2)][-1].finished
        await gone_within(10, not_before=used + 1.0)


async def test_a_request_sets_keep_alive_from_then_on(tmp_path: Path, tiny_gguf: Path) -> None:
    models = short_lived(tmp_path, tiny_gguf, "1s")
    async with running_daemon(models), connect() as c:
        [e async for e in c.generate("tiny", "hi", max_tokens=2, keep_alive_ms=-1)]
        m = await loaded()
        assert m is not None and m.keep_alive_ms == -1 and m.unload_in_ms is None
        await anyio.sleep(1.5)
        assert await loaded() is not None  # never
        used = time.monotonic()
        await c.load("tiny", keep_alive_ms=300)
        await gone_within(10, not_before=used + 0.3)


async def test_an_unload_never_cuts_a_running_request(tmp_path: Path, tiny_gguf: Path) -> None:
    models = short_lived(tmp_path, tiny_gguf, 0)  # unload as soon as idle
    async with running_daemon(models), connect() as c:
        events = [e async for e in c.generate("tiny", "go", max_tokens=300, temperature=1.0,
                                              seed=3)]
        assert not any(isinstance(e, Error) for e in events)
        assert sum(len(e.chunk.ids) for e in events if isinstance(e, Tokens)) == 300
        # Two requests overlapping: the model stays while either runs.
        async with anyio.create_task_group() as tg:
            results: list[list[object]] = []

            async def one(seed: int) -> None:
                results.append([e async for e in c.generate(
                    "tiny", "go", max_tokens=200, temperature=1.0, seed=seed)])

            tg.start_soon(one, 1)
            tg.start_soon(one, 2)
        assert all(not any(isinstance(e, Error) for e in r) for r in results)
        await gone_within(10)


async def test_the_daemon_default_and_fleet_view(models_file: Path) -> None:
    async with running_daemon(models_file, keep_alive=3600.0), connect() as c:
        [e async for e in c.generate("tiny", "hi", max_tokens=2)]
        m = await loaded()
        assert m is not None and m.keep_alive_ms == 3_600_000
        out = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [*EC, "fleet"], capture_output=True, text=True, timeout=60, check=True,
            env={**os.environ, "COLUMNS": "160"}))
        assert "in 59m5" in out.stderr or "in 1h00m" in out.stderr, out.stderr


def test_keep_alive_forms() -> None:
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive(-1) == -1 and parse_keep_alive("never") == -1
    assert parse_keep_alive(0) == 0
    with pytest.raises(ValueError, match="use seconds"):
        parse_keep_alive("soon")


def test_a_bad_keep_alive_is_one_line(models_file: Path) -> None:
    out = subprocess.run([*EC, "daemon", "--models", str(models_file), "--keep-alive", "soon"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert out.stderr.startswith("everycycle: --keep-alive 'soon': use seconds")
    bad = models_file.parent / "bad.toml"
    bad.write_text('[models.x]\npath = "x.gguf"\nkeep_alive = "soon"\n')
    out = subprocess.run([*EC, "models", "--models", str(bad)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and "keep_alive = 'soon': use seconds" in out.stderr
    assert "Traceback" not in out.stderr
