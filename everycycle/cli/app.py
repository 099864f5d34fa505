"""The everycycle command line: parse, call the client, render, map errors to exit codes.

stdout of ``run`` carries generated text only; every diagnostic goes to stderr.
Nothing heavy is imported at start: llama_cpp only on the embedded path.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from .. import __version__, paths
from ..errors import (
    AlreadyRunningError,
    ConfigError,
    DaemonUnavailableError,
    ErrorKind,
    EverycycleError,
)
from ..protocol import Accepted, Error, FleetDescription, Format, Generate, Tokens, encode

if TYPE_CHECKING:
    from ..client.aio import BaseClient

EXIT_CODES = {
    ErrorKind.INTERNAL: 1,
    ErrorKind.INVALID: 2,
    ErrorKind.MODEL_NOT_LOADED: 3,
    ErrorKind.REJECTED: 4,
    ErrorKind.CANCELLED: 5,
}
EXIT_INTERRUPTED = 130
EXIT_UNAVAILABLE = 69

app = typer.Typer(
    help="A local LLM daemon and CLI over llama.cpp.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SocketOpt = Annotated[Path | None, typer.Option("--socket", help="Daemon socket path.",
                                                envvar="EVERYCYCLE_SOCKET")]
ModelsOpt = Annotated[Path | None, typer.Option("--models", help="Use this models.toml only.")]
ModelOpt = Annotated[str | None, typer.Option("-m", "--model", help="Model name.")]
MaxTokensOpt = Annotated[int | None, typer.Option("-n", "--max-tokens",
                                                  help="Longest answer, in tokens.")]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature")]
SeedOpt = Annotated[int | None, typer.Option("--seed")]
NoDaemonOpt = Annotated[bool, typer.Option("--no-daemon", help="Run in-process.")]
OfflineOpt = Annotated[bool, typer.Option("--offline", help="Never download a model.")]
VerboseOpt = Annotated[bool, typer.Option("-v", "--verbose")]


def _fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"everycycle: {message}\n")
    raise typer.Exit(code)


def _exit_for(exc: EverycycleError) -> NoReturn:
    raise typer.Exit(_report(exc))


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"everycycle {__version__}\n")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Show the version and exit.")] = False,
) -> None:
    """A local LLM daemon and CLI over llama.cpp."""


@contextlib.asynccontextmanager
async def _client(socket: Path | None, models: Path | None, no_daemon: bool,
                  status: _Status) -> AsyncIterator[BaseClient]:
    from ..client.aio import connect
    from ..client.inprocess import embedded

    if not no_daemon:
        try:
            async with connect(socket) as client:
                yield client
                return
        except DaemonUnavailableError:
            status.show("no daemon: running in-process")
    async with embedded(models) as client:
        yield client


class _Status:
    """A one-line status on stderr, only on a terminal (or with -v), cleared when text comes."""

    def __init__(self, verbose: bool) -> None:
        self.tty = sys.stderr.isatty()
        self.enabled = self.tty or verbose
        self.shown = False

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write(f"\r\x1b[2K{text}")
            self.shown = True
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()
            self.shown = False


def _registry_default(models: Path | None) -> str:
    from ..models.registry import load_registry

    return load_registry(models).default_name()


@app.command()
def run(
    prompt: Annotated[str | None, typer.Argument(help="The prompt; piped stdin is appended.")]
    = None,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = None,
    top_p: Annotated[float | None, typer.Option("--top-p")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k")] = None,
    seed: SeedOpt = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")]
    = None,
    deadline: Annotated[float | None, typer.Option("--deadline", help="Seconds.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template.")] = False,
    json_schema: Annotated[Path | None, typer.Option(
        "--json-schema", help="Output must validate against this JSON Schema file.")] = None,
    grammar: Annotated[Path | None, typer.Option(
        "--grammar", help="Output must follow this GBNF grammar file (rule `root`).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the ServerEvent lines.")]
    = False,
    no_daemon: NoDaemonOpt = False,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text, streaming it to stdout; with no PROMPT on a terminal, chat.

    Example: cat notes.md | everycycle run "Summarize:" | tee out.txt
    """
    if prompt is None and sys.stdin.isatty() and not as_json:
        _chat(model=model, system=None, max_tokens=max_tokens, temperature=temperature,
              seed=seed, no_daemon=no_daemon, offline=offline, models=models, socket=socket,
              verbose=verbose)
        return
    text = prompt or ""
    if not sys.stdin.isatty():
        piped = sys.stdin.buffer.read().decode("utf-8", "replace")
        if piped:
            text = f"{text}\n\n{piped}" if text else piped
    if prompt is None and not text:
        _fail("usage: give a PROMPT or pipe text on stdin", 2)
    status = _Status(verbose)
    try:
        name = model or _registry_default(models)
        req = Generate(
            request_id=uuid.uuid4().hex, model=name, prompt=text, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=tuple(stop) if stop else None, format=Format.RAW if raw else None,
            deadline_ms=None if deadline is None else max(1, int(deadline * 1000)),
            json_schema=_read_text(json_schema, "--json-schema"),
            grammar=_read_text(grammar, "--grammar"),
        )
        _prepull(name, models, offline)
        if not raw:
            _note_if_no_template(name, models)
    except EverycycleError as exc:
        _exit_for(exc)
    import anyio

    code = anyio.run(_run, req, socket, models, no_daemon, as_json, status)
    raise typer.Exit(code)


