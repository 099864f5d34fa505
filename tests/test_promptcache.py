"""The prompt cache beyond the slots (engine/promptcache.py): a conversation whose slot
another conversation took is restored from RAM, not prefilled; RAM holds what its limit
allows, the least recently used going to disk; the figures reach the fleet and
/metrics. Real daemon, real engine processes, real llama.cpp state; the cache's own
bookkeeping on its own with byte strings for states."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from daemonhelp import running_daemon
from test_kvdisk import turn

from everycycle import paths
from everycycle.client import connect
from everycycle.engine.kvcache import kvdisk
from everycycle.engine.kvcache.promptcache import PromptCache
from everycycle.protocol import Message, Role


def talk(topic: str) -> tuple[Message, ...]:
    return (Message(Role.USER, f"Tell me about {topic}. " * 40),)


def models(tmp_path: Path, gguf: Path, ram: int) -> Path:
    f = tmp_path / "cache.toml"
    f.write_text(f'[models.m]\npath = "{gguf}"\ncontext = 2048\nparallel = 1\n'
                 f"kv_cache_disk = 0\nkv_cache_ram = {ram}\n")
    return f


@pytest.mark.anyio
async def test_a_conversation_whose_slot_was_taken_is_restored_from_ram(
        tmp_path: Path, tiny_gguf: Path) -> None:
    async with running_daemon(models(tmp_path, tiny_gguf, ram=64)) as d:
        a, b = talk("rivers"), talk("mountains")
        answer_a, first = await turn("m", a)
        await turn("m", b)  # takes the only slot: a's cells go to the cache
        follow = (*a, Message(Role.ASSISTANT, answer_a), Message(Role.USER, "And then?"))
        _, again = await turn("m", follow)
        # everything a's first turn left in the slot (its prompt and the answer's
        # tokens but the last, never decoded) came back from RAM
        assert again.cached_tokens >= first.prompt_tokens
        engine = d.supervisor.residency.models["m"].engine
        await anyio.sleep(2.2)  # (an engine reports its figures every second, and the
        # fleet keeps what it read a second: fleet.FRESH_S)
        assert engine.prompt_cache is not None and engine.prompt_cache.hits == 1
        async with connect() as c:
            fleet = await c.describe_fleet()
        (m,) = fleet.loaded_models
        assert m.prompt_cache_hits == 1 and m.prompt_cache_bytes, m
    assert not list((paths.cache_dir() / "kv").glob("*/*.kv"))  # (no disk store here)


@pytest.mark.anyio
async def test_no_ram_no_cache(tmp_path: Path, tiny_gguf: Path) -> None:
    async with running_daemon(models(tmp_path, tiny_gguf, ram=0)):
        a = talk("rivers")
        answer_a, first = await turn("m", a)
        await turn("m", talk("mountains"))
        follow = (*a, Message(Role.ASSISTANT, answer_a), Message(Role.USER, "And then?"))
        _, again = await turn("m", follow)
        # kv_cache_ram = 0 turns it off: only what the two conversations share (the
        # template's start, "Tell me about ") was reused
        assert again.cached_tokens < 32 < first.prompt_tokens


def test_ram_keeps_its_limit_and_spills_the_least_recently_used(tmp_path: Path) -> None:
    disk = kvdisk.KVDisk(tmp_path, "k", 1 << 20)
    cache = PromptCache(300, disk)
    conv = [tuple(range(i * 1000, i * 1000 + 40)) for i in range(4)]
    cache.keep(conv[0], lambda: b"a" * 100)
    cache.keep(conv[1], lambda: b"b" * 100)
    cache.keep(conv[0] + (7, 8), lambda: b"A" * 110)  # replaces the prefix it extends
    assert list(cache.ram) == [conv[1], conv[0] + (7, 8)] and cache.ram_bytes == 210
    taken: list[int] = []
    cache.keep(conv[1][:35], lambda: taken.append(1) or b"")  # held already: not copied
    assert not taken and list(cache.ram)[-1] == conv[1]  # (and now most recently used)
    cache.keep(conv[2], lambda: b"c" * 100)  # over 300: the least recently used goes
    assert cache.ram_bytes == 200 and conv[0] + (7, 8) not in cache.ram
    assert cache.evictions == 1
    cache.close()  # (the writer thread has written it)
    found = cache.best(conv[0] + (7, 8, 9), 0)
    assert found is not None and found.entry is not None  # on disk now
    assert cache.state(found) == b"A" * 110 and cache.hits == 1
    assert cache.best(conv[3], 0) is None
    assert cache.best(conv[1], len(conv[1])) is None  # not better than the slot's own
