"""Tools in ``everycycle chat``: the user's MCP servers (the reference servers from npm,
pinned in .ci/agents) run by a real daemon, each call put to the user on a real
pseudo-terminal, the tool's result read back from the prompt the engine saw.

The model is honestly deterministic, as in the agent tests: its models.toml entry's
``grammar`` holds it (random weights, SmolLM2's tokenizer) to one call on the user's
turn and ``grammar_after_tools`` to the answer ``done`` after the result; the real
sampler writes both and the real parser reads the call.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, wait_until
from test_agents import _need
from test_chat import requests, spawn_chat
from tinyagent import write_tiny_bpe_gguf

from everycycle.cli.toolloop import DENIED
from everycycle.models.registry import load_registry, local_file

pytestmark = pytest.mark.agents
NOTE = "hello from a note file"
CRASHER = Path(__file__).parent / "data" / "mcp_crasher.py"


def _call(name: str, arguments: dict[str, str]) -> str:
    return "root ::= " + json.dumps(json.dumps(
        {"tool_calls": [{"name": name, "arguments": arguments}]}))


@pytest.fixture(scope="module")
def bpe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = local_file(load_registry().get("smollm2-135m"))
    return write_tiny_bpe_gguf(tmp_path_factory.mktemp("chattools") / "tiny-bpe.gguf",
                               source)


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    root = tmp_path / "notes"
    root.mkdir()
    (root / "note.txt").write_text(NOTE + "\n")
    return root.resolve()


@pytest.fixture
def tool_models(tmp_path: Path, bpe_gguf: Path, notes: Path) -> Path:
    calls = {"reader": _call("read_text_file", {"path": str(notes / "note.txt")}),
             "crasher": _call("crash", {"why": "test"})}
    f = tmp_path / "tools.toml"
    f.write_text("".join(
        f'[models.{name}]\npath = "{bpe_gguf}"\nparallel = 1\ncontext = 8192\n'
        f"grammar = {json.dumps(grammar)}\n"
        'grammar_after_tools = \'root ::= "{\\"response\\": \\"done\\"}"\'\n'
        for name, grammar in calls.items()))
    return f


def mcp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EC, "mcp", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def add_files_server(notes: Path) -> None:
    added = mcp("add", "files", "--", str(_need("mcp-server-filesystem")), str(notes))
    assert added.returncode == 0, added.stderr


def tool_said(record: dict[str, object]) -> list[str]:
    """What the tool messages of a request's prompt said (the audit's --audit-prompts)."""
    prompt = record["prompt"]
    assert isinstance(prompt, list)
    return [text for role, text in prompt if role == "tool"]


def ask_and_answer(child: pexpect.spawn, text: str, answer: str) -> None:
    child.expect_exact(">>>")
    child.sendline(text)
    child.expect_exact("allow read_text_file?", timeout=120)
    child.sendline(answer)


def test_a_chat_asks_before_each_call_and_the_result_reaches_the_model(
        spawn_daemon: SpawnDaemon, tool_models: Path, notes: Path) -> None:
    add_files_server(notes)
    assert mcp("add", "broken", "--", "/nonexistent/mcp-server").returncode == 0
    spawn_daemon("--audit-prompts", models=tool_models)
    child = spawn_chat(tool_models, "-m", "reader")
    try:
        # a server that cannot start is one sentence, and the others' tools are offered
        child.expect_exact("MCP server 'broken' did not start (/nonexistent/mcp-server): "
                           "its command was not found", timeout=120)
        child.expect(r"Tools: 14 from files", timeout=120)
        # allow once: the call runs, its result is shown (folded) and goes to the model
        ask_and_answer(child, "read my note", "y")
        child.expect_exact(NOTE)
        child.expect_exact("done")
        wait_until(lambda: len(requests()) == 2, "the answer after the tool's result")
        assert tool_said(requests()[1]) == [NOTE + "\n"]
        # deny: the model is told so, as the tool's result
        ask_and_answer(child, "read it again", "n")
        child.expect_exact("(denied)")
        wait_until(lambda: len(requests()) == 4, "the answer after the denial")
        assert tool_said(requests()[3])[-1] == DENIED
        # always: asked this once, never again in this chat
        ask_and_answer(child, "and again", "a")
        wait_until(lambda: len(requests()) == 6, "the answer after the allowed call")
        child.expect_exact(">>>")
        child.sendline("once more")
        wait_until(lambda: len(requests()) == 8, "the call allowed for the chat")
        assert tool_said(requests()[7])[-1] == NOTE + "\n"
        child.expect_exact(">>>")
        assert "allow read_text_file?" not in (child.before or b"").decode()
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()


def test_a_server_that_crashes_mid_call_is_an_error_result_and_the_chat_goes_on(
        spawn_daemon: SpawnDaemon, tool_models: Path) -> None:
    added = mcp("add", "crasher", "--", sys.executable, str(CRASHER))
    assert added.returncode == 0, added.stderr
    spawn_daemon("--audit-prompts", models=tool_models)
    child = spawn_chat(tool_models, "-m", "crasher", "--allow", "crash")
    try:
        for n in (2, 4):  # (the second time, the server was started again)
            child.expect_exact(">>>", timeout=120)
            child.sendline("crash it")
            child.expect_exact("MCP server 'crasher' failed")
            child.expect_exact("done")
            wait_until(lambda n=n: len(requests()) == n, "the answer after the crash")
            said = tool_said(requests()[n - 1])[-1]
            assert said.startswith("MCP server 'crasher' failed"), said
        child.expect_exact(">>>")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()


def test_with_no_terminal_a_call_is_denied_unless_allowed(
        spawn_daemon: SpawnDaemon, tool_models: Path, notes: Path) -> None:
    add_files_server(notes)
    spawn_daemon("--audit-prompts", models=tool_models)
    chat = [*EC, "chat", "--models", str(tool_models), "-m", "reader"]
    denied = subprocess.run(chat, input="read my note\n", capture_output=True, text=True,
                            timeout=180, check=False)
    assert denied.returncode == 0, denied.stderr
    assert "the tool call read_text_file was denied: no terminal to ask" in denied.stderr
    assert denied.stdout.strip() == "done", denied.stdout  # (the answer, parsed from its JSON)
    assert tool_said(requests()[-1])[-1] == DENIED
    allowed = subprocess.run([*chat, "--allow", "read_text_file"], input="read my note\n",
                             capture_output=True, text=True, timeout=180, check=False)
    assert allowed.returncode == 0, allowed.stderr
    assert tool_said(requests()[-1])[-1] == NOTE + "\n"
    assert NOTE in allowed.stderr and NOTE not in allowed.stdout  # (activity: stderr)


def test_mcp_commands_keep_the_file_in_the_shape_other_tools_read(tmp_path: Path,
                                                                  notes: Path,
                                                                  models_file: Path) -> None:
    from everycycle.tooluse.config import config_file

    add_files_server(notes)
    doc = json.loads(config_file().read_text())
    assert doc["mcpServers"]["files"]["args"] == [str(notes)]
    # a stranger's file: other keys and a URL server stay; the URL server is named
    doc["mcpServers"]["remote"] = {"url": "https://example.invalid/mcp"}
    doc["globalShortcut"] = "Ctrl+Space"
    config_file().write_text(json.dumps(doc))
    listed = mcp("list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["files"]["problem"] is None and "only stdio" in rows["remote"]["problem"]
    tools = mcp("tools", "--json", "--no-daemon")
    assert tools.returncode == 1  # (a server that is not running is a failure to report)
    assert "MCP server 'remote' is a URL server" in tools.stderr
    assert len(json.loads(tools.stdout)) == 14
    assert mcp("rm", "remote").returncode == 0
    assert json.loads(config_file().read_text())["globalShortcut"] == "Ctrl+Space"
    gone = mcp("rm", "remote")
    assert gone.returncode != 0 and "no MCP server 'remote'" in gone.stderr
    assert "Traceback" not in gone.stderr
    config_file().write_text("{not json")
    broken = mcp("list")
    assert broken.returncode != 0 and "is not JSON" in broken.stderr, broken.stderr
    assert "Traceback" not in broken.stderr
    # a chat says so once and goes on without tools
    chat = subprocess.run([*EC, "chat", "--no-daemon", "--models", str(models_file), "-n",
                           "4"], input="hello\n", capture_output=True, text=True,
                          timeout=120, check=False)
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
    assert "no tools in this chat:" in chat.stderr and "is not JSON" in chat.stderr


def test_run_with_mcp_keeps_stdout_for_the_answer(spawn_daemon: SpawnDaemon,
                                                   tool_models: Path, notes: Path) -> None:
    add_files_server(notes)
    spawn_daemon("--audit-prompts", models=tool_models)
    run = [*EC, "run", "--models", str(tool_models), "-m", "reader", "--mcp", "read it"]
    allowed = subprocess.run([*run, "--allow", "read_text_file"], capture_output=True,
                             text=True, timeout=180, check=False, stdin=subprocess.DEVNULL)
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout == "done", allowed.stdout  # (the answer only; no newline to a pipe)
    assert "⚒ read_text_file (files)" in allowed.stderr and NOTE in allowed.stderr
    assert tool_said(requests()[-1]) == [NOTE + "\n"]
    denied = subprocess.run(run, capture_output=True, text=True, timeout=180, check=False,
                            stdin=subprocess.DEVNULL)
    assert denied.returncode == 0, denied.stderr
    assert "read_text_file was denied: no terminal to ask" in denied.stderr
    assert tool_said(requests()[-1]) == [DENIED]
    assert denied.stdout == allowed.stdout


def test_the_socket_lists_and_runs_tools_for_its_user_only(spawn_daemon: SpawnDaemon,
                                                           tool_models: Path, notes: Path,
                                                           tmp_path: Path) -> None:
    """The reference memory server (npm), its file set through mcp.json's env, driven
    over the socket's ListTools and RunTool; a TCP key's holder is refused."""
    import socket

    import anyio

    from everycycle.client import SyncClient
    from everycycle.client.aio import connect
    from everycycle.errors import RequestFailedError

    add_files_server(notes)
    memory_file = tmp_path / "memory.jsonl"
    added = mcp("add", "memory", "--env", f"MEMORY_FILE_PATH={memory_file}", "--",
                str(_need("mcp-server-memory")))
    assert added.returncode == 0, added.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_daemon("--tcp", f"127.0.0.1:{port}", models=tool_models)
    with SyncClient() as client:
        listed = client.list_tools()
        by_server = {t.server for t in listed.tools}
        assert by_server == {"files", "memory"} and listed.problems == ()
        made = client.run_tool("create_entities", json.dumps({"entities": [
            {"name": "everycycle", "entityType": "project",
             "observations": ["runs MCP servers for chat"]}]}))
        assert not made.is_error, made.content
        graph = client.run_tool("read_graph", "{}")
        assert "runs MCP servers for chat" in graph.content
        wrong = client.run_tool("read_text_file", json.dumps({"path": "/etc/hostname"}))
        assert wrong.is_error and "outside allowed directories" in wrong.content
    assert "runs MCP servers for chat" in memory_file.read_text()

    key = subprocess.run([*EC, "keys", "add", "guest"], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip().splitlines()[-1]

    async def as_guest() -> str:
        async with connect(tcp=("127.0.0.1", port), token=key) as guest:
            try:
                await guest.list_tools()
            except RequestFailedError as exc:
                return exc.message
        return "listed"

    assert "only the daemon's own user" in anyio.run(as_guest)
