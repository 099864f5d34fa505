"""The OpenAI Responses API: the official `openai` client's `responses` against a real
daemon on a real port with real llama.cpp (the tiny model; function calls on the default
one)."""

from __future__ import annotations

import http.client
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import SpawnDaemon
from httphelp import audit, blocker, fleet_http, hostport, openai_client
from modelshelp import Entry, models_toml
from templatehelp import SMOLLM2
from test_tools import THINKING
from tinymodel import write_tiny_gguf

from everycycle.client import SyncClient

ADD: Any = {"type": "function", "name": "add", "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                            "b": {"type": "number"}},
                           "required": ["a", "b"]}}


@pytest.fixture
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai_client(url, "unused", timeout=60) as c:
        yield c


def test_a_response_whole_and_streamed(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=6,
                                temperature=0)
    assert r.object == "response" and r.model == "tiny" and r.store is False
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and r.output_text
    record = audit()[-1]
    assert r.id == record["request_id"] and r.usage is not None
    assert r.usage.output_tokens == record["output_tokens"] == 6
    assert r.usage.input_tokens == record["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + 6

    events = list(client.responses.create(model="tiny", input="hello", max_output_tokens=6,
                                          temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    names = [e.type for e in events]
    assert names[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text  # greedy: the same either way
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage is not None
    assert final.usage.output_tokens == 6

    with client.responses.stream(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "hello"}]}], max_output_tokens=6,
            temperature=0) as stream:  # the helper accumulates (and checks) the events
        deltas = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
    assert deltas[-1] == text  # (its final response is only for response.completed)


def test_instructions_and_what_is_not_stored(client: openai.OpenAI) -> None:
    plain = client.responses.create(model="tiny", input="hello", max_output_tokens=1)
    told = client.responses.create(model="tiny", input="hello", max_output_tokens=1,
                                   instructions="Answer in French.")
    assert plain.usage is not None and told.usage is not None
    assert told.usage.input_tokens > plain.usage.input_tokens  # the system turn is there
    assert told.instructions == "Answer in French."
    with pytest.raises(openai.BadRequestError, match="not stored"):
        client.responses.create(model="tiny", input="again", previous_response_id=told.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


def test_content_parts_join_and_others_are_refused(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="tiny", input="hello there", max_output_tokens=1)
    parts = client.responses.create(model="tiny", max_output_tokens=1, input=[
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "hello "},
                                     {"type": "input_text", "text": "there"}]}])
    assert parts.usage is not None and whole.usage is not None
    assert parts.usage.input_tokens > whole.usage.input_tokens  # the assistant turn too
    for bad in ({"type": "input_text", "refusal": "no"}, {"type": "input_file", "text": "x"}):
        with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.content\[0\]: only "):
            client.responses.create(model="tiny", input=[{"role": "user", "content": [bad]}])


def test_a_queued_stream_says_its_position(url: str, models_file: Path) -> None:
    proc: subprocess.Popen[bytes] = blocker(models_file)
    try:
        conn = http.client.HTTPConnection(*hostport(url), timeout=60)
        conn.request("POST", "/v1/responses", body=json.dumps(
            {"model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": True}))
        resp = conn.getresponse()
        head = []
        for _ in range(2):
            assert resp.readline().startswith(b"event: response.")
            head.append(json.loads(resp.readline().removeprefix(b"data: ")))
            assert resp.readline() == b"\n"
        assert [(e["type"], e["response"]["status"]) for e in head] == [
            ("response.created", "queued"), ("response.queued", "queued")]
        assert head[1]["queue_position"] == 1
        with SyncClient() as c:
            c.cancel(resp.getheader("x-request-id"))
        rest = resp.read().split(b"\n\n")
        conn.close()
        failed = json.loads(rest[-2].split(b"\n")[1].removeprefix(b"data: "))
        assert failed["type"] == "response.failed"
        assert failed["response"]["error"]["code"] == "Cancelled"
    finally:
        proc.kill()
        proc.communicate()


def test_a_function_call_round_trip_on_the_default_model(
    spawn_daemon: SpawnDaemon, tmp_path: Path,
) -> None:
    if not SMOLLM2.exists():
        pytest.skip("the default model is not installed (pip install 'everycycle[default-model]')")
    models = models_toml(tmp_path / "smol.toml", Entry("smol", SMOLLM2, context=2048),
                         default="smol")
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    ask: Any = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]
    with openai_client(fleet_http(), "x") as c:
        r = c.responses.create(model="smol", input=ask, tools=[ADD], tool_choice="required",
                               temperature=0, max_output_tokens=64)
        [call] = [item for item in r.output if item.type == "function_call"]
        args = json.loads(call.arguments)
        assert call.name == "add" and set(args) == {"a", "b"} and r.status == "completed"
        events = list(c.responses.create(model="smol", input=ask, tools=[ADD], stream=True,
                                          tool_choice={"type": "function", "name": "add"},
                                          temperature=0, max_output_tokens=64))
        done = [e.arguments for e in events
                if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and set(json.loads(done[0])) == {"a", "b"}
        total = sum(float(v) for v in args.values())
        answer = c.responses.create(model="smol", tools=[ADD], temperature=0,
                                    max_output_tokens=24, input=[
            *ask, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": f"{total:g}"}])
        assert answer.output_text and answer.output[-1].type == "message"


def test_thoughts_are_a_reasoning_item(spawn_daemon: SpawnDaemon, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "thinking.gguf", chat_template=THINKING)
    models = models_toml(tmp_path / "thinking.toml", Entry("t", gguf, context=1024),
                         default="t")
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    with openai_client(fleet_http(), "x") as c:
        r = c.responses.create(model="t", input="hi", max_output_tokens=6, temperature=0)
        events = list(c.responses.create(model="t", input="hi", max_output_tokens=6,
                                         temperature=0, stream=True))
    item: Any = r.output[0]
    assert item.type == "reasoning" and item.content[0].text
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text
