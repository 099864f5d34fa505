"""Residency: a model loads once however many requests ask for it at once; a load that
fails fails every request that waited for it, with one message; while it loads, the
fleet says so."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio
import pytest
from daemonhelp import running_daemon
from modelshelp import Entry, models_toml

from everycycle import paths
from everycycle.client import connect
from everycycle.protocol import Error, ErrorKind, LoadedModel, ServerEvent, Tokens

pytestmark = pytest.mark.anyio


async def _all_at_once(model: str, n: int) -> list[list[ServerEvent]]:
    results: list[list[ServerEvent]] = [[] for _ in range(n)]

    async def one(i: int) -> None:
        async with connect() as c:
            results[i] = [e async for e in c.generate(model, f"hello {i}", max_tokens=3,
                                                      temperature=0.0)]

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return results


async def test_sixteen_first_requests_cause_one_load_and_all_finish(
        tmp_path: Path, tiny_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    models = models_toml(tmp_path / "m.toml", Entry("tiny", tiny_gguf, context=512,
                                                     parallel=4))
    caplog.set_level(logging.INFO, logger="everycycle.daemon.residency")
    seen: list[LoadedModel] = []
    async with running_daemon(models) as daemon:
        sup = daemon.supervisor

        async def watch() -> None:
            while True:
                seen.extend(m for m in sup.snapshot().loaded_models if m.state == "loading")
                await anyio.sleep(0.005)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            results = await _all_at_once("tiny", 16)
            tg.cancel_scope.cancel()
        assert sup.residency.loads == 1
        assert len(sup.residency.models) == 1
    assert all(isinstance(r[-1], Tokens) and r[-1].finished for r in results), results
    loaded = [r for r in caplog.records if r.getMessage().startswith("loaded tiny on")]
    assert len(loaded) == 1
    audited = [json.loads(x) for x in paths.audit_file().read_text().splitlines()]
    assert [r["model"] for r in audited if r.get("event") == "load"] == ["tiny"]
    assert sum(1 for r in audited if "request_id" in r) == 16
    assert seen and seen[0].name == "tiny" and max(m.queued or 0 for m in seen) >= 2


async def test_a_load_that_fails_fails_every_waiter_with_one_message(
        tmp_path: Path, tiny_gguf: Path) -> None:
    # Its metadata reads (the memory plan is made), its tensors are cut off: llama.cpp
    # refuses it in the engine process, after the other requests have come.
    broken = tmp_path / "broken.gguf"
    data = tiny_gguf.read_bytes()  # noqa: ASYNC240 - a test fixture file, before serving
    broken.write_bytes(data[:len(data) // 2])
    models = models_toml(tmp_path / "m.toml", Entry("broken", broken, context=512,
                                                     parallel=4))
    async with running_daemon(models) as daemon:
        results = await _all_at_once("broken", 8)
        assert daemon.supervisor.residency.loads == 1
        assert daemon.supervisor.residency.loading == {}
    ends = [r[-1] for r in results]
    assert all(isinstance(e, Error) for e in ends), ends
    assert len({(e.kind, e.message) for e in ends if isinstance(e, Error)}) == 1
    assert all(e.kind is not ErrorKind.CANCELLED for e in ends if isinstance(e, Error))
