"""The commands that ask a running daemon: fleet (one daemon or several), load,
unload, cancel, ps and stop."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import paths
from ..errors import DaemonUnavailableError, EverycycleError
from ..protocol import FleetDescription, FleetSnapshot, LoadedModel, encode
from .common import (
    EXIT_UNAVAILABLE,
    ModelsOpt,
    OfflineOpt,
    SocketOpt,
    app,
    call,
    draft_source,
    exit_for,
    fail,
    hub_model,
    prepull,
)


def _fleet(socket: Path | None) -> Any:
    return call(socket, lambda c: c.describe_fleet(), unavailable_raises=True)


@app.command()
def fleet(
    as_json: Annotated[bool, typer.Option("--json", help="Print the FleetSnapshot line.")]
    = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh live until Ctrl-C.")] = False,
    hosts: Annotated[list[str] | None, typer.Option(
        "--host", metavar="HOST:PORT|URL|SOCKET",
        help="A daemon's TCP address, HTTP(S) base URL or socket path (repeat: one view of "
        "several).")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="EVERYCYCLE_TOKEN",
        help="Key for TCP daemons (default: this user's daemon token).")] = None,
    socket: SocketOpt = None,
) -> None:
    """Show executors, loaded models and active requests.

    \b
    Example:
      everycycle fleet --json
      everycycle fleet --host box1:7000 --host https://box2:11777
    """
    if hosts:
        raise typer.Exit(_fleets(hosts, token, as_json))
    try:
        snap = _fleet(socket)
    except DaemonUnavailableError as exc:
        sys.stderr.write(f"everycycle: {exc.message}\n")
        if not as_json:
            from rich.console import Console

            from ..hardware.executors import discover
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
    import anyio
    from rich.live import Live

    gone: DaemonUnavailableError | None = None
    with contextlib.suppress(KeyboardInterrupt), Live(fleet_view(snap), console=console) as live:
        try:
            anyio.run(_watch, socket, live, snap.active_requests)
        except DaemonUnavailableError as exc:
            gone = exc
        except ExceptionGroup as group:  # (from the watch's task group)
            found, _ = group.split(DaemonUnavailableError)
            if found is None:
                raise
            first: BaseException = found
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            gone = first if isinstance(first, DaemonUnavailableError) else None
    if gone is not None:  # the frame above is the last one the daemon gave
        sys.stderr.write(f"everycycle: the daemon went away ({gone.message})\n")
        raise typer.Exit(EXIT_UNAVAILABLE)


async def _watch(socket: Path | None, live: Any, active: int) -> None:
    """Redraw ``live`` when the daemon says something happened (a Subscribe), and each
    second while requests run (their token counts move without events). Raises
    DaemonUnavailableError when the daemon goes away."""
    import anyio

    from ..client.aio import connect
    from ..client.connection import new_request_id
    from ..protocol import Subscribe
    from .render import fleet_view

    changed = anyio.Event()

    async def listen(client: Any) -> None:
        nonlocal changed
        async for _ in client.request(Subscribe(new_request_id())):
            changed.set()
        raise DaemonUnavailableError("the subscription ended")

    async with connect(socket) as events, connect(socket) as asks, \
            anyio.create_task_group() as tg:
        tg.start_soon(listen, events)
        while True:
            with anyio.move_on_after(1.0 if active else 3600.0):
                await changed.wait()
            changed = anyio.Event()
            snap = await asks.describe_fleet()
            active = snap.active_requests
            live.update(fleet_view(snap))
            await anyio.sleep(0.05)  # (a burst of events is one redraw)


def _client(host: str, token: str | None, timeout: float | None) -> Any:
    """A blocking client of the daemon at ``host`` (HOST:PORT over TCP with ``token``,
    else a socket path); exits 2 for anything else."""
    from ..client.sync import SyncClient

    is_path = "/" in host
    address, _, port = host.rpartition(":")
    if not is_path and (not address or not port.isdigit()):
        fail(f"--host {host!r}: expected HOST:PORT or a socket path", 2)
    return (SyncClient(Path(host), timeout=timeout) if is_path else
            SyncClient(tcp=(address.strip("[]"), int(port)), token=token, timeout=timeout))


def _own_token(token: str | None) -> str | None:
    """``token``, else this user's daemon token where there is one."""
    if token is None and paths.token_file().exists():
        from ..daemon.keys import load_or_create_token

        return load_or_create_token()
    return token


