"""Making room: a model that does not fit unloads idle models, least recently used first;
a busy, queued, loading or pinned model is never unloaded; max_loaded_models caps how
many stay. Memory budgets come from the test-only override of the free-memory figure
(EVERYCYCLE_TEST_MEMORY), which placement reads as it reads the hardware's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
from daemonhelp import running_daemon
from httphelp import fleet_http, raw
from tinymodel import write_tiny_gguf

from everycycle import paths
from everycycle.client import connect
from everycycle.daemon.residency import room
from everycycle.hardware.memory import plan
from everycycle.protocol import Accepted, Error, ErrorKind, ServerEvent, Tokens

pytestmark = pytest.mark.anyio

CONTEXT = 256


def registry(tmp_path: Path, tiny_gguf: Path, names: str = "abc", extra: str = "",
             top: str = "") -> Path:
    """Models ``a``, ``b``, ``c``…: each the tiny GGUF, one slot of CONTEXT tokens."""
    f = tmp_path / "room.toml"
    f.write_text(top + "".join(f'[models.{n}]\npath = "{tiny_gguf}"\ncontext = {CONTEXT}\n'
                               f"parallel = 1\n{extra if n == 'a' else ''}" for n in names))
    return f


def budget(tiny_gguf: Path, models: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host memory for ``models`` of them (the tiny model's own plan, times that)."""
    need = plan(tiny_gguf, context=CONTEXT, parallel=1).total
    monkeypatch.setenv("EVERYCYCLE_TEST_MEMORY", f"cpu={int(need * models)}")


async def ask(model: str) -> list[ServerEvent]:
    async with connect() as c:
        return [e async for e in c.generate(model, "hello", max_tokens=3, temperature=0.0)]


async def started(stream: AsyncIterator[ServerEvent]) -> ServerEvent:
    """Read ``stream`` up to its first Tokens (the model is decoding it)."""
    async for e in stream:
        if isinstance(e, Tokens | Error):
            return e
    raise AssertionError("the stream ended")


async def until(check: Callable[[], object]) -> None:
    """Return once ``check()`` is true, within 30 s (polling: what it reads has no
    event)."""
    with anyio.fail_after(30):
        while True:
            if check():
                return
            await anyio.sleep(0.01)


def answered(events: list[ServerEvent]) -> bool:
    return isinstance(events[-1], Tokens) and events[-1].finished


def evictions() -> list[dict[str, object]]:
    return [r for r in map(json.loads, paths.audit_file().read_text().splitlines())
            if r.get("event") == "evict"]


