"""``everycycle daemon``: run the daemon in the foreground or detached, with its listeners."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from .. import paths
from ..errors import AlreadyRunningError, EverycycleError
from .common import EXIT_CODES, ModelsOpt, SocketOpt, app, call, fail


@app.command("serve", help="Run the daemon in the foreground (as `daemon`; Ollama's name "
             "for it).\n\n\b\nExample:\n  everycycle serve --http 11777")
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
    tls_cert: Annotated[Path | None, typer.Option(
        "--tls-cert", metavar="FILE", help="Serve --http as HTTPS with this PEM certificate "
        "(chain), with --tls-key.")] = None,
    tls_key: Annotated[Path | None, typer.Option(
        "--tls-key", metavar="FILE", help="The PEM private key of --tls-cert.")] = None,
    allow_remote: Annotated[bool, typer.Option(
        "--allow-remote", help="Let --tcp and --http listen off loopback (keys required).")]
    = False,
    cors_origin: Annotated[list[str] | None, typer.Option(
        "--cors-origin", metavar="ORIGIN", help="A web origin allowed to use the HTTP API, "
        "e.g. http://localhost:3000 (repeat; * allows any).")] = None,
    allow_host: Annotated[list[str] | None, typer.Option(
        "--allow-host", metavar="NAME", help="A Host name the loopback HTTP API answers "
        "besides 127.0.0.1, ::1 and localhost (repeat).")] = None,
    auto_load: Annotated[bool, typer.Option(
        "--auto-load/--no-auto-load", help="Load a model when a request names it.")] = True,
    audit_prompts: Annotated[bool, typer.Option(
        "--audit-prompts", help="Write prompts to the audit log too.")] = False,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", min=0, help="Requests waiting per model before Rejected.")] = 64,
    max_inflight: Annotated[int, typer.Option(
        "--max-inflight", min=1, help="Requests in flight per connection.")] = 32,
    rpc: Annotated[list[str] | None, typer.Option(
        "--rpc", metavar="HOST:PORT", help="Use the executors an `everycycle rpc-serve` "
        "(or llama.cpp rpc-server) offers there (repeat). No authentication: trusted "
        "networks only.")] = None,
    keep_alive: Annotated[str, typer.Option(
        "--keep-alive", help="How long an idle model stays loaded: 5m, 1h, 300, 0, or -1 "
        "for always (models.toml and requests may say otherwise).")] = "5m",
    max_loaded_models: Annotated[int | None, typer.Option(
        "--max-loaded-models", min=1, help="At most this many models loaded at once; the "
        "least recently used idle one makes room (default: as many as memory holds).")]
    = None,
    swap_after: Annotated[float, typer.Option(
        "--swap-after", min=0, help="Seconds a model's load waits for memory that busy "
        "models hold before they stop taking new requests and make room.")] = 2.0,
    min_residency: Annotated[float, typer.Option(
        "--min-residency", min=0, help="Seconds a loaded model keeps taking requests "
        "before it gives way to another's load.")] = 2.0,
    hang_timeout: Annotated[float, typer.Option(
        "--hang-timeout", min=0, help="Seconds a model's engine may make no progress "
        "with work in hand before it is taken for hung: killed and restarted, its "
        "requests told why (0: never).")] = 60.0,
    http_heartbeat: Annotated[float, typer.Option(
        "--http-heartbeat", min=0, help="Seconds an HTTP stream may go without a byte while "
        "its request waits, loads or reads its prompt before it gets a keep-alive (a ping "
        "its client's idle timer counts; 0: never).")] = 5.0,
    background_age: Annotated[float, typer.Option(
        "--background-age", min=0, help="Seconds background work (run --background, "
        "x-priority: background) may wait with none of it moving, every slot kept by "
        "interactive work, before its oldest request is served as an interactive one.")]
    = 120.0,
    load: Annotated[list[str] | None, typer.Option(
        "--load", metavar="MODEL", help="Load MODEL at start (repeat); /health answers 503 "
        "until one serves, as llama-server's does while it loads.")] = None,
    drain_grace: Annotated[float, typer.Option(
        "--drain-grace", min=0, help="Seconds SIGTERM lets running and queued requests "
        "finish, admitting none (503 + Retry-After), before it cancels the rest and "
        "stops (0: SIGTERM stops at once, as SIGINT does).")] = 30.0,
    drain_notice: Annotated[float, typer.Option(
        "--drain-notice", min=0, help="Seconds a drain (SIGTERM, `everycycle drain`) still "
        "admits new requests while /health answers 503, so that a router's health checks "
        "take this daemon out of rotation before it refuses anything.")] = 0.0,
    show_token: Annotated[bool, typer.Option("--show-token", help="Print the TCP token.")]
    = False,
) -> None:
    """Run the daemon in the foreground (or --detach).

    \b
    Example:
      everycycle daemon --detach
    """
    from ..daemon.keys import load_or_create_token
    from ..daemon.server import DaemonConfig, serve
    from ..daemon.supervisor import Limits

    if show_token:
        sys.stdout.write(load_or_create_token() + "\n")
        return
    from ..models.keepalive import parse_keep_alive

    try:
        keep_seconds = parse_keep_alive(keep_alive)
    except ValueError as exc:
        fail(f"--{exc}", 2)
    from ..hardware.rpc import parse_endpoint

    try:
        rpc_hosts = tuple(parse_endpoint(h) for h in rpc or ())
    except EverycycleError as exc:
        fail(exc.message, 2)
    sock = socket or paths.socket_path()
    tcp_addr = None
    if tcp is not None:
        host, _, port = tcp.rpartition(":")
        if not host or not port.isdigit():
            fail("--tcp wants HOST:PORT", 2)
        tcp_addr = (host.strip("[]"), int(port))
    if (tls_cert is None) != (tls_key is None):
        fail("--tls-cert and --tls-key go together: the certificate and its key", 2)
    if tls_cert is not None and http is None:
        fail("--tls-cert serves the HTTP API: add --http [HOST:]PORT", 2)
    http_addr = None
    if http is not None:
        try:
            http_addr = parse_http_address(http)
        except ValueError as exc:
            fail(str(exc), 2)
    if detach:
        _detach(sock, sys.argv[1:])
        return
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = DaemonConfig(socket=sock, models_file=models,
                          limits=Limits(max_queue=max_queue, max_inflight=max_inflight,
                                        hang_timeout=hang_timeout, swap_after=swap_after,
                                        min_residency=min_residency,
                                        background_age=background_age),
                          auto_load=auto_load, audit_prompts=audit_prompts, tcp=tcp_addr,
                          allow_remote=allow_remote, http=http_addr, http_auth=http_auth,
                          keep_alive=keep_seconds, rpc=rpc_hosts,
                          max_loaded_models=max_loaded_models,
                          cors_origins=tuple(cors_origin or ()),
                          allowed_hosts=tuple(allow_host or ()),
                          http_heartbeat=http_heartbeat,
                          tls=(tls_cert, tls_key) if tls_cert and tls_key else None,
                          load=tuple(load or ()), drain_grace=drain_grace,
                          drain_notice=drain_notice)
    import anyio

    try:
        anyio.run(serve, config)
    except AlreadyRunningError as exc:
        fail(exc.message, 1)
    except EverycycleError as exc:
        fail(exc.message, EXIT_CODES[exc.kind])


DEFAULT_HTTP_PORT = 11777
"""The HTTP API's default port: none of Ollama (11434), llama-server (8080), LM Studio
(1234) or llama-cpp-python's server (8000)."""


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
        start = log_file.tell()
        proc = subprocess.Popen(
            [sys.executable, "-m", "everycycle", *args, "--socket", str(sock)],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            # Its own one-line reason (e.g. already served by pid N), and its exit code.
            reason = _last_reason(log_path, start)
            if reason:
                sys.stderr.write(reason + "\n")
                raise typer.Exit(proc.returncode or 1)
            fail(f"the daemon exited with {proc.returncode}; see {log_path}",
                 proc.returncode or 1)
        if read_pid(sock) == proc.pid and _answers(sock):
            http = ""
            if "--http" in args:
                http = call(sock, lambda c: c.describe_fleet()).http
                http = f" and {http}/v1 (console: {http}/console/)" if http else ""
            sys.stderr.write(f"everycycle: daemon pid {proc.pid} serving {sock}{http}\n")
            return
        time.sleep(0.05)
    fail(f"the daemon did not start within 60 s; see {log_path}", 1)


def _last_reason(log_path: Path, start: int) -> str | None:
    """The last ``everycycle: …`` line the daemon wrote to its log since ``start``."""
    try:
        with log_path.open("rb") as f:
            f.seek(start)
            written = f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return None
    lines = [ln for ln in written.splitlines() if ln.startswith("everycycle: ")]
    return lines[-1] if lines else None


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
