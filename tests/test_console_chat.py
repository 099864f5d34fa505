"""The console's chat with tools, in a real browser (Playwright driving Debian's
Chromium) against a real daemon and the reference filesystem MCP server from npm: the
model's call waits for a click, runs, its result reaches the model; the answer is
rendered as Markdown (a code block is a <pre><code>, the model's <script> is text);
the conversation is saved and reopens in a new page. An API key's holder gets none of
the daemon user's tools or conversations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from daemonhelp import EC
from httphelp import fleet_http
from test_chat import requests
from test_chat_tools import NOTE, _call, add_files_server, bpe_gguf, notes, tool_said
from test_console import CHROMIUM, browser

from everycycle import conversations
from everycycle.cli.toolloop import DENIED

__all__ = ["bpe_gguf", "browser", "notes"]  # (fixtures shared with those modules)
pytestmark = [pytest.mark.agents, pytest.mark.skipif(CHROMIUM is None, reason="no chromium")]
ANSWER = "Your note:\n\n```python\nprint('note')\n```\n\n<script>alert(4)</script> **done**"


@pytest.fixture
def console_models(tmp_path: Path, bpe_gguf: Path, notes: Path) -> Path:
    f = tmp_path / "console-tools.toml"
    after = "root ::= " + json.dumps(json.dumps({"response": ANSWER}))
    f.write_text(
        f'default = "reader"\n[models.reader]\npath = "{bpe_gguf}"\nparallel = 1\n'
        "context = 8192\n"
        f"grammar = {json.dumps(_call('read_text_file', {'path': str(notes / 'note.txt')}))}\n"
        f"grammar_after_tools = {json.dumps(after)}\n")
    return f


def test_a_tool_call_waits_for_a_click_and_the_answer_is_rendered_safely(
        browser: Any, spawn_daemon: Any, console_models: Path, notes: Path) -> None:
    add_files_server(notes)
    spawn_daemon("--http", "127.0.0.1:0", "--audit-prompts", models=console_models)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
    page.goto(fleet_http() + "/console/")
    page.wait_for_selector("#chat-tools:has-text('tools: 14 from files')", timeout=120_000)
    page.fill("#chat-input", "read my note")
    page.click("#chat-send")
    page.wait_for_selector(".consent button.allow", timeout=120_000)
    assert len(requests()) == 1  # (the call waits: nothing more was asked of the model)
    page.click(".consent button.allow")
    page.wait_for_selector(f".turn.tool details.result summary:has-text('{NOTE}')")
    page.wait_for_selector("#transcript pre code:has-text(\"print('note')\")",
                           timeout=120_000)
    page.wait_for_selector("#chat-figures:has-text('generated')")
    assert tool_said(requests()[-1]) == [NOTE + "\n"]
    answer = page.locator("#transcript .turn.assistant").last
    assert "<script>alert(4)</script>" in answer.inner_text()
    assert page.locator("#transcript script").count() == 0
    assert answer.locator("strong").inner_text() == "done"
    assert answer.locator(".code button.copy").count() == 1

    # saved as `chat` saves its own; a new page reopens it from the list
    page.wait_for_selector("#chat-past option:nth-child(2)", state="attached")
    (saved,) = conversations.listed()
    roles = [m.role.value for m in saved.messages]
    assert roles == ["user", "assistant", "tool", "assistant"], roles
    again = browser.new_page()
    again.goto(fleet_http() + "/console/")
    again.wait_for_selector(f"#chat-past option[value='{saved.id}']", state="attached")
    again.select_option("#chat-past", saved.id)
    again.wait_for_selector("#transcript pre code")
    assert again.locator("#transcript .turn.user").inner_text() == "read my note"
    assert NOTE in again.locator(".turn.tool").inner_text()
    # Stop while a call waits for its click: the call is denied, the model told so
    page.fill("#chat-input", "read it again")
    page.click("#chat-send")
    page.wait_for_selector(".consent button.deny", timeout=120_000)
    page.click("#chat-stop")
    page.wait_for_selector(".turn.tool:has-text('(denied)')")
    page.wait_for_selector("#chat-send:not([disabled])")
    assert tool_said(requests()[-1])[-1] == DENIED
    assert problems == []


def test_an_api_keys_holder_gets_no_tools_and_no_conversations(
        spawn_daemon: Any, console_models: Path, notes: Path) -> None:
    import subprocess

    add_files_server(notes)
    spawn_daemon("--http", "127.0.0.1:0", models=console_models)
    made = subprocess.run([*EC, "keys", "add", "guest"], capture_output=True, text=True,
                          timeout=60, check=True)
    secret = made.stdout.strip().split()[-1]
    guest = {"Authorization": f"Bearer {secret}"}
    base = fleet_http()
    for method, path in (("GET", "/v1/mcp/tools"), ("GET", "/v1/conversations"),
                         ("POST", "/v1/mcp/tools/read_text_file/call")):
        r = httpx.request(method, base + path, headers=guest, json={"arguments": {}},
                          timeout=60)
        assert r.status_code == 403, (path, r.text)
        assert "only the daemon's own user" in r.text
    # and the dialects never run MCP tools: a chat request's tools are the client's own
    listed = httpx.get(base + "/v1/mcp/tools", timeout=120).json()  # (loopback: the user)
    assert len(listed["tools"]) == 14 and listed["problems"] == []
