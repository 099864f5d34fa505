"""Refreshes the corpus of real MCP servers' tool lists (tests/data/mcp/<name>.json).

Each server in SERVERS is started over stdio from npm, pinned at an exact version, with
dummy credentials; the collector speaks MCP's JSON-RPC to it (initialize, the initialized
notification, tools/list with its pagination) and writes the tools exactly as the server
returned them. Stdlib only:

    python tests/data/mcp/collect.py [--prefix DIR] [--timeout S] [NAME ...]
    python tests/data/mcp/collect.py --table   # the README's table, from the JSON files

Without --prefix each server runs through `npx -y PACKAGE@VERSION`; with it each package is
first `npm install`ed into DIR/<name> and its bin is run from there. A server that fails is
reported on stderr and the others go on; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
PROTOCOL_VERSION = "2025-06-18"
CLIENT_INFO = {"name": "everycycle-collector", "version": "1"}


@dataclass(frozen=True)
class Server:
    name: str
    package: str
    version: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # The bin to run where the package has several and none is named as the package.
    bin: str | None = None

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


SERVERS: tuple[Server, ...] = (
    Server("playwright", "@playwright/mcp", "0.0.86", ("--headless",)),
    Server("context7", "@upstash/context7-mcp", "4.1.1"),
    Server("filesystem", "@modelcontextprotocol/server-filesystem", "2026.8.31", ("/tmp",)),
    Server(
        "github",
        "@modelcontextprotocol/server-github",
        "2025.4.8",
        env={"GITHUB_PERSONAL_ACCESS_TOKEN": "ghp_dummy"},
    ),
    Server(
        "memory",
        "@modelcontextprotocol/server-memory",
        "2026.8.31",
        env={"MEMORY_FILE_PATH": "/tmp/everycycle-mcp-memory.json"},
    ),
    Server("sequential-thinking", "@modelcontextprotocol/server-sequential-thinking", "2026.8.31"),
    Server("everything", "@modelcontextprotocol/server-everything", "2026.8.31", ("stdio",)),
    Server(
        "notion",
        "@notionhq/notion-mcp-server",
        "2.5.2",
        env={
            "NOTION_TOKEN": "ntn_dummy",
            "OPENAPI_MCP_HEADERS": json.dumps(
                {"Authorization": "Bearer ntn_dummy", "Notion-Version": "2022-06-28"}
            ),
        },
    ),
    Server("tavily", "tavily-mcp", "0.2.22", env={"TAVILY_API_KEY": "tvly-dummy"}),
    Server("firecrawl", "firecrawl-mcp", "3.26.0", env={"FIRECRAWL_API_KEY": "fc-dummy"}),
    Server(
        "sentry",
        "@sentry/mcp-server",
        "0.39.0",
        ("--access-token=sntrys_dummy",),
        env={"SENTRY_ACCESS_TOKEN": "sntrys_dummy"},
    ),
    Server("chrome-devtools", "chrome-devtools-mcp", "1.11.0", ("--headless",)),
    Server("puppeteer", "@modelcontextprotocol/server-puppeteer", "2025.5.12"),
    Server(
        "brave-search",
        "@modelcontextprotocol/server-brave-search",
        "0.6.2",
        env={"BRAVE_API_KEY": "brave-dummy"},
    ),
    Server("exa", "exa-mcp-server", "3.4.1", env={"EXA_API_KEY": "exa-dummy"}),
    Server(
        "supabase",
        "@supabase/mcp-server-supabase",
        "0.13.0",
        # Every feature group but "docs", whose tool fetches its schema from the network.
        (
            "--access-token=sbp_dummy",
            "--features=account,database,debugging,development,functions,branching,storage",
        ),
    ),
    Server("kubernetes", "mcp-server-kubernetes", "4.1.7"),
    Server(
        "figma",
        "figma-developer-mcp",
        "0.13.2",
        ("--stdio",),
        env={"FIGMA_API_KEY": "figd_dummy"},
    ),
    Server(
        "browserbase",
        "@browserbasehq/mcp-server-browserbase",
        "2.4.3",
        env={"BROWSERBASE_API_KEY": "bb_dummy", "BROWSERBASE_PROJECT_ID": "dummy-project"},
    ),
    Server(
        "mongodb",
        "mongodb-mcp-server",
        "3.0.4",
        env={"MDB_MCP_CONNECTION_STRING": "mongodb://127.0.0.1:1/dummy"},
    ),
    # 0.3 only relays to mcp.stripe.com; 0.2 builds its tools locally.
    Server("stripe", "@stripe/mcp", "0.2.5", ("--tools=all", "--api-key=sk_test_dummy")),
    Server(
        "desktop-commander",
        "@wonderwhy-er/desktop-commander",
        "0.2.52",
        bin="desktop-commander",
    ),
    Server("chart", "@antv/mcp-server-chart", "0.9.10"),
    Server("netlify", "@netlify/mcp", "1.15.1", env={"NETLIFY_PERSONAL_ACCESS_TOKEN": "nfp_dummy"}),
    Server("mapbox", "@mapbox/mcp-server", "0.14.0", env={"MAPBOX_ACCESS_TOKEN": "pk.dummy"}),
    Server(
        "circleci",
        "@circleci/mcp-server-circleci",
        "0.20.0",
        env={"CIRCLECI_TOKEN": "circleci-dummy"},
    ),
    Server(
        "executeautomation-playwright",
        "@executeautomation/playwright-mcp-server",
        "1.0.12",
    ),
    Server(
        "hubspot", "@hubspot/mcp-server", "0.4.0", env={"PRIVATE_APP_ACCESS_TOKEN": "pat-dummy"}
    ),
    Server("pinecone", "@pinecone-database/mcp", "0.3.0", env={"PINECONE_API_KEY": "pcsk_dummy"}),
    Server(
        "launchdarkly",
        "@launchdarkly/mcp-server",
        "0.6.2",
        ("start", "--api-key", "api-dummy"),
    ),
    Server("airtable", "airtable-mcp-server", "1.14.0", env={"AIRTABLE_API_KEY": "pat_dummy"}),
    Server("azure", "@azure/mcp", "2.0.5", ("server", "start")),
    Server(
        "postman",
        "@postman/postman-mcp-server",
        "2.13.0",
        env={"POSTMAN_API_KEY": "PMAK-dummy"},
    ),
    Server(
        "clarity",
        "@microsoft/clarity-mcp-server",
        "2.0.1",
        ("--clarity_api_token=dummy",),
    ),
    Server("vapi", "@vapi-ai/mcp-server", "0.0.11", env={"VAPI_TOKEN": "dummy"}),
    Server("shopify-dev", "@shopify/dev-mcp", "1.16.0"),
    Server(
        "gitlab",
        "@zereight/mcp-gitlab",
        "2.1.64",
        env={
            "GITLAB_PERSONAL_ACCESS_TOKEN": "glpat-dummy",
            "GITLAB_API_URL": "http://127.0.0.1:1/api/v4",
        },
    ),
    Server(
        "task-master",
        "task-master-ai",
        "0.43.1",
        env={"ANTHROPIC_API_KEY": "sk-ant-dummy", "TASK_MASTER_TOOLS": "all"},
    ),
    Server(
        "n8n",
        "n8n-mcp",
        "2.87.0",
        env={
            "MCP_MODE": "stdio",
            "LOG_LEVEL": "error",
            "DISABLE_CONSOLE_OUTPUT": "true",
            # With an API configured it lists its workflow-management tools too.
            "N8N_API_URL": "http://127.0.0.1:1",
            "N8N_API_KEY": "dummy",
        },
    ),
    Server("git", "@cyanheads/git-mcp-server", "2.15.3", env={"MCP_TRANSPORT_TYPE": "stdio"}),
    Server("octocode", "octocode-mcp", "19.1.0", env={"GITHUB_TOKEN": "ghp_dummy"}),
    Server(
        "pubmed",
        "@cyanheads/pubmed-mcp-server",
        "2.7.4",
        env={"MCP_TRANSPORT_TYPE": "stdio"},
    ),
    Server(
        "lara",
        "@translated/lara-mcp",
        "1.0.6",
        env={"LARA_ACCESS_KEY_ID": "dummy", "LARA_ACCESS_KEY_SECRET": "dummy"},
    ),
    Server(
        "line",
        "@line/line-bot-mcp-server",
        "0.5.0",
        env={"CHANNEL_ACCESS_TOKEN": "dummy", "DESTINATION_USER_ID": "U0"},
    ),
    Server("brightdata", "@brightdata/mcp", "2.11.3", env={"API_TOKEN": "dummy"}),
    Server("agent-browser", "@agent-infra/mcp-server-browser", "1.2.29"),
    Server(
        "jira",
        "@aashari/mcp-server-atlassian-jira",
        "3.3.0",
        env={
            "ATLASSIAN_SITE_NAME": "dummy",
            "ATLASSIAN_USER_EMAIL": "dummy@example.com",
            "ATLASSIAN_API_TOKEN": "dummy",
        },
    ),
    Server(
        "perplexity",
        "@perplexity-ai/mcp-server",
        "1.2.1",
        env={"PERPLEXITY_API_KEY": "pplx-dummy"},
    ),
)

# Set for every server: no browser downloads, no prompts, no telemetry.
COMMON_ENV = {
    "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1",
    "PUPPETEER_SKIP_DOWNLOAD": "1",
    "PUPPETEER_SKIP_CHROMIUM_DOWNLOAD": "1",
    "npm_config_yes": "true",
    "npm_config_fund": "false",
    "npm_config_audit": "false",
    "npm_config_update_notifier": "false",
    "DO_NOT_TRACK": "1",
    "CHROME_DEVTOOLS_MCP_NO_USAGE_STATISTICS": "1",
}


class CollectError(Exception):
    pass


def _bin_of(prefix: Path, server: Server) -> Path:
    """The executable that `npx` would run, found in an npm-installed prefix."""
    if server.bin is not None:
        name = server.bin
    else:
        meta = json.loads((prefix / "node_modules" / server.package / "package.json").read_text())
        bins: Any = meta.get("bin")
        unscoped = server.package.rsplit("/", 1)[-1]
        if isinstance(bins, str) or not bins:
            name = unscoped
        elif len(bins) == 1:
            name = next(iter(bins))
        elif unscoped in bins:
            name = unscoped
        else:
            raise CollectError(f"several bins ({', '.join(bins)}): set Server.bin")
    # npm links a scoped bin name ("@scope/x") as its last part.
    path = prefix / "node_modules" / ".bin" / name.rsplit("/", 1)[-1]
    if not path.exists():
        raise CollectError(f"no bin {path}")
    return path


def _install(prefix: Path, server: Server, env: dict[str, str]) -> Path:
    target = prefix / server.name
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["npm", "install", "--no-save", "--prefix", str(target), server.spec],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise CollectError(f"npm install failed: {done.stderr.strip()[-2000:]}")
    return _bin_of(target, server)


def _command(server: Server, prefix: Path | None, env: dict[str, str]) -> list[str]:
    if prefix is not None:
        return [str(_install(prefix, server, env)), *server.args]
    if server.bin is not None:
        return ["npx", "-y", "-p", server.spec, server.bin, *server.args]
    return ["npx", "-y", server.spec, *server.args]


def _read_lines(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


class Session:
    """One server process and the JSON-RPC exchange with it."""

    def __init__(
        self, command: list[str], env: dict[str, str], deadline: float, stderr: IO[str]
    ) -> None:
        self.deadline = deadline
        self.stderr = stderr
        self.proc = subprocess.Popen(
            command,
            env=env,
            cwd=tempfile.gettempdir(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(
            target=_read_lines, args=(self.proc.stdout, self.lines), daemon=True
        ).start()
        self.next_id = 0

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise CollectError(f"cannot write to the server: {e}; {self.stderr_tail()}") from e

    def request(self, method: str, params: dict[str, Any]) -> Any:
        self.next_id += 1
        ident = self.next_id
        self.send({"id": ident, "method": method, "params": params})
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise CollectError(f"timed out waiting for {method}; {self.stderr_tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(timeout=5)
                raise CollectError(
                    f"server exited ({self.proc.returncode}) before answering {method}; "
                    f"{self.stderr_tail()}"
                )
            try:
                message = json.loads(line)
            except ValueError:
                continue  # a log line on stdout
            if not isinstance(message, dict):
                continue
            if "method" in message:
                if "id" in message:
                    self._answer(message)
                continue  # a notification
            if message.get("id") != ident:
                continue
            if "error" in message:
                raise CollectError(f"{method} failed: {json.dumps(message['error'])}")
            return message.get("result")

    def _answer(self, message: dict[str, Any]) -> None:
        """Answers a request from the server so that it does not wait on us."""
        method = message.get("method")
        if method == "roots/list":
            self.send({"id": message["id"], "result": {"roots": []}})
        elif method == "ping":
            self.send({"id": message["id"], "result": {}})
        else:
            self.send(
                {
                    "id": message["id"],
                    "error": {"code": -32601, "message": f"method not supported: {method}"},
                }
            )

    def stderr_tail(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        text = self.stderr.read().strip()
        return "stderr: " + (text[-1500:] if text else "(empty)")

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                # The leader is gone; still end what it left in its group.
                os.killpg(self.proc.pid, signal.SIGKILL)
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                pass
            break


def collect(server: Server, prefix: Path | None, timeout: float) -> list[Any]:
    env = {**os.environ, **COMMON_ENV, **server.env}
    command = _command(server, prefix, env)
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as stderr:
        session = Session(command, env, time.monotonic() + timeout, stderr)
        try:
            return _exchange(session)
        finally:
            session.close()


def _exchange(session: Session) -> list[Any]:
    session.request(
        "initialize",
        {"protocolVersion": PROTOCOL_VERSION, "capabilities": {}, "clientInfo": CLIENT_INFO},
    )
    session.send({"method": "notifications/initialized"})
    tools: list[Any] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
        result = session.request("tools/list", params)
        if not isinstance(result, dict) or not isinstance(result.get("tools"), list):
            raise CollectError(f"tools/list returned {json.dumps(result)[:500]}")
        tools.extend(result["tools"])
        cursor = result.get("nextCursor") or None
        if cursor is None:
            return tools


def write(server: Server, tools: list[Any]) -> Path:
    path = HERE / f"{server.name}.json"
    record = {
        "server": server.name,
        "package": server.spec,
        "args": list(server.args),
        "collected": datetime.date.today().isoformat(),
        "tools": tools,
    }
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


# The JSON Schema keywords that the README's table reports, in its order.
KEYWORDS = (
    "$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf", "not", "if", "propertyNames",
    "patternProperties", "additionalProperties", "uniqueItems", "format", "pattern", "const",
    "default", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "minLength",
    "maxLength", "minimum", "maximum", "nullable",
)  # fmt: skip
# Keywords whose values are maps of names to schemas, and those whose values are data.
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_DATA = {"enum", "const", "default", "examples", "example", "required"}


def _keywords(node: Any, found: set[str], enums: list[int]) -> None:
    """Collects the keywords used anywhere in a schema and the sizes of its enums."""
    if isinstance(node, list):
        for item in node:
            _keywords(item, found, enums)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        found.add(key)
        if key == "enum" and isinstance(value, list):
            enums.append(len(value))
        if key in _DATA:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                _keywords(sub, found, enums)
        else:
            _keywords(value, found, enums)


def table() -> str:
    """The README's table, from the JSON files in this folder."""
    rows = [
        "| server | package | tools | bytes | largest enum | keywords |",
        "|---|---|--:|--:|--:|---|",
    ]
    total = 0
    for path in sorted(HERE.glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        found: set[str] = set()
        enums: list[int] = []
        for tool in record["tools"]:
            for key in ("inputSchema", "outputSchema"):
                _keywords(tool.get(key), found, enums)
        total += len(record["tools"])
        used = " ".join(f"`{k}`" for k in KEYWORDS if k in found)
        rows.append(
            f"| {record['server']} | `{record['package']}` | {len(record['tools'])} "
            f"| {path.stat().st_size} | {max(enums, default=0)} | {used} |"
        )
    rows.append(f"| **total** | | **{total}** | | | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--prefix", type=Path, help="npm install each package into PREFIX/<name> and run it there"
    )
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per server")
    parser.add_argument(
        "--table", action="store_true", help="print the README's table of the corpus and exit"
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="servers to collect (all)")
    options = parser.parse_args(argv)
    if options.table:
        print(table())  # noqa: T201
        return 0
    by_name = {server.name: server for server in SERVERS}
    unknown = [name for name in options.names if name not in by_name]
    if unknown:
        parser.error(f"unknown servers: {', '.join(unknown)} (known: {', '.join(by_name)})")
    chosen = [by_name[name] for name in options.names] or list(SERVERS)
    prefix: Path | None = options.prefix.resolve() if options.prefix else None
    failed: list[str] = []
    for server in chosen:
        started = time.monotonic()
        try:
            tools = collect(server, prefix, options.timeout)
        except (CollectError, OSError, subprocess.SubprocessError, ValueError) as e:
            failed.append(server.name)
            print(f"FAIL {server.name} ({server.spec}): {e}", file=sys.stderr)  # noqa: T201
            continue
        path = write(server, tools)
        took = time.monotonic() - started
        print(  # noqa: T201
            f"ok   {server.name}: {len(tools)} tools, {path.stat().st_size} bytes, {took:.1f} s"
        )
    if failed:
        print(f"{len(failed)} failed: {', '.join(failed)}", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
