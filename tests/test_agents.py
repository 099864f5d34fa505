"""The coding agents, for real: Claude Code, Codex and opencode, each started with
``everycycle launch`` on a pseudo-terminal with no daemon running, answer a prompt and
carry out one tool call end to end (the model calls the agent's shell tool, the agent
runs it and sends the result back, the model answers). Their recorded requests (in
tests/data/agents) are replayed through our dialects.

The calls are made honestly deterministic: the models.toml entry's ``grammar`` holds
the model (random weights, SmolLM2's tokenizer) to one call of the agent's shell tool on
the user's turn, and ``grammar_after_tools`` to the answer ``done`` after the result;
the real sampler generates both, and the real parser reads the call.

The agents come from npm at the versions .ci/run pins (``EVERYCYCLE_AGENTS``: the
folder whose ``node_modules/.bin`` holds them). Where they are not installed these
tests skip, saying so, unless ``EVERYCYCLE_REQUIRE_AGENTS=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pexpect
import pytest
from daemonhelp import EC, daemon_process
from httphelp import fleet_http, raw
from tinyagent import write_tiny_bpe_gguf
from tlshelp import make_pki

from everycycle import paths
from everycycle.models.registry import load_registry, local_file

pytestmark = pytest.mark.agents
DATA = Path(__file__).parent / "data" / "agents"
OK = "everycycle-tool-ok"


def _bin() -> Path | None:
    where = os.environ.get("EVERYCYCLE_AGENTS")
    if where:
        return Path(where) / "node_modules" / ".bin"
    found = shutil.which("claude")
    return Path(found).parent if found else None


def _need(command: str) -> Path:
    folder = _bin()
    path = folder / command if folder else None
    if path is None or not path.exists():
        why = (f"{command} is not installed (.ci/run installs the agents from npm; "
               "EVERYCYCLE_AGENTS names their folder)")
        if os.environ.get("EVERYCYCLE_REQUIRE_AGENTS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return path


def _call(name: str, arguments: dict[str, str]) -> str:
    call = json.dumps({"tool_calls": [{"name": name, "arguments": arguments}]})
    return "root ::= " + json.dumps(call)


AGENTS = {
    "claude": (_call("Bash", {"command": f"echo {OK}", "description": "Print a word"}),
               ["-p", "Run the command.", "--output-format", "stream-json", "--verbose"]),
    "codex": (_call("exec_command", {"cmd": f"echo {OK}"}),
              ["exec", "--skip-git-repo-check", "Run the command."]),
    "opencode": (_call("bash", {"command": f"echo {OK}", "description": "Print a word"}),
                 ["run", "Run", "the", "command"]),
}


def _launch(agent: str, model: str, models: Path, args: list[str], work: Path,
            env: dict[str, str]) -> tuple[int | None, str]:
    """``everycycle launch AGENT -m MODEL -- ARGS`` on a pseudo-terminal in ``work``,
    starting a daemon (stopped after): its exit status and what it printed."""
    child = pexpect.spawn(EC[0], [*EC[1:], "launch", agent, "-m", model, "--models",
                                  str(models), "--http", "127.0.0.1:0", "--", *args],
                          cwd=str(work), env=env, timeout=240, encoding="utf-8",
                          codec_errors="replace", dimensions=(50, 200))
    try:
        child.expect(pexpect.EOF)
    finally:
        child.close()
        subprocess.run([*EC, "stop"], capture_output=True, timeout=60, check=False)
    return child.exitstatus, child.before or ""


@pytest.fixture(scope="module")
def bpe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = local_file(load_registry().get("smollm2-135m"))
    return write_tiny_bpe_gguf(tmp_path_factory.mktemp("agents") / "tiny-bpe.gguf", source)


@pytest.fixture
def agent_models(tmp_path: Path, bpe_gguf: Path) -> Path:
    f = tmp_path / "agents.toml"
    f.write_text("".join(
        # (no context: the daemon gives the model what it was trained for, 32,768)
        f'[models.agent-{name}]\npath = "{bpe_gguf}"\nparallel = 1\n'
        f"grammar = {json.dumps(grammar)}\n"
        'grammar_after_tools = \'root ::= "{\\"response\\": \\"done\\"}"\'\n'
        for name, (grammar, _) in AGENTS.items()))
    return f


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_launch_runs_the_agent_and_one_tool_call(agent: str, agent_models: Path,
                                                 tmp_path: Path) -> None:
    folder = _need(agent).parent
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**os.environ, "HOME": str(home), "PATH": f"{folder}:{os.environ['PATH']}",
           "NO_COLOR": "1"}
    _, args = AGENTS[agent]
    status, out = _launch(agent, f"agent-{agent}", agent_models, args, work, env)
    assert status == 0, out[-3000:]
    assert "daemon pid" in out and f"{agent} on http://127.0.0.1:" in out  # (it started one)
    assert "everycycle: warning" not in out, out[-3000:]  # (a context that holds it, unasked)
    assert OK in out, out[-3000:]  # the agent ran the model's call
    assert "done" in out, out[-3000:]  # and the model answered after the result
    records = [json.loads(line) for line in paths.audit_file().read_text().splitlines()]
    turns = [r for r in records if r.get("model") == f"agent-{agent}" and "request_id" in r]
    assert len(turns) >= 2 and all(r["outcome"] == "Finished" for r in turns), turns
    assert turns[-1]["cached_tokens"] > 0  # the follow-up extends the first turn's prompt


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_launch_over_https_with_a_private_ca(agent: str, agent_models: Path,
                                             tmp_path: Path) -> None:
    """A daemon serving HTTPS with a certificate from the user's own CA: ``launch`` hands
    the agent the https URL, and the agent trusts the CA the user trusts
    (``SSL_CERT_FILE``; given to Node's TLS as ``NODE_EXTRA_CA_CERTS`` too)."""
    folder = _need(agent).parent
    pki = make_pki(tmp_path)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**os.environ, "HOME": str(home), "PATH": f"{folder}:{os.environ['PATH']}",
           "NO_COLOR": "1", "SSL_CERT_FILE": str(pki.ca)}
    env.pop("NODE_EXTRA_CA_CERTS", None)
    with daemon_process("--models", str(agent_models), "--http", "127.0.0.1:0",
                        "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)):
        status, out = _launch(agent, f"agent-{agent}", agent_models, AGENTS[agent][1],
                              work, env)
    assert status == 0, out[-3000:]
    assert f"{agent} on https://127.0.0.1:" in out, out[-3000:]
    assert OK in out and "done" in out, out[-3000:]


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_launch_at_a_url_sends_one_session_id_on_every_request(
        agent: str, agent_models: Path, tmp_path: Path) -> None:
    """``launch --url`` (a router in front of several daemons, or a daemon elsewhere):
    the agent goes there, and every request it sends carries one ``X-Session-ID``, the
    key vllm-router's session policies keep a conversation where its cache is by.
    Recorded between the agent and the daemon by a proxy (tests/recordproxy.py)."""
    import threading

    from recordproxy import serve
    from routerhelp import free_port

    folder = _need(agent).parent
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**os.environ, "HOME": str(home), "PATH": f"{folder}:{os.environ['PATH']}",
           "NO_COLOR": "1"}
    recorded = tmp_path / "requests.jsonl"
    with daemon_process("--models", str(agent_models), "--http", "127.0.0.1:0"):
        port = free_port()
        proxy = serve(fleet_http(), recorded, port)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            child = pexpect.spawn(EC[0], [*EC[1:], "launch", agent, "-m", f"agent-{agent}",
                                          "--url", f"http://127.0.0.1:{port}", "--",
                                          *AGENTS[agent][1]],
                                  cwd=str(work), env=env, timeout=240, encoding="utf-8",
                                  codec_errors="replace", dimensions=(50, 200))
            child.expect(pexpect.EOF)
            child.close()
        finally:
            proxy.shutdown()
            proxy.server_close()
    out = child.before or ""
    assert child.exitstatus == 0, out[-3000:]
    assert f"{agent} on http://127.0.0.1:{port}" in out and OK in out, out[-3000:]
    requests = [json.loads(line) for line in recorded.read_text().splitlines()]
    sessions = {r["headers"].get("x-session-id") for r in requests}
    assert len(requests) >= 2 and len(sessions) == 1 and None not in sessions, sessions