async def _run(req: Generate, socket: Path | None, models: Path | None, no_daemon: bool,
               as_json: bool, status: _Status) -> int:
    import anyio

    from .interrupt import Interrupt

    out = sys.stdout.buffer
    interrupt = Interrupt()
    try:
        async with _client(socket, models, no_daemon, status) as client:
            status.show("loading…")
            async with anyio.create_task_group() as tg:
                tg.start_soon(interrupt.watch, client, req.request_id)
                result = 0
                try:
                    async for event in client.request(req):
                        if as_json:
                            out.write(encode(event))
                            out.flush()
                        if isinstance(event, Accepted):
                            if event.queue_position:
                                status.show(f"queued: position {event.queue_position}")
                            else:
                                status.show("generating…")
                        elif isinstance(event, Tokens):
                            status.clear()
                            if not as_json and event.chunk.text:
                                out.write(event.chunk.text.encode("utf-8"))
                                out.flush()
                        elif isinstance(event, Error):
                            status.clear()
                            if interrupt.pressed:
                                result = EXIT_INTERRUPTED
                            else:
                                sys.stderr.write(f"everycycle: {event.kind.value}: "
                                                 f"{event.message}\n")
                                result = EXIT_CODES[event.kind]
                except BrokenPipeError:
                    # The reader went away (`| head`): cancel on the daemon, exit quietly.
                    with anyio.move_on_after(2, shield=True):
                        await client.cancel_if_active(req.request_id)
                    _silence_stdout()
                    result = 0
                except EverycycleError as exc:  # e.g. the daemon died mid-stream
                    status.clear()
                    result = _report(exc)
                tg.cancel_scope.cancel()
            if not as_json and result == 0 and sys.stdout.isatty():
                out.write(b"\n")
            return result
    except EverycycleError as exc:
        status.clear()
        return _report(exc)


def _read_text(path: Path | None, option: str) -> str | None:
    """A file's text for ``option``. Raises ConfigError naming the file."""
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{option} {path}: {getattr(exc, 'strerror', None) or exc}"
                          ) from None


