"""Conversations (``Generate.messages``) and the edges of request lifetimes, through the
real daemon on a real socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest
from daemonhelp import Raw, accepted, running_daemon
from httphelp import audit
from modelshelp import Entry, models_toml

from everycycle.client import connect
from everycycle.daemon.supervisor import Limits
from everycycle.engine.worker.runner import Runner
from everycycle.errors import ErrorKind, RequestFailedError
from everycycle.protocol import (
    Error,
    Format,
    Generate,
    Message,
    Role,
    Tokens,
    Usage,
    encode,
)

pytestmark = pytest.mark.anyio


def convo(*turns: tuple[str, str]) -> tuple[Message, ...]:
    return tuple(Message(Role(role), text) for role, text in turns)


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_messages_are_rendered_with_the_chat_template(models_file: Path,
                                                           tiny_gguf: Path) -> None:
    turns = convo(("system", "be brief"), ("user", "hello"), ("assistant", "hi"),
                  ("user", "again"))
    async with running_daemon(models_file, audit_prompts=True) as daemon, connect() as client:
        events = [e async for e in client.generate("tiny", messages=turns, max_tokens=4,
                                                   temperature=0.0)]
        assert events[0] == accepted(events[0].request_id, 0)  # type: ignore[union-attr]
        assert isinstance(events[-1], Tokens) and events[-1].finished
        assert daemon.supervisor.residency.models["tiny"].engine.pid is not None
    # the template, applied by hand to the same turns in this process
    runner = Runner(tiny_gguf, context=256, parallel=1, notify=lambda batch: None)
    try:
        rendered = runner.vocab.render_chat(
            tuple((m.role.value.encode(), m.content) for m in turns))
    finally:
        runner.close()
    assert "<start_of_turn>user" in rendered and rendered.count("<start_of_turn>") == 4
    record = audit()[-1]
    assert record["prompt"] == [[m.role.value, m.content] for m in turns]


async def test_turn_n_only_prefills_what_is_new(models_file: Path) -> None:
    turns: list[tuple[str, str]] = [("user", "the first question, a long one " * 8)]
    prompt_tokens, cached_tokens = [], []
    async with running_daemon(models_file), connect() as client:
        for i in range(5):
            text = "".join([e.chunk.text async for e in client.generate(
                "tiny", messages=convo(*turns), max_tokens=6, temperature=0.0)
                if isinstance(e, Tokens)])
            record = audit()[-1]
            prompt_tokens.append(record["prompt_tokens"])
            cached_tokens.append(record["cached_tokens"])
            turns += [("assistant", text), ("user", f"follow-up {i}")]
    assert cached_tokens[0] == 0
    for i in range(1, 5):
        # everything the previous turn prefilled is reused; only the new turn is prefilled
        assert cached_tokens[i] >= prompt_tokens[i - 1] - 1, (prompt_tokens, cached_tokens)


@pytest.mark.parametrize("line,match", [
    (b'{"Generate":{"request_id":"e","model":"tiny","messages":[]}}', "must not be empty"),
    (b'{"Generate":{"request_id":"e","model":"tiny","messages":[{"role":"robot","content":"x"}]}}',
     "unknown variant `robot`"),
    ((b'{"Generate":{"request_id":"e","model":"tiny","prompt":"x",'
     b'"messages":[{"role":"user","content":"x"}]}}'), "exactly one of"),
    (b'{"Generate":{"request_id":"e","model":"tiny"}}', "exactly one of"),
    ((b'{"Generate":{"request_id":"e","model":"tiny","format":"raw",'
     b'"messages":[{"role":"user","content":"x"}]}}'), "format `raw`"),
])
async def test_invalid_messages_are_invalid(models_file: Path, line: bytes, match: str) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(line)
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID, ev
        assert ev.request_id == "e" and match in ev.message, ev.message


async def test_messages_over_the_byte_limit_are_invalid(models_file: Path) -> None:
    limits = Limits(max_prompt_bytes=100)
    async with running_daemon(models_file, limits=limits), Raw.open() as c:
        big = convo(("system", "x" * 60), ("user", "y" * 41))
        await c.send(encode(Generate("big", "tiny", messages=big)))
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID
        assert "messages longer than 100 bytes" in ev.message


async def test_messages_to_a_model_without_a_template_are_rendered_as_chatml(
    models_file: Path, tmp_path: Path
) -> None:
    from tinymodel import write_tiny_gguf

    bare = write_tiny_gguf(tmp_path / "bare.gguf", chat_template=None)
    f = models_toml(tmp_path / "m.toml", Entry("bare", bare, context=256, parallel=1),
                    Entry("base", bare, context=256, parallel=1, more={"format": "raw"}))
    async with running_daemon(f, audit_prompts=True), Raw.open() as c:
        await c.send(encode(Generate("m", "bare", messages=convo(("user", "hi")), max_tokens=3,
                                     usage=True)))
        events = await c.until_terminal("m")
        assert isinstance(events[-1], Tokens), events[-1]
        (usage,) = [e for e in events if isinstance(e, Usage)]
        chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert usage.prompt_tokens >= len(chatml.encode())  # (byte tokens, BOS, a space)
        # A completion model (format raw) has no chat at all.
        await c.send(encode(Generate("n", "base", messages=convo(("user", "hi")))))
        ev = (await c.until_terminal("n"))[-1]
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID
        assert "completion model" in ev.message
        await c.send(encode(Generate("p", "bare", "hi", max_tokens=2, format=Format.RAW)))
        assert isinstance((await c.until_terminal("p"))[-1], Tokens)


async def test_failing_requests_with_long_deadlines_leave_nothing_behind(
    models_file: Path,
) -> None:
    prompt = "x" * 200_000
    day_ms = 24 * 3600 * 1000
    async with running_daemon(models_file) as daemon, Raw.open() as c:
        await c.send(encode(Generate("warm", "nope", prompt, deadline_ms=day_ms)))
        await c.until_terminal("warm")
        tasks_before = len(asyncio.all_tasks())
        rss_before = rss_kib()
        for i in range(1000):
            await c.send(encode(Generate(f"f{i}", "nope", prompt, deadline_ms=day_ms)))
            ev = (await c.until_terminal(f"f{i}"))[-1]
            assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID
        with anyio.fail_after(10):  # the refused requests' tasks end
            while len(asyncio.all_tasks()) > tasks_before:  # noqa: ASYNC110 - outside view
                await anyio.sleep(0.01)
        assert daemon.supervisor.requests.active == {}
        # 1,000 x 200 KB prompts held by sleeping tasks would be 200 MB
        assert rss_kib() - rss_before < 40_000


async def test_cancelling_a_request_that_just_finished_is_quiet(models_file: Path) -> None:
    async with running_daemon(models_file), connect() as client:
        events = [e async for e in client.generate("tiny", "hi", request_id="done",
                                                   max_tokens=2, temperature=0.0)]
        assert isinstance(events[-1], Tokens)
        with pytest.raises(RequestFailedError, match="no active request"):
            await client.cancel("done")
        await client.cancel_if_active("done")  # what Ctrl-C does as the answer ends


async def test_every_generated_id_reaches_the_client_once(models_file: Path) -> None:
    async with running_daemon(models_file, audit_prompts=False), connect() as client:
        events = [e async for e in client.generate("tiny", "hello", max_tokens=40,
                                                   temperature=1.0, seed=3)]
    chunks = [e.chunk for e in events if isinstance(e, Tokens)]
    record = audit()[-1]
    assert sum(len(c.ids) for c in chunks) == record["output_tokens"] == 40
    assert all(c.ids for c in chunks[:-1])  # no empty chunk before the last one
