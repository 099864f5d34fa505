"""``everycycle mcp`` (add, list, rm, tools): the MCP servers whose tools ``chat``
offers the model, in mcp.json (Claude Desktop's and Cursor's format), run by the daemon."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from ..errors import ConfigError, EverycycleError
from .common import ModelsOpt, NoDaemonOpt, SocketOpt, Status, app, exit_for, open_client

mcp_app = typer.Typer(no_args_is_help=True,
                      help="MCP servers whose tools `chat` may call (each call asks first).")
app.add_typer(mcp_app, name="mcp")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON, not a table.")]


@mcp_app.command("add")
def add_cmd(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The server's name.")],
    command: Annotated[list[str], typer.Argument(
        metavar="COMMAND [ARGS]...", help="The command that runs it on stdio (after --).")],
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", metavar="NAME=VALUE", help="An environment variable for it (repeat).")
                   ] = None,
) -> None:
    """Add (or replace) an MCP server that speaks on stdio.

    \b
    Example:
      everycycle mcp add memory -- npx -y @modelcontextprotocol/server-memory
    """
    from ..tooluse.config import McpServer, add, config_file

    if not command:
        exit_for(ConfigError("usage: everycycle mcp add NAME -- COMMAND [ARGS]..."))
    pairs = {}
    for item in env or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            exit_for(ConfigError(f"--env wants NAME=VALUE, not {item!r}"))
        pairs[key] = value
    try:
        replaced = add(McpServer(name, command[0], tuple(command[1:]), pairs))
    except (EverycycleError, OSError) as exc:
        exit_for(_wrap(exc))
    sys.stderr.write(f"{'replaced' if replaced else 'added'} MCP server '{name}' in "
                     f"{config_file()}\n")


@mcp_app.command("rm")
def rm_cmd(name: Annotated[str, typer.Argument(metavar="NAME", help="The server's name.")]
           ) -> None:
    """Remove an MCP server from mcp.json.

    \b
    Example:
      everycycle mcp rm memory
    """
    from ..tooluse.config import config_file, remove

    try:
        remove(name)
    except (EverycycleError, OSError) as exc:
        exit_for(_wrap(exc))
    sys.stderr.write(f"removed MCP server '{name}' from {config_file()}\n")


@mcp_app.command("list")
def list_cmd(as_json: JsonOpt = False) -> None:
    """The configured MCP servers (mcp.json); nothing is started.

    \b
    Example:
      everycycle mcp list --json
    """
    from ..tooluse.config import load

    try:
        servers = load()
    except EverycycleError as exc:
        exit_for(exc)
    if as_json:
        sys.stdout.write(json.dumps([{"name": s.name, "command": s.command,
                                      "args": list(s.args), "url": s.url,
                                      "problem": s.problem} for s in servers.values()]) + "\n")
        return
    from rich.console import Console

    from .render import mcp_servers_view

    Console().print(mcp_servers_view([(s.name, s.describe(), s.problem)
                                      for s in servers.values()]))


@mcp_app.command("tools")
def tools_cmd(as_json: JsonOpt = False, no_daemon: NoDaemonOpt = False,
              models: ModelsOpt = None, socket: SocketOpt = None) -> None:
    """The tools the MCP servers offer (the daemon starts them; servers that fail to
    start are named on stderr, and the exit code is 1).

    \b
    Example:
      everycycle mcp tools
    """
    import anyio

    async def listed() -> tuple[list[tuple[str, str, str]], list[str]]:
        async with open_client(socket, models, no_daemon, Status(False)) as client:
            got = await client.list_tools()
        return [(t.name, t.server, t.description) for t in got.tools], list(got.problems)

    try:
        rows, problems = anyio.run(listed)
    except EverycycleError as exc:
        exit_for(exc)
    for problem in problems:
        sys.stderr.write(f"everycycle: {problem}\n")
    if as_json:
        sys.stdout.write(json.dumps([{"name": n, "server": s, "description": d}
                                     for n, s, d in rows]) + "\n")
    else:
        from rich.console import Console

        from .render import mcp_tools_view

        Console().print(mcp_tools_view(rows))
    if problems:
        raise typer.Exit(1)


def _wrap(exc: EverycycleError | OSError) -> EverycycleError:
    if isinstance(exc, EverycycleError):
        return exc
    return ConfigError(f"cannot write mcp.json: {exc}")