@app.command()
def embed(
    texts: Annotated[list[str] | None, typer.Argument(
        help="Texts to embed; with none, each line of stdin is one.")] = None,
    model: ModelOpt = None,
    no_daemon: NoDaemonOpt = False,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Print one JSON line {"index", "embedding"} per text (L2-normalized).

    Example: printf 'a cat\na dog\n' | everycycle embed > vectors.jsonl
    """
    items = list(texts or [])
    if not items and not sys.stdin.isatty():
        items = [ln for ln in sys.stdin.read().splitlines() if ln.strip()]
    if not items:
        _fail("usage: give TEXT… or pipe lines on stdin", 2)
    status = _Status(verbose)
    try:
        name = model or _registry_default(models)
        _prepull(name, models, offline)
        from ..protocol import Embed

        Embed(request_id="probe", model=name, input=tuple(items))  # validate first
    except EverycycleError as exc:
        _exit_for(exc)
    import anyio

    async def go() -> int:
        try:
            async with _client(socket, models, no_daemon, status) as client:
                vectors = await client.embed(name, items)
        except EverycycleError as exc:
            status.clear()
            return _report(exc)
        out = sys.stdout
        for i, v in enumerate(vectors):
            out.write(json.dumps({"index": i, "embedding": list(v)}) + "\n")
        out.flush()
        return 0

    raise typer.Exit(anyio.run(go))


@app.command("chat")
def chat_cmd(
    model: ModelOpt = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = None,
    seed: SeedOpt = None,
    no_daemon: NoDaemonOpt = False,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Chat with a model: the whole conversation goes with every turn.

    Example: everycycle chat --system "Answer in one sentence."
    """
    _chat(model=model, system=system, max_tokens=max_tokens, temperature=temperature,
          seed=seed, no_daemon=no_daemon, offline=offline, models=models, socket=socket,
          verbose=verbose)


def _chat(*, model: str | None, system: str | None, max_tokens: int | None,
          temperature: float | None, seed: int | None, no_daemon: bool, offline: bool,
          models: Path | None, socket: Path | None, verbose: bool) -> None:
    status = _Status(verbose)
    try:
        name = model or _registry_default(models)
        _prepull(name, models, offline)
        options: dict[str, Any] = {
            k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature),
                              ("seed", seed)) if v is not None
        }
        Generate(request_id="probe", model=name, prompt="", **options)  # validate options
    except EverycycleError as exc:
        _exit_for(exc)
    import anyio

    async def session() -> int:
        from .chat import chat

        try:
            async with _client(socket, models, no_daemon, status) as client:
                def loading(text: str) -> None:
                    if text:
                        status.show(text)
                    else:
                        status.clear()

                return await chat(client, name, system=system, options=options,
                                  on_loading=loading)
        except EverycycleError as exc:
            status.clear()
            return _report(exc)

    raise typer.Exit(anyio.run(session))


def _note_if_no_template(name: str, models: Path | None) -> None:
    """Say once, on stderr, that a chat-format request goes to a model without a chat
    template (its prompt is then sent as is). Quiet when the file is not local yet."""
    from ..engine.gguf import read_metadata
    from ..models.registry import load_registry, local_file

    spec = load_registry(models).models.get(name)
    if spec is None or spec.format is Format.RAW:
        return
    if spec.package is not None and spec.package_file is None:
        return  # finding the file would import the weights package
    try:
        path = local_file(spec)
        meta = read_metadata(path)
    except EverycycleError:
        return
    if "tokenizer.chat_template" not in meta:
        sys.stderr.write(f"everycycle: note: {name} has no chat template; the prompt is sent "
                         "as is (a completion model; use --raw to silence this)\n")


def _report(exc: EverycycleError) -> int:
    """One line on stderr; the exit code for ``exc``."""
    if isinstance(exc, DaemonUnavailableError):
        sys.stderr.write(f"everycycle: {exc.message}\n")
        return EXIT_UNAVAILABLE
    sys.stderr.write(f"everycycle: {exc.kind.value}: {exc.message}\n")
    return EXIT_CODES[exc.kind]


def _silence_stdout() -> None:
    # Point fd 1 at /dev/null so the interpreter's final flush cannot fail again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _call(socket: Path | None, fn: Any, *, unavailable_raises: bool = False) -> Any:
    """Run ``fn(client)`` on a blocking client; errors exit with their code.

    With ``unavailable_raises``, DaemonUnavailableError propagates to the caller.
    """
    from ..client.sync import SyncClient

    try:
        with SyncClient(socket) as client:
            return fn(client)
    except DaemonUnavailableError as exc:
        if unavailable_raises:
            raise
        _exit_for(exc)
    except EverycycleError as exc:
        _exit_for(exc)


