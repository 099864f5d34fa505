"""Real MCP servers' tool lists, as agents send them, served in all four dialects.

tests/data/mcp holds what popular MCP servers from npm answered to ``tools/list``
(collected by tests/data/mcp/collect.py; its README lists them). Each server's list, and
a union of four servers' (an agent with Playwright, GitHub, Sentry and the filesystem: 70+
tools), goes as its dialect's client sends it: OpenAI chat ``tools``, Responses function
tools, Anthropic ``input_schema``, Ollama ``/api/chat`` ``tools``. Every request is
served (no 400 for a keyword the constraint engine cannot enforce, no cap on a list's
size) and every call the model makes parses as its dialect's call, names one of the
tools and has a JSON object for arguments; a tool whose schema the grammar enforced
whole gets arguments that validate against it.

The model is the tiny random-weight one with SmolLM2's tokenizer and a Qwen2.5 (Hermes)
template: the prompt is SmolLM2's size, prefilled in seconds, and the dialects after the
first reuse it. Calls are sampled, seeded: a random model ends few of them in its
budget, so the test counts what it made, and holds every one of them to the rules.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from daemonhelp import daemon_process
from httphelp import anthropic_client, fleet_http, ollama_client, openai_client
from templatehelp import SMOLLM2, fixture_source
from tinyagent import write_tiny_bpe_gguf

from everycycle.chatfmt.callgrammar import call_grammar
from everycycle.chatfmt.tools import ToolFormat
from everycycle.hardware import cpukernels

DATA = Path(__file__).parent / "data" / "mcp"
SERVERS = sorted(p.stem for p in DATA.glob("*.json"))
UNION = ("playwright", "github", "sentry", "filesystem")
ASK = "Use one of the tools now."
MAX_TOKENS = 160
SAMPLED = {"temperature": 1.0, "seed": 7}


def mcp_tools(*servers: str) -> list[dict[str, Any]]:
    """The servers' tools as MCP gives them: name, description, inputSchema; named
    ``mcp__SERVER__TOOL`` when several servers' are offered, as Claude Code names them."""
    out: list[dict[str, Any]] = []
    for server in servers:
        tools = json.loads((DATA / f"{server}.json").read_text())["tools"]
        if len(servers) > 1:
            tools = [{**t, "name": f"mcp__{server}__{t['name']}"} for t in tools]
        out += tools
    return out


def openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description", ""),
        "parameters": t.get("inputSchema") or {"type": "object"}}} for t in tools]


@pytest.fixture(scope="module")
def bpe_hermes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not SMOLLM2.exists():
        pytest.skip("the default model is not installed (its tokenizer is borrowed)")
    return write_tiny_bpe_gguf(tmp_path_factory.mktemp("mcp") / "bpe-hermes.gguf", SMOLLM2,
                               chat_template=fixture_source("qwen2.5-instruct"),
                               n_ctx=131072)


@pytest.fixture(scope="module")
def url(bpe_hermes: Path, cpu_verdict: bytes) -> Iterator[str]:
    """One daemon for the module (each list's prompt is its own; a daemon a test would
    load the model 50 times), in a home of its own with this machine's CPU verdict."""
    with tempfile.TemporaryDirectory(prefix="ecm", dir="/tmp") as d:
        home = Path(d)
        env = {**os.environ, "EVERYCYCLE_HOME": str(home), "HF_HUB_OFFLINE": "1"}
        env.pop("EVERYCYCLE_SOCKET", None)
        if cpu_verdict:  # (as conftest's _private_paths gives each test's state dir)
            (home / "state").mkdir(mode=0o700, parents=True)
            (home / "state" / cpukernels.CACHE_NAME).write_bytes(cpu_verdict)
        models = home / "models.toml"
        models.write_text(f'default = "agent"\n[models.agent]\npath = "{bpe_hermes}"\n'
                          "context = 131072\nparallel = 1\n")
        sock = home / "ec.sock"
        with daemon_process("--models", str(models), "--http", "127.0.0.1:0", sock=sock,
                            env=env):
            yield fleet_http(sock)