def _fleets(hosts: list[str], token: str | None, as_json: bool) -> int:
    """``fleet --host …``: each daemon's snapshot, then a total; exit 69 if any is down."""
    token = _own_token(token)
    found: list[tuple[str, FleetSnapshot]] = []
    unreachable: list[str] = []
    failed = 0
    for host in hosts:
        if host.startswith(("http://", "https://")):
            from ..client.httpfleet import fetch_fleet

            try:
                found.append((host, fetch_fleet(host, token)))
            except EverycycleError as exc:
                sys.stderr.write(f"everycycle: {exc.message}\n")
                failed += 1
                unreachable.append(host)
            continue
        try:
            with _client(host, token, 30) as client:
                found.append((host, client.describe_fleet()))
        except EverycycleError as exc:
            sys.stderr.write(f"everycycle: {host}: {exc.message}\n")
            failed += 1
            unreachable.append(host)
    if as_json:
        for _, snap in found:
            sys.stdout.buffer.write(encode(FleetDescription(snap)))
        sys.stdout.flush()
    else:
        from rich.console import Console

        from .render import fleets_view

        Console(stderr=not sys.stdout.isatty()).print(fleets_view(found, unreachable))
    return EXIT_UNAVAILABLE if failed else 0


@app.command()
def load(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="A registry name (see `everycycle models`).")],
    executor: Annotated[str | None, typer.Option(
        "--executor", help="auto, cpu, cuda, cuda:1, metal, vulkan, …")] = None,
    keep_alive: Annotated[str | None, typer.Option(
        "--keep-alive", help="How long it stays loaded once idle: 5m, 1h, 0, -1 (always).")]
    = None,
    context: Annotated[int | None, typer.Option(
        "--context", min=16, help="At least this many tokens a slot (a model loaded with "
        "fewer is loaded again; up to what it was trained for).")] = None,
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", help="A smaller model with the same vocabulary that drafts "
        "tokens for it to verify (speculative decoding): a name, a GGUF path or an "
        "hf:// URL.")] = None,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
) -> None:
    """Load MODEL on the daemon.

    \b
    Example:
      everycycle load gemma-3-270m --executor cpu
      everycycle load smollm2-135m --context 8192
      everycycle load qwen2.5-7b --draft-model qwen2.5-0.5b
    """
    keep_ms = None
    if keep_alive is not None:
        from ..models.keepalive import parse_keep_alive

        try:
            seconds = parse_keep_alive(keep_alive)
        except ValueError as exc:
            fail(f"--{exc}", 2)
        keep_ms = -1 if seconds < 0 else int(seconds * 1000)
    try:
        model = hub_model(model, models, offline)
        prepull(model, models, offline)
        if draft_model is not None:
            draft_model = draft_source(draft_model, models, offline)
    except EverycycleError as exc:
        exit_for(exc)

    def load_and_look(c: Any) -> LoadedModel | None:
        c.load(model, executor, keep_alive_ms=keep_ms, context=context,
               draft_model=draft_model)
        return next((m for m in c.describe_fleet().loaded_models if m.name == model), None)

    loaded = call(socket, load_and_look)
    where = f" on {loaded.assigned_executor}" if loaded is not None else ""
    engine = (f" (engine pid {loaded.engine_pid})"
              if loaded is not None and loaded.engine_pid is not None else "")
    ctx = (f", {loaded.context:,} tokens a slot" if loaded is not None and loaded.context
           else "")
    drafts = (f", drafted by {loaded.draft_model}" if loaded is not None and loaded.draft_model
              else "")
    sys.stderr.write(f"everycycle: loaded {model}{where}{engine}{ctx}{drafts}\n")