def _fleet(socket: Path | None) -> Any:
    return _call(socket, lambda c: c.describe_fleet(), unavailable_raises=True)


@app.command()
def fleet(
    as_json: Annotated[bool, typer.Option("--json", help="Print the FleetSnapshot line.")]
    = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh live until Ctrl-C.")] = False,
    socket: SocketOpt = None,
) -> None:
    """Show executors, loaded models and active requests.

    Example: everycycle fleet --json
    """
    try:
        snap = _fleet(socket)
    except DaemonUnavailableError as exc:
        sys.stderr.write(f"everycycle: {exc.message}\n")
        if not as_json:
            from rich.console import Console

            from ..engine.executors import discover
            from .render import local_executors_view

            Console(stderr=True).print(local_executors_view(discover()))
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    if as_json:
        sys.stdout.buffer.write(encode(FleetDescription(snap)))
        return
    from rich.console import Console

    from .render import fleet_view

    console = Console(stderr=not sys.stdout.isatty())
    if not watch:
        console.print(fleet_view(snap))
        return
    from rich.live import Live

    with contextlib.suppress(KeyboardInterrupt), Live(fleet_view(snap), console=console) as live:
        while True:
            time.sleep(1)
            try:
                live.update(fleet_view(_fleet(socket)))
            except DaemonUnavailableError:
                break


models_app = typer.Typer(no_args_is_help=False)
app.add_typer(models_app, name="models")


