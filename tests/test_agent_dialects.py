"""What coding agents send is read: Claude Code's Messages requests, Codex's Responses
requests, prompts longer than the context, and /v1/models as each reads it. A real
daemon on a real port, real llama.cpp (the tiny model), the official clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httphelp
import openai
import pytest
from httphelp import anthropic_client, raw

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}},
          "required": ["command"]}

CLAUDE_CODE: dict[str, Any] = {
    "model": "tiny", "max_tokens": 32000, "stream": True, "temperature": 0,
    "system": [{"type": "text", "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "A reminder from the harness."},
        {"role": "user", "content": "Reply with one word."},
    ],
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": "someone"},
    "tools": [
        {"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA},
        {"name": "Later", "description": "Deferred.", "input_schema": SCHEMA,
         "defer_loading": True, "cache_control": {"type": "ephemeral"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    ],
}

CODEX: dict[str, Any] = {
    "model": "tiny", "stream": True, "store": False, "temperature": 0,
    "max_output_tokens": 8,
    "instructions": "You are Codex.",
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                         "text": "say hello"}]},
    ],
    "tools": [
        {"type": "function", "name": "shell", "description": "Run a command.",
         "strict": False, "parameters": SCHEMA},
        {"type": "namespace", "name": "multi_agent_v1", "description": "Agents.",
         "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn.",
                    "parameters": {"type": "object", "properties": {
                        "task": {"type": "string"}}, "required": ["task"]}}]},
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        {"type": "web_search"},
        {"type": "local_shell"},
    ],
    "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "conversation-1", "client_metadata": {"x": "y"},
}


def _sse(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in body.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines and lines["data"] != "[DONE]":
            events.append((lines.get("event", ""), json.loads(lines["data"])))
    return events


def test_claude_codes_request_is_answered(url: str) -> None:
    status, _, body = raw(url, "POST", "/v1/messages?beta=true",
                                json.dumps(CLAUDE_CODE).encode(), {
                                    "content-type": "application/json",
                                    "anthropic-version": "2023-06-01",
                                    "anthropic-beta": "claude-code-20250219,"
                                    "interleaved-thinking-2025-05-14"})
    assert status == 200, body
    names = [name for name, _ in _sse(body)]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert "content_block_delta" in names


def test_the_anthropic_client_reads_the_same(url: str) -> None:
    with anthropic_client(url, "unused") as client:
        known = ("model", "system", "messages", "metadata", "tools")
        message = client.beta.messages.create(
            **{k: CLAUDE_CODE[k] for k in known}, max_tokens=8,
            betas=["context-management-2025-06-27"],
            extra_body={k: v for k, v in CLAUDE_CODE.items()
                        if k not in (*known, "max_tokens", "stream")})
        assert message.role == "assistant" and message.content
        listed = client.models.list()
        tiny = next(m for m in listed.data if m.id == "tiny")
        assert tiny.type == "model" and tiny.max_input_tokens == 8192


def test_codexs_request_is_answered(url: str) -> None:
    status, _, body = raw(url, "POST", "/v1/responses", json.dumps(CODEX).encode(),
                          {"content-type": "application/json"})
    assert status == 200, body
    events = _sse(body)
    assert events[0][1]["type"] == "response.created"
    assert events[-1][1]["type"] in ("response.completed", "response.incomplete"), events[-1]


@pytest.fixture
def openai_client(url: str) -> Iterator[openai.OpenAI]:
    with httphelp.openai_client(url) as c:
        yield c


def test_a_namespace_function_is_called_back_by_namespace_and_name(url: str) -> None:
    # The task's string bounded: a random-weight model, greedy, may never close it.
    spawn = {"type": "function", "name": "spawn_agent", "description": "Spawn.",
             "parameters": {"type": "object", "properties": {
                 "task": {"type": "string", "maxLength": 16}}, "required": ["task"]}}
    tools = [{**t, "tools": [spawn]} if t.get("type") == "namespace" else t
             for t in CODEX["tools"]]
    request = {**CODEX, "stream": False, "max_output_tokens": 1024, "tools": tools,
               "tool_choice": {"type": "function", "name": "multi_agent_v1.spawn_agent"}}
    status, _, body = raw(url, "POST", "/v1/responses", json.dumps(request).encode(),
                          {"content-type": "application/json"})
    assert status == 200, body
    call = next(i for i in json.loads(body)["output"] if i["type"] == "function_call")
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "spawn_agent")
    assert "task" in json.loads(call["arguments"])
    # and the call comes back in the next turn's input the same way
    follow = {**request, "tool_choice": "none", "max_output_tokens": 8, "input": [
        *CODEX["input"], call, {"type": "function_call_output", "call_id": call["call_id"],
                                "output": "spawned"}]}
    status, _, body = raw(url, "POST", "/v1/responses", json.dumps(follow).encode(),
                          {"content-type": "application/json"})
    assert status == 200, body


def test_a_custom_tool_is_called_with_one_string(url: str) -> None:
    request = {**CODEX, "stream": True, "max_output_tokens": 1024,
               "tool_choice": {"type": "custom", "name": "apply_patch"}}
    status, _, body = raw(url, "POST", "/v1/responses", json.dumps(request).encode(),
                          {"content-type": "application/json"})
    assert status == 200, body
    events = _sse(body)
    done = [e for _, e in events if e["type"] == "response.output_item.done"]
    calls = [e["item"] for e in done if e["item"]["type"] == "custom_tool_call"]
    assert calls  # (parallel_tool_calls: perhaps more than one)
    call = calls[0]
    assert call["name"] == "apply_patch" and isinstance(call["input"], str)
    assert any(e["type"] == "response.custom_tool_call_input.done" for _, e in events)
    follow = {**request, "stream": False, "tool_choice": "none", "max_output_tokens": 8,
              "input": [*CODEX["input"], call, {"type": "custom_tool_call_output",
                                                "call_id": call["call_id"],
                                                "output": "applied"}]}
    status, _, body = raw(url, "POST", "/v1/responses", json.dumps(follow).encode(),
                          {"content-type": "application/json"})
    assert status == 200, body


def test_a_prompt_longer_than_the_context_gets_each_dialects_words(
        openai_client: openai.OpenAI, url: str) -> None:
    long = "hello world " * 3000  # tiny4: 512 tokens a slot
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(
            model="tiny4", messages=[{"role": "user", "content": long}], max_tokens=4)
    assert err.value.code == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.responses.create(model="tiny4", input=long, max_output_tokens=4)
    assert err.value.code == "context_length_exceeded"
    with anthropic_client(url, "unused") as client:
        with pytest.raises(anthropic.BadRequestError) as aerr:
            client.messages.create(model="tiny4", max_tokens=4,
                                   messages=[{"role": "user", "content": long}])
        body = aerr.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
        assert message.startswith("prompt is too long: ") and message.endswith(
            " tokens > 512 maximum"), message


def test_models_say_their_context(openai_client: openai.OpenAI) -> None:
    tiny = openai_client.models.retrieve("tiny")
    assert tiny.model_extra is not None and tiny.model_extra["context_length"] == 8192


def test_an_output_codex_made_itself_is_read_without_a_call_id(url: str) -> None:
    # Codex 0.171 sends a goal's objective as a function_call_output named by `name` and
    # `namespace`, with no call_id and no call before it (found by running it by hand).
    own = {"type": "function_call_output", "id": "fco_1", "name": "goal_objective",
           "namespace": "agent", "output": "say hello"}
    request = {**CODEX, "stream": False, "input": [*CODEX["input"], own]}
    status, _, body = raw(url, "POST", "/v1/responses", json.dumps(request).encode(),
                          {"content-type": "application/json"})
    assert status == 200, body
    nameless = {"type": "function_call_output", "output": "x"}
    request = {**CODEX, "stream": False, "input": [*CODEX["input"], nameless]}
    status, _, body = raw(url, "POST", "/v1/responses", json.dumps(request).encode(),
                          {"content-type": "application/json"})
    assert status == 400 and b"needs its call_id (or the name of its tool)" in body, body