async def test_the_third_model_unloads_the_least_recently_used_idle_one(
        tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget(tiny_gguf, 2.5, monkeypatch)
    async with running_daemon(registry(tmp_path, tiny_gguf), http=("127.0.0.1", 0)) as d:
        sup = d.supervisor
        for name in ("a", "b", "a"):  # b is now the least recently used
            assert answered(await ask(name))
        assert set(sup.residency.models) == {"a", "b"}
        assert answered(await ask("c"))
        assert set(sup.residency.models) == {"a", "c"}
        [record] = evictions()
        assert (record["model"], record["for_model"], record["reason"]) == ("b", "c", "memory")
        snap = sup.snapshot()
        assert snap.last_eviction is not None
        assert snap.last_eviction.startswith("last eviction: 'b' for 'c' at ")
        assert snap.last_eviction.endswith(" (memory)")
        loads = [r for r in map(json.loads, paths.audit_file().read_text().splitlines())
                 if r.get("event") == "load"]
        assert [r["model"] for r in loads] == ["a", "b", "c"]
        url = await anyio.to_thread.run_sync(fleet_http)
        _, _, metrics = await anyio.to_thread.run_sync(raw, url, "GET", "/metrics")
        assert b'everycycle_model_evictions_total{reason="memory"} 1.0' in metrics
        # The free memory the fleet shows is the budget less what the two models hold.
        await sup.residency.measure()
        [cpu] = [e for e in sup.snapshot().executors if e.name == "cpu"]
        assert cpu.memory_free is not None and cpu.memory_total is not None
        assert cpu.memory_free < cpu.memory_total / 2


async def test_a_request_for_memory_a_busy_model_holds_waits_for_it(
        tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget(tiny_gguf, 1.5, monkeypatch)
    async with running_daemon(registry(tmp_path, tiny_gguf, "ab")) as d:
        sup = d.supervisor
        async with connect() as c, connect() as c2:
            stream = c.generate("a", "hello", max_tokens=600, temperature=1.0)
            assert isinstance(await started(stream), Tokens)  # a is decoding now
            waiting = c2.generate("b", "hello", max_tokens=3, temperature=0.0)
            first = await waiting.__anext__()  # admitted at once, with its place
            # ... and when it should start: b is a's file, whose load was measured.
            assert isinstance(first, Accepted) and first.queue_position == 0
            assert first.eta_ms is not None and first.eta_ms > 0
            await until(lambda: sup.residency.room_waits.why("b"))
            [loading] = [m for m in sup.snapshot().loaded_models if m.name == "b"]
            assert loading.state is not None
            assert loading.state.startswith("waiting for memory: held by 'a' (")
            assert loading.state.endswith("busy)")
            assert loading.state == f"waiting for memory: held by {loading.held_by}"
            assert set(sup.residency.models) == {"a"}  # a is never cut off
            rest = [e async for e in stream]
            assert answered(rest)
            assert answered([first, *[e async for e in waiting]])
        assert set(sup.residency.models) == {"b"}
        [record] = evictions()
        assert (record["model"], record["for_model"]) == ("a", "b")


async def test_a_queued_request_keeps_its_model(
        tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget(tiny_gguf, 1.5, monkeypatch)
    async with running_daemon(registry(tmp_path, tiny_gguf, "ab")) as d:
        sup = d.supervisor
        async with connect() as c1, connect() as c2, anyio.create_task_group() as tg:
            running = c1.generate("a", "hello", max_tokens=300, temperature=1.0)
            assert isinstance(await started(running), Tokens)
            queued = c2.generate("a", "hi", max_tokens=3, temperature=0.0)
            accepted = await queued.__anext__()  # one slot, one running: it waits
            assert isinstance(accepted, Accepted) and accepted.queue_position == 1
            assert sup.requests.lane("a").queue
            later: list[list[ServerEvent]] = []

            async def for_b() -> None:
                later.append(await ask("b"))

            tg.start_soon(for_b)
            assert answered([e async for e in running])
            assert answered([e async for e in queued])  # on a, which stayed for it
        assert answered(later[0]) and set(sup.residency.models) == {"b"}
        assert [r["model"] for r in evictions()] == ["a"]


async def _greedy(model: str, i: int) -> str:
    async with connect() as c:
        events = [e async for e in c.generate(model, f"hello {i}", max_tokens=6,
                                              temperature=0.0)]
    assert answered(events), events[-1]
    return "".join(e.chunk.text for e in events if isinstance(e, Tokens))


async def keep_busy(model: str, stop: anyio.Event) -> None:
    """Requests for ``model`` one after another until ``stop``."""
    async with connect() as c:
        while not stop.is_set():
            events = [e async for e in c.generate(model, "hello", max_tokens=200,
                                                  temperature=1.0)]
            assert answered(events), events[-1]


async def test_sixteen_requests_for_two_models_with_room_for_one(
        tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The scenario: 16 requests at once, alternating a, b, a, b, with room for
    # one model of 8 slots. Every one is answered, greedy-identical to the same request
    # with both resident, in at most 4 loads.
    f = tmp_path / "two.toml"
    f.write_text("".join(f'[models.{n}]\npath = "{tiny_gguf}"\ncontext = {CONTEXT}\n'
                         "parallel = 8\n" for n in "ab"))
    async with running_daemon(f) as d:  # both resident: the reference answers
        expected = {i: await _greedy("ab"[i % 2], i) for i in range(16)}
        assert set(d.supervisor.residency.models) == {"a", "b"}
    paths.audit_file().unlink()
    got: dict[int, str] = {}

    async def one(i: int) -> None:
        got[i] = await _greedy("ab"[i % 2], i)

    async with running_daemon(f, max_loaded_models=1) as d:
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
        loads = d.supervisor.residency.loads
    assert got == expected
    assert loads <= 4, loads


async def test_a_stream_of_requests_for_one_model_does_not_starve_the_other(
        tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget(tiny_gguf, 1.5, monkeypatch)
    stop = anyio.Event()

    async with running_daemon(registry(tmp_path, tiny_gguf, "ab")) as d:
        assert answered(await ask("a"))
        async with anyio.create_task_group() as tg:
            for _ in range(3):  # one slot, three of these: a is never idle
                tg.start_soon(keep_busy, "a", stop)
            await anyio.sleep(0.5)
            started_at = anyio.current_time()
            with anyio.fail_after(90):  # (starved, it would wait for ever)
                events = await ask("b")
            waited = anyio.current_time() - started_at
            stop.set()
        assert answered(events)
        # The bound: a gives way once b has waited SWAP_AFTER_S (and a has been resident
        # MIN_RESIDENCY_S), then a's running requests finish (short ones here).
        # (not before: a was never idle, so only the bound let b in)
        assert waited >= room.SWAP_AFTER_S * 0.9, waited
        [record, *_] = [r for r in map(json.loads, paths.audit_file().read_text().splitlines())
                        if r.get("event") == "room_wait" and r["model"] == "b"]
        assert (record["model"], record["outcome"]) == ("b", "placed")
        assert record["waited_s"] >= room.SWAP_AFTER_S * 0.9 and "'a' (" in record["held_by"]
        assert "a" in d.supervisor.residency.models  # a came back for its own requests


async def test_a_load_nobody_waits_for_is_given_up(
        tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget(tiny_gguf, 1.5, monkeypatch)
    stop = anyio.Event()

    async with running_daemon(registry(tmp_path, tiny_gguf, "ab")) as d:
        sup = d.supervisor
        assert answered(await ask("a"))
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(keep_busy, "a", stop)
            await anyio.sleep(0.2)
            async with connect() as c2:
                late = [e async for e in c2.generate("b", "hello", max_tokens=3,
                                                     deadline_ms=400)]
            assert isinstance(late[0], Accepted)  # admitted while its model waited
            assert isinstance(late[-1], Error) and late[-1].kind is ErrorKind.CANCELLED
            await until(lambda: "b" not in sup.residency.loading)
            assert sup.residency.room_waits.why("b") is None
            assert set(sup.residency.models) == {"a"}  # a went on; b never loaded
            stop.set()
        assert evictions() == [] and sup.residency.loads == 2  # (a's, and b's given up)


@pytest.mark.parametrize("pin", ["pin = true\n", 'keep_alive = "-1"\n'])
async def test_a_pinned_model_is_not_unloaded(
        tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, pin: str) -> None:
    budget(tiny_gguf, 1.5, monkeypatch)
    async with running_daemon(registry(tmp_path, tiny_gguf, "ab", extra=pin)) as d:
        assert answered(await ask("a"))
        refused = await ask("b")
        assert isinstance(refused[-1], Error) and "'a' (" in refused[-1].message
        assert "pinned)" in refused[-1].message
        assert set(d.supervisor.residency.models) == {"a"} and evictions() == []


async def test_max_loaded_models_one_alternating_twenty_times(
        tmp_path: Path, tiny_gguf: Path) -> None:
    models = registry(tmp_path, tiny_gguf, "ab", top="max_loaded_models = 1\n")
    async with running_daemon(models) as d:
        sup = d.supervisor
        texts: dict[str, set[str]] = {"a": set(), "b": set()}
        for i in range(20):
            name = "ab"[i % 2]
            events = await ask(name)
            assert answered(events), events
            texts[name].add("".join(e.chunk.text for e in events if isinstance(e, Tokens)))
            assert list(sup.residency.models) == [name]
        assert all(len(t) == 1 for t in texts.values())  # greedy: the same answer each time
        assert sup.residency.evictions == {"max_loaded_models": 19}
        assert sup.residency.loads == 20


async def test_max_loaded_models_from_the_daemon_flag_waits_while_none_is_idle(
        tmp_path: Path, tiny_gguf: Path) -> None:
    async with running_daemon(registry(tmp_path, tiny_gguf, "ab"), max_loaded_models=1) as d, \
            connect() as c:
        stream = c.generate("a", "hello", max_tokens=300, temperature=1.0)
        assert isinstance(await started(stream), Tokens)
        async with anyio.create_task_group() as tg:
            later: list[list[ServerEvent]] = []

            async def for_b() -> None:
                later.append(await ask("b"))

            tg.start_soon(for_b)
            await until(lambda: d.supervisor.residency.room_waits.why("b"))
            why = d.supervisor.residency.room_waits.why("b")
            assert why is not None and "'a' (" in why and "busy)" in why
            assert answered([e async for e in stream])
        assert answered(later[0])


async def test_a_load_that_cannot_allocate_is_refused_with_the_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_gguf: Path) -> None:
    # The host "reports" 1000 GiB (the override), so placement lets through a KV cache no
    # machine here has: llama.cpp's own allocation fails, for real, and the request gets
    # the numbers; the daemon goes on serving.
    mem = Path("/proc/meminfo").read_text().split()  # noqa: ASYNC240 - before serving
    ram = int(mem[mem.index("MemTotal:") + 1]) + int(mem[mem.index("SwapTotal:") + 1])
    if ram > 400 << 20:  # KiB: a machine that might grant 512 GiB at once
        pytest.skip("this machine might allocate the test's 512 GiB KV cache")
    # 128 KiB of KV cache per cell (wide heads), in few cells: llama.cpp's per-cell
    # bookkeeping stays small, and its buffer's one allocation is the one that fails.
    wide = write_tiny_gguf(tmp_path / "wide.gguf", head_dim=4096)
    models = tmp_path / "huge.toml"
    models.write_text(f'[models.huge]\npath = "{wide}"\ncontext = 1048576\nparallel = 4\n'
                      f'[models.tiny]\npath = "{tiny_gguf}"\ncontext = 256\nparallel = 1\n')
    monkeypatch.setenv("EVERYCYCLE_TEST_MEMORY", "cpu=1000GiB")
    async with running_daemon(models) as d:
        refused = await ask("huge")
        assert isinstance(refused[-1], Error) and refused[-1].kind is ErrorKind.REJECTED
        message = refused[-1].message
        assert "model 'huge' could not be allocated on cpu (it needs 524" in message, message
        assert "cpu reports 1024000 MiB free" in message
        assert "llama.cpp could not allocate the KV cache" in message
        assert d.supervisor.residency.models == {}
        assert answered(await ask("tiny"))


async def test_a_prompt_cache_gives_way_before_a_model_does(
        tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget(tiny_gguf, 2.5, monkeypatch)
    need = plan(tiny_gguf, context=CONTEXT, parallel=1).total
    async with running_daemon(registry(tmp_path, tiny_gguf, "ab",
                                       extra="kv_cache_ram = 64\n")) as d:
        sup = d.supervisor
        async with connect() as c:  # two conversations on a's one slot: one is cached
            for topic in ("rivers", "mountains"):
                [e async for e in c.generate("a", f"Tell me about {topic}. " * 5,
                                             max_tokens=3, temperature=0.0)]
        engine = sup.residency.models["a"].engine
        await until(lambda: engine.prompt_cache and engine.prompt_cache.ram_bytes)
        assert engine.prompt_cache is not None
        cached = engine.prompt_cache.ram_bytes
        # room for both models, but not for a's cache too
        monkeypatch.setenv("EVERYCYCLE_TEST_MEMORY", f"cpu={2 * need + cached // 2}")
        assert answered(await ask("b"))
        assert set(sup.residency.models) == {"a", "b"} and not evictions()
        assert engine.prompt_cache.ram_bytes == 0
