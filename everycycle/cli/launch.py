"""``everycycle launch AGENT``: a coding agent pointed at this daemon, as ``ollama launch``.

Each agent is one row of ``AGENTS``: its command, its npm package (named when it is not
installed), and how it is told where to go — environment variables and command-line
overrides only, or a config file under our own state dir. Nothing is written into the
user's own agent configuration. The daemon is started (detached, HTTP on loopback) when
none runs; the agent gets the daemon's token as its key, and then replaces this process.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .. import paths, statefile
from ..errors import EverycycleError
from .common import app, exit_for, fail, hub_model

if TYPE_CHECKING:
    from ..models.registry import ModelSpec

PROVIDER = "everycycle"
SESSION_HEADER = "X-Session-ID"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the agent goes: the daemon's HTTP base (no trailing /v1), a key, a model."""

    base: str
    key: str
    model: str
    context: int
    """The model's context as loaded, in tokens a slot."""
    trained: int = 0
    """The context the model was trained for (0: unknown)."""
    chosen: bool = False
    """Whether the daemon chose the context (models.toml names none)."""
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Sent as ``X-Session-ID`` on each of the agent's requests: a router in front of
    several daemons (vllm-router's consistent_hash and sticky_least_loaded policies)
    keeps the session on the daemon that holds its cache."""


@dataclass(frozen=True, slots=True)
class Agent:
    """One launchable agent (a row of the table)."""

    name: str
    command: str
    package: str
    wire: str
    """The API it speaks to us: Anthropic Messages, OpenAI Responses, chat completions."""
    env: Callable[[Endpoint], dict[str, str | None]]
    """Its environment's changes (None: unset)."""
    args: Callable[[Endpoint], list[str]]
    """Arguments before the user's own."""
    prompt: int
    """About how many tokens its first request takes (system prompt and tool schemas),
    measured on its recorded requests (tests/data/agents) with SmolLM2's tokenizer."""


ROOM = 8_192
"""Tokens a context needs past an agent's first prompt: its answers, tool results and
the turns that follow."""


def context_warning(agent: Agent, where: Endpoint) -> str | None:
    """A line for stderr when the model's context cannot hold the agent's session,
    saying why: models.toml's ``context``, what the model was trained for, or memory."""
    if where.context >= agent.prompt + ROOM:
        return None
    too_long = where.context < agent.prompt
    first = (f"{agent.command}'s first request alone is about {agent.prompt:,} tokens (its "
             "system prompt and tools), " + ("so every request will be refused as too long"
                                              if too_long else
                                              "which leaves little room for a session"))
    if where.trained and where.trained < agent.prompt + ROOM and where.context >= min(
            where.trained, 1 << (where.trained.bit_length() - 1)):
        return (f"everycycle: warning: model '{where.model}' was trained for a "
                f"{where.trained:,}-token context; {first}: pick a model trained for more.")
    if where.chosen:
        return (f"everycycle: warning: model '{where.model}' has a {where.context:,}-token "
                f"context, the most its executor's memory holds for it now; {first}: "
                "unload other models, or give it `parallel = 1` in models.toml.")
    return (f"everycycle: warning: model '{where.model}' has a {where.context:,}-token "
            f"context; {first}. Give the model `context = {max(32_768, agent.prompt + ROOM)}`"
            " in models.toml, or leave `context` out to have it chosen.")


def _claude_env(e: Endpoint) -> dict[str, str | None]:
    # Every tier Claude Code picks a model for (the main loop, background work,
    # subagents) maps to the one model; no traffic to Anthropic's own services.
    return {"ANTHROPIC_BASE_URL": e.base, "ANTHROPIC_AUTH_TOKEN": e.key,
            "ANTHROPIC_API_KEY": None, "ANTHROPIC_MODEL": e.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": e.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": e.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": e.model, "ANTHROPIC_SMALL_FAST_MODEL": e.model,
            "CLAUDE_CODE_SUBAGENT_MODEL": e.model, "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
            # No per-request billing line in the system prompt: the prefix stays cached.
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            # Its stream watchdog credits keep-alive pings for about five minutes, then
            # waits this long for a real event: a long prompt's prefill on a CPU fits.
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
            "ANTHROPIC_CUSTOM_HEADERS": f"{SESSION_HEADER}: {e.session}"}


def _codex_args(e: Endpoint) -> list[str]:
    provider = f"model_providers.{PROVIDER}"
    return ["-c", f"model_provider={PROVIDER}", "-c", f"{provider}.name={PROVIDER}",
            "-c", f"{provider}.base_url={e.base}/v1", "-c", f"{provider}.wire_api=responses",
            "-c", f'{provider}.http_headers={{"{SESSION_HEADER}"="{e.session}"}}',
            "-c", f"{provider}.env_key=EVERYCYCLE_API_KEY", "-m", e.model,
            "-c", f"model_context_window={e.context}",
            # no calls to OpenAI's analytics or GitHub's plugin index
            "-c", "analytics.enabled=false", "--disable", "plugins"]


def opencode_config(e: Endpoint) -> Path:
    """opencode's config for this endpoint, in our state dir (OPENCODE_CONFIG names it)."""
    path = paths.state_dir() / "launch" / "opencode.json"
    config = {"$schema": "https://opencode.ai/config.json", "model": f"{PROVIDER}/{e.model}",
              "provider": {PROVIDER: {"npm": "@ai-sdk/openai-compatible", "name": PROVIDER,
                                      "options": {"baseURL": f"{e.base}/v1", "apiKey": e.key,
                                                  "headers": {SESSION_HEADER: e.session}},
                                      "models": {e.model: {"name": e.model,
                                                   "limit": {"context": e.context,
                                                             "output": e.context // 4}}}}},
              "autoupdate": False, "share": "disabled"}
    statefile.write(path, json.dumps(config, indent=2) + "\n")
    return path


AGENTS: dict[str, Agent] = {a.name: a for a in (
    Agent("claude", "claude", "@anthropic-ai/claude-code", "Anthropic Messages",
          _claude_env, lambda e: ["--model", e.model], prompt=12_000),
    Agent("codex", "codex", "@openai/codex", "OpenAI Responses",
          lambda e: {"EVERYCYCLE_API_KEY": e.key}, _codex_args, prompt=9_500),
    Agent("opencode", "opencode", "opencode-ai", "OpenAI chat completions",
          lambda e: {"OPENCODE_CONFIG": str(opencode_config(e)),
                     "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"},
          lambda e: [], prompt=7_700),
)}


def _help() -> str:
    rows = "\n".join(f"  {a.name:<9} {a.wire:<24} npm install -g {a.package}"
                     for a in AGENTS.values())
    return ("Start a coding agent against this daemon (starting the daemon, with HTTP on "
            "loopback, if none runs). Nothing of the agent's own configuration is "
            "changed.\n\n\b\nAgents:\n" + rows + "\n\n\b\nExample:\n"
            "  everycycle launch claude -m qwen -- -p 'Fix the failing test'")


def endpoint(model: str | None, models: Path | None, socket: Path | None,
             http: str | None = None, need: int | None = None) -> Endpoint:
    """The running daemon's HTTP address (starting one if none runs), its token and the
    model, loaded (with ``need`` tokens a slot where it was trained for them). Raises
    EverycycleError subclasses."""
    from ..client import SyncClient
    from ..daemon.keys import load_or_create_token
    from ..errors import DaemonUnavailableError, RequestFailedError
    from ..models.registry import load_registry
    from .daemon import DEFAULT_HTTP_PORT, _detach

    sock = socket or paths.socket_path()
    name = hub_model(model, models, False) if model else load_registry(models).default_name()
    spec = load_registry(models).get(name)  # (read again: a pull may add it)
    try:
        with SyncClient(sock):
            pass
    except DaemonUnavailableError:
        _detach(sock, ["daemon", "--http", http or f"127.0.0.1:{DEFAULT_HTTP_PORT}",
                       *(["--models", str(models)] if models else [])])
    trained = _trained(spec)
    short_of_memory = False
    with SyncClient(sock) as c:
        # (its context chosen as it loads, raised to what the agent needs where it can be)
        if need and trained >= need:
            try:
                c.load(name, context=need)
            except RequestFailedError:  # (memory: loaded as it can be, and the agent told)
                short_of_memory = True
        if not need or trained < need or short_of_memory:
            c.load(name)
        fleet = c.describe_fleet()
    http = fleet.http
    if http is None:
        fail("the daemon runs without HTTP, which agents need: stop it (everycycle stop) "
             "and start it with `everycycle daemon --detach --http 127.0.0.1:"
             f"{DEFAULT_HTTP_PORT}`, or let `launch` start it", 69)
    loaded = next((m.context for m in fleet.loaded_models if m.name == name and m.context),
                  None)
    context = loaded or spec.context or 4096
    return Endpoint(http.rstrip("/"), load_or_create_token(), name, context,
                    trained=trained, chosen=spec.context is None or short_of_memory)


def remote(url: str, token: str | None, model: str | None, models: Path | None,
           need: int) -> Endpoint:
    """``--url``: a daemon, or a router in front of several, that this user does not
    run; the model's context as it lists it (``GET /v1/models``), else ``need`` (a
    model not loaded yet gets the context it was trained for, as memory allows, when
    the agent's first request loads it). Raises EverycycleError subclasses."""
    import httpx

    from ..daemon.keys import load_or_create_token
    from ..errors import UnavailableError
    from ..models.registry import load_registry

    base = url.rstrip("/").removesuffix("/v1")
    if token is None:
        token = load_or_create_token() if paths.token_file().exists() else "unused"
    name = model or load_registry(models).default_name()
    try:
        answer = httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {token}"},
                           timeout=30)
        answer.raise_for_status()
        listed = {m.get("id"): m for m in answer.json().get("data", [])}
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise UnavailableError(f"{base}/v1/models did not answer with a model list: "
                               f"{exc}") from None
    if name not in listed:
        raise UnavailableError(f"{base} has no model '{name}' (it lists "
                               f"{', '.join(sorted(map(str, listed))) or 'none'})")
    context = listed[name].get("context_length") or need
    return Endpoint(base, token, name, int(context))


def _trained(spec: ModelSpec) -> int:
    """The context ``spec``'s model was trained for (0: its file cannot be read)."""
    from ..hardware.memory import trained_context
    from ..models.registry import local_file

    try:
        return trained_context(local_file(spec))
    except EverycycleError:
        return 0


@app.command(help=_help(), context_settings={"allow_extra_args": True,
                                             "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    agent: Annotated[str, typer.Argument(metavar="AGENT", help="claude, codex or opencode.")],
    model: Annotated[str | None, typer.Option(
        "-m", "--model", help="A registry name or hf://owner/repo[:QUANT] (pulled once); "
        "default: the registry's default.")] = None,
    models: Annotated[Path | None, typer.Option(
        "--models", help="Use this models.toml instead of the registry.")] = None,
    socket: Annotated[Path | None, typer.Option("--socket", help="The daemon's socket.")]
    = None,
    http: Annotated[str | None, typer.Option(
        "--http", metavar="ADDR", help="Where a daemon that launch starts listens "
        "(default 127.0.0.1:11777).")] = None,
    url: Annotated[str | None, typer.Option(
        "--url", metavar="URL", help="Use the daemon (or router in front of several) "
        "at this base URL instead of this user's daemon.")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="EVERYCYCLE_TOKEN", help="The key for --url (default: this "
        "user's daemon token).")] = None,
) -> None:
    row = AGENTS.get(agent)
    if row is None:
        fail(f"usage: no agent {agent!r}; launch one of {', '.join(AGENTS)}", 2)
    binary = shutil.which(row.command)
    if binary is None:
        fail(f"{row.command} is not installed: npm install -g {row.package}", 69)
    env = dict(os.environ)
    try:
        where = (remote(url, token, model, models, row.prompt + ROOM) if url else
                 endpoint(model, models, socket, http, need=row.prompt + ROOM))
        changes = row.env(where)
    except EverycycleError as exc:
        exit_for(exc)
    except OSError as exc:  # (opencode's config file under our state dir)
        fail(f"cannot write the agent's configuration: {exc}", 1)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    if where.base.startswith("https://") and env.get("SSL_CERT_FILE"):
        # (a private CA the user trusts for Python and curl: Node agents trust it too)
        env.setdefault("NODE_EXTRA_CA_CERTS", env["SSL_CERT_FILE"])
    argv = [binary, *row.args(where), *ctx.args]
    sys.stderr.write(f"everycycle: {row.command} on {where.base} ({row.wire}), model "
                     f"'{where.model}'\n")
    warning = context_warning(row, where)
    if warning:
        sys.stderr.write(warning + "\n")
    sys.stderr.flush()
    os.execve(binary, argv, env)


@app.command()
def console(
    socket: Annotated[Path | None, typer.Option("--socket", help="The daemon's socket.")]
    = None,
    http: Annotated[str | None, typer.Option(
        "--http", metavar="ADDR", help="Where a daemon that this starts listens "
        "(default 127.0.0.1:11777).")] = None,
    no_browser: Annotated[bool, typer.Option(
        "--no-browser", help="Print the console's address only.")] = False,
) -> None:
    """Open the web console (fleet, requests, chat, models, usage) in a browser, starting
    a daemon with HTTP on loopback if none runs.

    \b
    Example:
      everycycle console
    """
    import webbrowser

    try:
        where = endpoint(None, None, socket, http)
    except EverycycleError as exc:
        exit_for(exc)
    url = f"{where.base}/console/"
    sys.stderr.write(f"everycycle: the console is at {url}\n")
    if not no_browser and not webbrowser.open(url):
        sys.stderr.write("everycycle: no browser found here: open that address in one\n")