@app.command()
def unload(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="A loaded model.")],
    socket: SocketOpt = None,
) -> None:
    """Unload MODEL (its requests are cancelled).

    \b
    Example:
      everycycle unload gemma-3-270m
    """
    call(socket, lambda c: c.unload(model))
    sys.stderr.write(f"everycycle: unloaded {model}\n")


@app.command()
def cancel(
    request_id: Annotated[str, typer.Argument(metavar="REQUEST_ID", help="As `fleet` lists it, or `run -v` prints it.")],
    socket: SocketOpt = None,
) -> None:
    """Cancel a request by id.

    \b
    Example:
      everycycle cancel 3f2a…
    """
    call(socket, lambda c: c.cancel(request_id))


@app.command()
def ps(socket: SocketOpt = None) -> None:
    """Show loaded models and active requests (as `fleet`; Ollama's name for it).

    \b
    Example:
      everycycle ps
    """
    fleet(as_json=False, watch=False, hosts=None, token=None, socket=socket)


@app.command()
def drain(
    host: Annotated[str | None, typer.Option(
        "--host", metavar="HOST:PORT|SOCKET", help="A daemon's TCP address (with its "
        "token) or socket path (default: this user's daemon).")] = None,
    grace: Annotated[float, typer.Option(
        "--grace", min=0, help="Seconds the running and queued requests may take; then "
        "what is left is cancelled.")] = 300.0,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="EVERYCYCLE_TOKEN",
        help="Key for a TCP daemon (default: this user's daemon token).")] = None,
    socket: SocketOpt = None,
) -> None:
    """Take a daemon out of service without cutting a request: it admits nothing new
    (HTTP 503 with Retry-After, so a router sends the work elsewhere; /health 503),
    lets what runs and waits finish, then stops. Returns once it has.

    \b
    Example:
      everycycle drain
      everycycle drain --host box2:7000 --grace 60
    """
    if host is not None and host.startswith(("http://", "https://")):
        fail(f"--host {host}: a drain goes over a daemon's socket or --tcp address, not "
             "HTTP: run `everycycle drain` on its machine, or send it SIGTERM", 2)
    where = host or str(socket or paths.socket_path())
    try:
        with (_client(host, _own_token(token), grace + 60) if host else
              _socket_client(socket, grace + 60)) as client:
            active = client.describe_fleet().active_requests
            sys.stderr.write(f"everycycle: draining {where}: {active} active request"
                             f"{'' if active == 1 else 's'}, at most {grace:g} s\n")
            client.shutdown(drain_ms=int(grace * 1000))
    except EverycycleError as exc:
        exit_for(exc)
    sys.stderr.write(f"everycycle: {where} drained and stopped\n")


def _socket_client(socket: Path | None, timeout: float) -> Any:
    from ..client.sync import SyncClient

    return SyncClient(socket, timeout=timeout)


@app.command()
def stop(
    model: Annotated[str | None, typer.Argument(
        metavar="[MODEL]", help="Unload this model instead (as `unload`); no MODEL: stop the daemon.")] = None,
    socket: SocketOpt = None,
) -> None:
    """Shut the daemon down gracefully, or with MODEL unload that model.

    \b
    Example:
      everycycle stop
      everycycle stop gemma-3-270m
    """
    if model is not None:
        unload(model, socket)
        return
    try:
        call(socket, lambda c: c.shutdown(), unavailable_raises=True)
    except DaemonUnavailableError as exc:  # nothing to stop: that is what was asked
        sys.stderr.write(f"everycycle: {exc.message}: nothing to stop\n")
        return
    sys.stderr.write("everycycle: daemon stopped\n")