@pytest.fixture
def plain_models(tmp_path: Path, bpe_gguf: Path) -> Path:
    """An entry as a user writes it: no grammar keys, a context that holds an agent's
    prompt (5-15k tokens)."""
    f = tmp_path / "plain.toml"
    f.write_text(f'[models.plain]\npath = "{bpe_gguf}"\ncontext = 32768\nparallel = 1\n')
    return f


MAX_OUT = 24
"""The replays' cap on an answer (the recorded bodies ask for 32,000; a random-weight
model never stops on its own)."""


def capped(path: str, body: dict[str, object]) -> dict[str, object]:
    """``body`` for the plain entry, its answer capped at ``MAX_OUT`` tokens."""
    out = {**body, "model": "plain"}
    keys = [k for k in ("max_tokens", "max_output_tokens", "max_completion_tokens")
            if k in out]
    for k in keys or ["max_output_tokens" if path.endswith("/responses") else "max_tokens"]:
        out[k] = MAX_OUT
    return out


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_recorded_requests_are_answered(agent: str, plain_models: Path) -> None:
    """Every recorded request, tools and all, through the conversion a user's plain
    entry takes: its tools' schemas compiled for the constraint engine, not bypassed."""
    with daemon_process("--models", str(plain_models), "--http", "127.0.0.1:0"):
        url = fleet_http()
        # Recorded before the constraint engine (``AGENT.jsonl``) and since, from the
        # agents run against a plain entry (``AGENT-plain.jsonl``).
        lines = [line for f in sorted(DATA.glob(f"{agent}*.jsonl"))
                 for line in f.read_text().splitlines()]
        for line in lines:
            recorded = json.loads(line)
            body = capped(recorded["path"], recorded["body"])
            status, _, answer = raw(url, "POST", recorded["path"], json.dumps(body).encode(),
                                    {**recorded["headers"], "authorization": "",
                                     "x-api-key": ""})
            assert status == 200, (recorded["path"], answer[:500])
            assert answer.rstrip().endswith((b"message_stop\ndata: {}", b"[DONE]",
                                             b"}")), answer[-300:]