class Calls:
    """The calls a list's requests made, each checked: a known tool, an object for
    arguments, and arguments that validate where the grammar enforced the whole schema."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.schemas = {t["name"]: t.get("inputSchema") or {"type": "object"} for t in tools}
        relaxed = call_grammar(ToolFormat.HERMES, openai_tools(tools), forced=True).relaxed
        self.enforced = set(self.schemas) - set(relaxed)
        self.made: list[str] = []

    def check(self, dialect: str, name: str, arguments: object) -> None:
        assert name in self.schemas, (dialect, name)
        assert isinstance(arguments, dict), (dialect, name, arguments)
        if name in self.enforced:
            jsonschema.validate(arguments, self.schemas[name])
        self.made.append(f"{dialect}:{name}")


def serve_everywhere(url: str, tools: list[dict[str, Any]]) -> Calls:
    """The list through each dialect's own client: each request answered (200)."""
    calls = Calls(tools)
    chat = openai_tools(tools)
    with openai_client(url, "unused", timeout=600) as oc:
        r = oc.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": ASK}], tools=chat,  # type: ignore[arg-type]
            tool_choice="required", max_tokens=MAX_TOKENS, **SAMPLED)  # type: ignore[arg-type]
        for tc in r.choices[0].message.tool_calls or []:
            assert tc.type == "function"
            calls.check("chat", tc.function.name, json.loads(tc.function.arguments))
        resp = oc.responses.create(
            model="agent", input=ASK, tool_choice="required", max_output_tokens=MAX_TOKENS,
            temperature=SAMPLED["temperature"],
            tools=[{"type": "function", "name": t["function"]["name"],  # type: ignore[misc]
                    "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in chat])
        for item in resp.output:
            if item.type == "function_call":
                calls.check("responses", item.name, json.loads(item.arguments))
    with anthropic_client(url, "unused", timeout=600) as ac:
        m = ac.messages.create(
            model="agent", max_tokens=MAX_TOKENS, extra_body={"temperature": 1.0},
            messages=[{"role": "user", "content": ASK}], tool_choice={"type": "any"},
            tools=[{"name": t["name"], "description": t.get("description", ""),  # type: ignore[misc]
                    "input_schema": t.get("inputSchema") or {"type": "object"}}
                   for t in tools])
        for block in m.content:
            if block.type == "tool_use":
                calls.check("anthropic", block.name, block.input)
    with ollama_client(url, timeout=600) as olc:
        answer = olc.chat(model="agent", messages=[{"role": "user", "content": ASK}],
                          tools=chat, options={"num_predict": MAX_TOKENS, **SAMPLED})
        for call in answer.message.tool_calls or []:
            calls.check("ollama", call.function.name, dict(call.function.arguments))
    return calls


def test_the_corpus_is_what_real_servers_answered() -> None:
    assert len(SERVERS) >= 40
    for server in SERVERS:
        record = json.loads((DATA / f"{server}.json").read_text())
        assert record["package"] and record["tools"], server
        for tool in record["tools"]:
            assert isinstance(tool["name"], str) and isinstance(tool.get("inputSchema"), dict)
    keywords = json.dumps([mcp_tools(s) for s in SERVERS])
    for keyword in ("propertyNames", "oneOf", "anyOf", "$ref", "additionalProperties"):
        assert f'"{keyword}"' in keywords, keyword


@pytest.mark.timeout(600)  # (the largest lists are 45k tokens: ~20 s of prefill here)
@pytest.mark.parametrize("server", SERVERS)
def test_each_servers_list_is_served_in_every_dialect(url: str, server: str) -> None:
    serve_everywhere(url, mcp_tools(server))


@pytest.mark.timeout(600)
def test_a_union_of_four_servers_is_served_in_every_dialect(url: str) -> None:
    tools = mcp_tools(*UNION)
    assert len(tools) >= 70 and len(json.dumps(tools)) > 64 * 1024  # (the old cap)
    calls = serve_everywhere(url, tools)
    # a forced call ends within the budget on some seed (sampled: how long a random
    # model's strings run depends on it), and it too keeps the rules
    chat = openai_tools(tools)
    with openai_client(url, "unused", timeout=600) as oc:
        for seed in range(1, 13):
            if calls.made:
                break
            r = oc.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": ASK}], tools=chat,  # type: ignore[arg-type]
                tool_choice="required", max_tokens=400, temperature=1.0, seed=seed)
            for tc in r.choices[0].message.tool_calls or []:
                assert tc.type == "function"
                calls.check("chat", tc.function.name, json.loads(tc.function.arguments))
    assert calls.made, "no call made in 12 tries"