@models_app.callback(invoke_without_command=True)
def models_cmd(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    models: ModelsOpt = None,
) -> None:
    """List the model registry.

    Example: everycycle models --json
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..models.registry import load_registry

    try:
        reg = load_registry(models)
    except EverycycleError as exc:
        _exit_for(exc)
    rows: list[dict[str, Any]] = []
    for spec in reg.models.values():
        rows.append({
            "name": spec.name, "default": spec.name == reg.default, "source": spec.source,
            "revision": spec.revision, "available": _available(spec), "context": spec.context,
            "parallel": spec.parallel, "executor": spec.executor,
            "kind": "completion" if spec.format is Format.RAW else "chat",
            "kv_cache_type": spec.kv_cache_type, **_needs(spec),
        })
    if as_json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return
    from rich.console import Console

    from .render import models_view

    Console(stderr=not sys.stdout.isatty()).print(models_view(rows))


@models_app.command("add")
def models_add(
    name: str,
    url: Annotated[str, typer.Argument(help="hf://owner/repo/file.gguf[@revision]")],
    context: Annotated[int, typer.Option("--context")] = 4096,
    parallel: Annotated[int, typer.Option("--parallel")] = 4,
) -> None:
    """Download a hub GGUF and record it, pinned, in your models.toml.

    Example: everycycle models add qwen hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf
    """
    from ..models import hub
    from ..models.registry import add_user_entry

    try:
        ref = hub.parse_hf_url(url)
        path = hub.download(ref, progress=sys.stderr.isatty())
        commit = hub.commit_of(path) or ref.revision
        digest = hub.sha256_of(path)
        where = add_user_entry(name, {
            "hf_repo": ref.repo, "hf_file": ref.file, "revision": commit, "sha256": digest,
            "context": context, "parallel": parallel,
        })
    except EverycycleError as exc:
        _exit_for(exc)
    sys.stderr.write(f"everycycle: added '{name}' (revision {commit}, sha256 {digest}) "
                     f"to {where}\n")


@app.command()
def pull(
    model: Annotated[str, typer.Argument(help="A registry name or hf://owner/repo/file[@rev]")],
    models: ModelsOpt = None,
) -> None:
    """Download a model into the Hugging Face cache; prints its local path.

    Example: everycycle pull hf://ggml-org/gemma-3-270m-it-GGUF/gemma-3-270m-it-Q8_0.gguf
    """
    from ..models import hub
    from ..models.registry import load_registry, local_file

    progress = sys.stderr.isatty()
    try:
        if model.startswith("hf:"):
            path = hub.download(hub.parse_hf_url(model), progress=progress)
        else:
            spec = load_registry(models).get(model)
            if spec.hf_repo is not None:
                path = hub.download(spec.hub_ref, sha256=spec.sha256, progress=progress)
            else:
                path = local_file(spec)
    except EverycycleError as exc:
        _exit_for(exc)
    sys.stdout.write(f"{path}\n")


def _prepull(name: str, models: Path | None, offline: bool) -> None:
    """Download a hub model the registry names before asking for it (progress on stderr).

    Raises EverycycleError subclasses; a name the local registry does not know is left
    for the daemon to judge.
    """
    from ..models.registry import load_registry, local_file

    spec = load_registry(models).models.get(name)
    if spec is None or spec.hf_repo is None:
        return
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    local_file(spec, download=not offline, progress=sys.stderr.isatty())


def _needs(spec: Any) -> dict[str, int | None]:
    """What ``spec`` will need in memory (weights, KV cache), if its file is here."""
    from ..engine.memory import plan
    from ..models.registry import local_file

    if spec.package is not None and spec.package_file is None:
        return {"weights_bytes": None, "kv_bytes": None}  # would import the package
    try:
        needs = plan(local_file(spec), context=spec.context, parallel=spec.parallel,
                     kv_cache_type=spec.kv_cache_type)
    except EverycycleError:
        return {"weights_bytes": None, "kv_bytes": None}
    return {"weights_bytes": needs.weights, "kv_bytes": needs.kv}


def _available(spec: Any) -> bool:
    import importlib.util

    if spec.path is not None:
        return bool(spec.path.is_file())
    if spec.package is not None:
        if spec.package_file is not None:
            from ..models.registry import package_path

            found = package_path(spec)
            return found is not None and found.is_file()
        return importlib.util.find_spec(spec.package) is not None
    from ..models.hub import cached_file

    try:
        cached_file(spec.hub_ref, sha256=spec.sha256, name=spec.name)
    except EverycycleError:
        return False
    return True


@app.command()
def load(
    model: str,
    executor: Annotated[str | None, typer.Option("--executor", help="cuda, metal, cpu, …")]
    = None,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
) -> None:
    """Load MODEL on the daemon.  Example: everycycle load gemma-3-270m --executor cpu"""
    try:
        _prepull(model, models, offline)
    except EverycycleError as exc:
        _exit_for(exc)
    _call(socket, lambda c: c.load(model, executor))


@app.command()
def unload(model: str, socket: SocketOpt = None) -> None:
    """Unload MODEL (its requests are cancelled).  Example: everycycle unload gemma-3-270m"""
    _call(socket, lambda c: c.unload(model))


@app.command()
def cancel(request_id: str, socket: SocketOpt = None) -> None:
    """Cancel a request by id.  Example: everycycle cancel 3f2a…"""
    _call(socket, lambda c: c.cancel(request_id))


@app.command()
def stop(socket: SocketOpt = None) -> None:
    """Shut the daemon down gracefully.  Example: everycycle stop"""
    _call(socket, lambda c: c.shutdown())


@app.command()
def daemon(
    socket: SocketOpt = None,
    models: ModelsOpt = None,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background.")] = False,
    tcp: Annotated[str | None, typer.Option("--tcp", help="Also listen on HOST:PORT.")] = None,
    http: Annotated[str | None, typer.Option(
        "--http", metavar="[HOST:]PORT|HOST",
        help="Serve the OpenAI-compatible HTTP API (default port 11777, loopback).")] = None,
    http_auth: Annotated[bool, typer.Option(
        "--http-auth", help="Require the bearer token on HTTP even on loopback.")] = False,
    allow_remote: Annotated[bool, typer.Option("--allow-remote")] = False,
    auto_load: Annotated[bool, typer.Option("--auto-load/--no-auto-load")] = True,
    audit_prompts: Annotated[bool, typer.Option("--audit-prompts")] = False,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0)] = 64,
    max_inflight: Annotated[int, typer.Option("--max-inflight", min=1)] = 32,
    show_token: Annotated[bool, typer.Option("--show-token", help="Print the TCP token.")]
    = False,
) -> None:
    """Run the daemon in the foreground (or --detach).  Example: everycycle daemon --detach"""
    from ..daemon.server import DaemonConfig, load_or_create_token, serve
    from ..daemon.supervisor import Limits

    if show_token:
        sys.stdout.write(load_or_create_token() + "\n")
        return
    sock = socket or paths.socket_path()
    tcp_addr = None
    if tcp is not None:
        host, _, port = tcp.rpartition(":")
        if not host or not port.isdigit():
            _fail("--tcp wants HOST:PORT", 2)
        tcp_addr = (host.strip("[]"), int(port))
    http_addr = None
    if http is not None:
        try:
            http_addr = parse_http_address(http)
        except ValueError as exc:
            _fail(str(exc), 2)
    if detach:
        _detach(sock, sys.argv[1:])
        return
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = DaemonConfig(socket=sock, models_file=models,
                          limits=Limits(max_queue=max_queue, max_inflight=max_inflight),
                          auto_load=auto_load, audit_prompts=audit_prompts, tcp=tcp_addr,
                          allow_remote=allow_remote, http=http_addr, http_auth=http_auth)
    import anyio

    try:
        anyio.run(serve, config)
    except AlreadyRunningError as exc:
        _fail(exc.message, 1)
    except EverycycleError as exc:
        _fail(exc.message, EXIT_CODES[exc.kind])


DEFAULT_HTTP_PORT = 11777  # everycycle.daemon.http.DEFAULT_PORT, without importing it


def parse_http_address(text: str) -> tuple[str, int]:
    """``PORT``, ``HOST``, ``HOST:PORT`` or ``[V6]:PORT`` to (host, port); loopback and
    port 11777 by default. Raises ValueError naming the problem."""
    host, port = "127.0.0.1", DEFAULT_HTTP_PORT
    text = text.strip()
    if text.isdigit():
        port = int(text)
    elif text.startswith("["):
        inner, _, rest = text[1:].partition("]")
        host = inner
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ValueError(f"--http {text}: want [HOST]:PORT")
            port = int(rest[1:])
    elif text.count(":") == 1:
        h, _, p = text.partition(":")
        if not p.isdigit():
            raise ValueError(f"--http {text}: the port must be a number")
        host, port = h or host, int(p)
    elif text and ":" not in text:
        host = text
    else:
        raise ValueError(f"--http {text}: want PORT, HOST or HOST:PORT")
    if not 0 <= port <= 65535:
        raise ValueError(f"--http {text}: the port must be 0-65535")
    return host, port


def _detach(sock: Path, argv: list[str]) -> None:
    import subprocess

    from ..daemon.server import read_pid

    log_path = paths.log_dir() / "daemon.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = [a for a in argv if a != "--detach"]
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "everycycle", *args, "--socket", str(sock)],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _fail(f"the daemon exited with {proc.returncode}; see {log_path}", 1)
        if read_pid(sock) == proc.pid and _answers(sock):
            http = ""
            if "--http" in args:
                http = _call(sock, lambda c: c.describe_fleet()).http
                http = f" and {http}/v1" if http else ""
            sys.stderr.write(f"everycycle: daemon pid {proc.pid} serving {sock}{http}\n")
            return
        time.sleep(0.05)
    _fail(f"the daemon did not start within 60 s; see {log_path}", 1)


def _answers(sock: Path) -> bool:
    import socket as pysocket

    s = pysocket.socket(pysocket.AF_UNIX)
    try:
        s.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        s.close()


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:  # Ctrl-C outside any request (e.g. as one just ended)
        sys.stderr.write("\n")
        raise SystemExit(EXIT_INTERRUPTED) from None
