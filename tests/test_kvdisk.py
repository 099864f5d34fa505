"""Cached prefixes survive unloads and restarts (engine/kvdisk.py): a conversation whose
model was unloaded, or whose daemon was stopped, is restored instead of prefilled, gives
the same greedy answer the slot would have given had it kept the prefix, and a changed
GGUF never restores. Real daemon, real engine processes, real llama.cpp state files.

No test here compares a reused prefix with a cold prefill for equality: the prefix holds
the answer's tokens as they were decoded one at a time, a cold prefill computes them in
a batch, and llama.cpp does not promise bit-identical logits across batch sizes (on an
Intel AVX-512 CPU the two answers differ; shared/DESIGN.md, "Prompt cache")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from daemonhelp import running_daemon

from everycycle import paths
from everycycle.client import connect
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Message, Role, Tokens, Usage

pytestmark = pytest.mark.anyio


async def turn(model: str, messages: tuple[Message, ...], n: int = 12
               ) -> tuple[str, Usage]:
    """(the greedy answer, its usage)."""
    async with connect() as c:
        text, usage = "", None
        async for e in c.generate(model, messages=messages, max_tokens=n, temperature=0.0,
                                  usage=True):
            if isinstance(e, Tokens):
                text += e.chunk.text
            elif isinstance(e, Usage):
                usage = e
    assert usage is not None
    return text, usage


def conversation(topic: str) -> tuple[Message, ...]:
    long = " ".join(f"Fact {i} about {topic}: it is item number {i} in a long list of "
                    "notes that the assistant must keep in mind." for i in range(90))
    return (Message(Role.SYSTEM, "You are a careful assistant."),
            Message(Role.USER, long + "\nSummarize the notes in one sentence."))


def registry(tmp_path: Path, gguf: Path, context: int = 4096) -> Path:
    f = tmp_path / "kv.toml"
    f.write_text(f'[models.m]\npath = "{gguf}"\ncontext = {context}\nparallel = 2\n'
                 f'[models.kept]\npath = "{gguf}"\ncontext = {context}\nparallel = 2\n'
                 "kv_cache_disk = 0\n")
    return f


@pytest.mark.shipped
@pytest.mark.timeout(600)  # (two cold prefills of 1,700 tokens on SmolLM2)
async def test_an_evicted_conversation_is_restored_not_prefilled(tmp_path: Path) -> None:
    gguf = local_file(load_registry().get("smollm2-135m"))
    first = conversation("rivers")
    async with running_daemon(registry(tmp_path, gguf)) as d:
        answer, usage = await turn("m", first)
        # "kept": the same weights, the same first turn, its prefix left in its slot
        # (no disk store): the batch history a restore must reproduce exactly.
        kept_answer, _ = await turn("kept", first)
        assert kept_answer == answer  # (two cold prefills of the same prompt)
        follow = (*first, Message(Role.ASSISTANT, answer),
                  Message(Role.USER, "And in one word?"))
        async with connect() as c:
            await c.unload("m")  # its slots' prefixes go to disk
            await c.load("m")
        restored = await turn("m", follow)
        kept = await turn("kept", follow)  # reused from the resident slot
        # prefilled: only what follows the restored prefix (timings are bench/'s business)
        assert restored[1].cached_tokens >= usage.prompt_tokens - 1
        assert kept[1].cached_tokens == restored[1].cached_tokens
        assert restored[0] == kept[0]  # exact: what the slot gives when it keeps the prefix
        assert d.supervisor.residency.models["m"].engine.dead is None
    # after `stop` and a new daemon: the same
    again_follow = (*follow, Message(Role.ASSISTANT, restored[0]),
                    Message(Role.USER, "Thanks."))
    async with running_daemon(registry(tmp_path, gguf)):
        _, again = await turn("m", again_follow)
        assert again.cached_tokens >= restored[1].prompt_tokens - 1, again
    saved = list((paths.cache_dir() / "kv").glob("*/*.kv"))
    assert saved and sum(f.stat().st_size for f in saved) <= 2048 << 20


async def test_a_changed_gguf_never_restores(tmp_path: Path, tiny_gguf: Path) -> None:
    gguf = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf, gguf)
    talk = (Message(Role.USER, "hello world " * 60),)
    async with running_daemon(registry(tmp_path, gguf, context=1024)):
        _, cold = await turn("m", talk)
    async with running_daemon(registry(tmp_path, gguf, context=1024)):
        _, warm = await turn("m", talk)
        assert warm.cached_tokens == cold.prompt_tokens - 1  # restored from disk
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # "a new file"
    async with running_daemon(registry(tmp_path, gguf, context=1024)):
        _, changed = await turn("m", talk)
        assert changed.cached_tokens == 0


async def test_a_larger_context_restores_what_a_smaller_one_saved(
        tmp_path: Path, tiny_gguf: Path) -> None:
    """(a model loaded again with more context, for a client's num_ctx, keeps its
    conversations' prefixes)"""
    talk = (Message(Role.USER, "hello world " * 60),)
    async with running_daemon(registry(tmp_path, tiny_gguf, context=1024)):
        answer, cold = await turn("m", talk)
    async with running_daemon(registry(tmp_path, tiny_gguf, context=4096)):
        again, warm = await turn("m", talk)
    assert warm.cached_tokens == cold.prompt_tokens - 1  # restored from disk
    assert again == answer


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = os.urandom(len(data[mid:mid + 4096]))
    f.write_bytes(bytes(data))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])


@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign"])
async def test_a_damaged_saved_prefix_is_removed_and_prefilled(
        tmp_path: Path, tiny_gguf: Path, damage: str,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A saved state is restored only when its checksum, store and tokens hold: random
    bytes in its middle, a file cut short, or another model's file (same tokens, same
    name, another store) is removed with a warning, and the prompt is prefilled."""
    gguf, other = tmp_path / "copy.gguf", tmp_path / "other.gguf"
    shutil.copy(tiny_gguf, gguf)
    shutil.copy(tiny_gguf, other)
    talk = (Message(Role.USER, "hello world " * 60),)
    async with running_daemon(registry(tmp_path, gguf, context=1024)):
        answer, cold = await turn("m", talk)
    (saved,) = (paths.cache_dir() / "kv").glob("*/*.kv")
    if damage == "foreign":  # the same conversation saved by a different model file
        async with running_daemon(registry(tmp_path, other, context=1024)):
            await turn("m", talk)
        (theirs,) = [f for f in (paths.cache_dir() / "kv").glob("*/*.kv") if f != saved]
        shutil.copy(theirs, saved)
    else:
        (_flip if damage == "flipped" else _truncate)(saved)
    capfd.readouterr()
    async with running_daemon(registry(tmp_path, gguf, context=1024)):
        again, warm = await turn("m", talk)
        assert not saved.exists()  # (until this daemon's unload saves the prefix anew)
    assert warm.cached_tokens == 0 and warm.prompt_tokens == cold.prompt_tokens
    assert again == answer  # (two cold prefills of the same prompt)
    assert "failed its checksum" in capfd.readouterr().err
