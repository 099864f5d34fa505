"""How far a long prompt has been read, for a client that asks: ``Progress`` events on
the socket (``progress: true``), llama-server's ``prompt_progress`` chunks on a streamed
chat completion (``return_progress: true``, read by the real ``openai`` client). Real
daemon, real llama.cpp (the tiny model; a prompt is read one micro-batch, 512 tokens, in
the first step, then up to 2,048 a step as llama-server reads them)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from httphelp import openai_client

from everycycle.client import connect
from everycycle.protocol import Accepted, Progress, Tokens

LONG = "hello world " * 420  # (about 5,000 tokens on the tiny byte-level vocabulary)


@pytest.mark.anyio
async def test_progress_events_on_the_socket(spawn_daemon: Any) -> None:
    spawn_daemon()
    async with connect() as c:
        events = [e async for e in c.generate("tiny", LONG, max_tokens=2, temperature=0.0,
                                              progress=True)]
        plain = [e async for e in c.generate("tiny", LONG + "again", max_tokens=2,
                                             temperature=0.0)]
    assert isinstance(events[0], Accepted)
    steps = [e for e in events if isinstance(e, Progress)]
    first = next(i for i, e in enumerate(events) if isinstance(e, Tokens))
    assert all(isinstance(e, Progress) for e in events[1:first])  # before any token
    total = steps[0].total
    assert total > 4500 and {s.total for s in steps} == {total}
    assert [s.processed for s in steps] == sorted(s.processed for s in steps)
    assert steps[0].processed == steps[0].cached == 0  # at the start, nothing reused
    # one after each batch; the last says the whole prompt is read (as llama-server)
    assert len(steps) >= 4 and steps[-2].processed < total == steps[-1].processed
    assert not any(isinstance(e, Progress) for e in plain)  # (only when asked)


def test_prompt_progress_chunks_on_a_chat_stream(url: str) -> None:
    with openai_client(url, "x") as client:
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=2,
            temperature=0, stream=True, extra_body={"return_progress": True})
        chunks = [json.loads(c.model_dump_json()) for c in stream]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert len(progress) >= 4
    assert {p["total"] for p in progress} == {progress[0]["total"]} and progress[0]["cache"] == 0
    assert all(p["processed"] < p["total"] and p["time_ms"] >= 0 for p in progress[:-1])
    assert progress[-1]["processed"] == progress[-1]["total"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])
    assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"