# The agents' own idle limits, set as low as each allows: a stream silent for longer
# ends the turn (Codex: stream_max_retries = 0 makes that final; Claude Code's byte
# watchdog takes 10 s at least).
IDLE = {
    "codex": (4.0, ["-c", "model_providers.everycycle.stream_idle_timeout_ms=4000",
                    "-c", "model_providers.everycycle.stream_max_retries=0"], {}),
    "claude": (10.0, [], {"CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000",
                               "CLAUDE_CODE_MAX_RETRIES": "0",
                               # (else a stalled stream is asked again, not streamed)
                               "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1"}),
}


@pytest.mark.parametrize("agent", sorted(IDLE))
def test_a_wait_longer_than_the_agents_idle_limit_does_not_end_its_turn(
        agent: str, agent_models: Path, tmp_path: Path) -> None:
    """The agent's request waits behind another for twice its idle limit (as a slow
    prefill would keep it waiting): the daemon's keep-alives hold its stream, and the
    turn goes on when the slot frees."""
    folder = _need(agent).parent
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    idle, extra, agent_env = IDLE[agent]
    env = {**os.environ, "HOME": str(home), "PATH": f"{folder}:{os.environ['PATH']}",
           "NO_COLOR": "1", **agent_env}
    words = tmp_path / "words.gbnf"
    words.write_text('root ::= [a-z ] root\n')  # no end: the hold stops when it is killed
    with daemon_process("--models", str(agent_models), "--http", "127.0.0.1:0",
                        "--http-heartbeat", "1"):
        hold = subprocess.Popen([*EC, "run", "-m", f"agent-{agent}", "--models",
                                 str(agent_models), "--grammar", str(words), "-n", "30000",
                                 "--temperature", "1", "x"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert hold.stdout is not None
        hold.stdout.read(1)  # it holds the model's only slot now
        _, args = AGENTS[agent]
        child = pexpect.spawn(EC[0], [*EC[1:], "launch", agent, "-m", f"agent-{agent}",
                                      "--models", str(agent_models), "--", *extra, *args],
                              cwd=str(work), env=env, timeout=240, encoding="utf-8",
                              codec_errors="replace", dimensions=(50, 200))
        try:
            with contextlib.suppress(pexpect.TIMEOUT):
                child.expect(pexpect.EOF, timeout=2 * idle + 5)  # (it must not end)
            assert hold.poll() is None, "the hold ended: the agent did not wait"
            assert child.isalive(), (child.before or "")[-3000:]
            hold.kill()
            child.expect(pexpect.EOF)
        finally:
            hold.kill()
            hold.wait()
            hold.stdout.close()
            child.close()
    out = child.before or ""
    assert child.exitstatus == 0, out[-3000:]
    assert OK in out and "done" in out, out[-3000:]  # the whole turn, tool call and all


# An agent configured by hand with an MCP server, as its docs say, on a plain entry: the
# server's tools (Playwright MCP's: `propertyNames` in browser_drop) ride in every
# request. The entry has no grammar keys; its model (Qwen2.5's Hermes template, where a
# turn may end before any call) is biased to end its answer at once, so the turn is
# quick, and the request still carries the whole tool list through its grammar's compile.
MCP = {
    "claude": (["-p", "Say hi.", "--output-format", "stream-json", "--verbose",
                "--mcp-config", "{mcp}"],
               # (its tool search defers MCP tools; off, they are sent, as most clients do)
               {"ENABLE_TOOL_SEARCH": "false"}, 15_000),
    "codex": (["exec", "--skip-git-repo-check", "Say hi."], {}, 12_000),
}


@pytest.mark.parametrize("agent", sorted(MCP))
def test_an_agent_with_an_mcp_server_answers_a_turn_on_a_plain_entry(
        agent: str, tmp_path: Path) -> None:
    folder = _need(agent).parent
    server = _need("playwright-mcp")
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    # Codex reads its servers from ~/.codex/config.toml; Claude Code from --mcp-config
    (home / ".codex" / "config.toml").write_text(
        f'[mcp_servers.playwright]\ncommand = "{server}"\nargs = []\n')
    mcp = tmp_path / "mcp.json"
    mcp.write_text(json.dumps({"mcpServers": {"playwright": {"command": str(server),
                                                             "args": []}}}))
    source = local_file(load_registry().get("smollm2-135m"))
    from templatehelp import fixture_source

    model = write_tiny_bpe_gguf(tmp_path / "hermes-bpe.gguf", source,
                                chat_template=fixture_source("qwen2.5-instruct"))
    models = tmp_path / "plain.toml"
    models.write_text(f'[models.plain]\npath = "{model}"\ncontext = 32768\nparallel = 1\n'
                      'logit_bias = {"2" = 100}\n')  # (<|im_end|>: the answer ends at once)
    args, agent_env, at_least = MCP[agent]
    env = {**os.environ, "HOME": str(home), "PATH": f"{folder}:{os.environ['PATH']}",
           "NO_COLOR": "1", **agent_env}
    status, out = _launch(agent, "plain", models, [a.format(mcp=mcp) for a in args], work,
                          env)
    assert status == 0, out[-3000:]
    if agent == "claude":
        assert '"name":"playwright","status":"connected"' in out, out[-3000:]
    records = [json.loads(line) for line in paths.audit_file().read_text().splitlines()]
    turns = [r for r in records if r.get("model") == "plain" and "request_id" in r]
    assert turns and all(r["outcome"] == "Finished" for r in turns), turns
    # the MCP server's tools were in the prompt (the agent's own alone are fewer tokens)
    assert max(r["prompt_tokens"] for r in turns) > at_least, turns
