"""The daemon: listeners, NDJSON framing, one task group per connection, shutdown.

Thin I/O around the protocol module and the supervisor. One daemon per socket: a
lock on the pid file beside the socket decides; whoever holds it may replace a stale
socket. The Unix socket lives in a private (0700) directory and is 0600 itself; the
optional TCP listener requires ``{"Auth":{"token":…}}`` as its first line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import select
import socket
import typing
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from .. import paths
from ..errors import AlreadyRunningError, ConfigError, unwrap_groups
from ..models import manage
from ..models.keepalive import DEFAULT_KEEP_ALIVE
from ..models.registry import load_registry
from ..protocol import Error, Load, Shutdown
from ..sockets import wake_reader
from .audit import AuditLog
from .connection import AuthFailed, ServerConnection
from .events import AuthRefused
from .keys import LOCAL, KeyStore, load_or_create_token
from .peers import SocketPeer, Told
from .supervisor import Limits, Supervisor

log = logging.getLogger(__name__)


DRAIN_GRACE = 30.0
"""SIGTERM's default grace: Kubernetes' default terminationGracePeriodSeconds (give the
pod a few seconds more than the daemon's grace)."""

HTTP_HEARTBEAT = 5.0
"""Seconds of silence after which an HTTP stream gets its dialect's heartbeat: well
inside every client idle limit we know of (Codex's is 300 s)."""


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything ``serve`` needs; the CLI builds it from flags."""

    socket: Path = field(default_factory=paths.socket_path)
    models_file: Path | None = None
    limits: Limits = field(default_factory=Limits)
    auto_load: bool = True
    audit_prompts: bool = False
    tcp: tuple[str, int] | None = None
    allow_remote: bool = False
    http: tuple[str, int] | None = None
    """Serve the OpenAI-compatible HTTP API on (host, port); port 0 picks a free one."""
    http_auth: bool = False
    """Require the bearer token on HTTP even on loopback (always required off loopback)."""
    keep_alive: float = DEFAULT_KEEP_ALIVE
    """Seconds an idle model stays loaded (-1: always) unless models.toml or a request says."""
    rpc: tuple[str, ...] = ()
    """RPC servers (HOST:PORT) whose devices become remote executors."""
    cors_origins: tuple[str, ...] = ()
    """Web origins allowed to use the HTTP API (``*``: any); others get 403."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names the loopback HTTP API answers besides 127.0.0.1, ::1 and localhost."""
    max_loaded_models: int | None = None
    """At most this many models resident (None: models.toml's figure, or memory)."""
    http_heartbeat: float = HTTP_HEARTBEAT
    """Seconds of silence after which an HTTP stream gets a heartbeat (0: never)."""
    tls: tuple[Path, Path] | None = None
    """Serve HTTPS with this (certificate, key), both PEM files."""
    load: tuple[str, ...] = ()
    """Models to load at start; ``/health`` says 503 "Loading model" until one serves."""
    drain_grace: float = DRAIN_GRACE
    """Seconds SIGTERM lets running and queued requests finish before it cancels them
    (0: SIGTERM stops at once, as SIGINT does)."""
    drain_notice: float = 0.0
    """Seconds a drain still admits new work while /health says 503, so a router's
    health checks take the daemon out of rotation before it refuses anything."""


@contextlib.contextmanager
def socket_lock(sock: Path) -> Iterator[Path]:
    """Hold the pid-file lock for ``sock`` (writing our pid), or raise AlreadyRunningError."""
    paths.ensure_private_dir(sock.parent)
    pid_path = paths.pid_file_for(sock)
    fd = os.open(pid_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            other = read_pid(sock)
            who = f"pid {other}" if other else "another process"
            raise AlreadyRunningError(f"{sock} is already served by {who}", other) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield pid_path
        finally:
            with contextlib.suppress(OSError):
                sock.unlink()
            with contextlib.suppress(OSError):
                pid_path.unlink()
    finally:
        os.close(fd)


@contextlib.contextmanager
def _startup_errors(sock: Path) -> Iterator[None]:
    """Turn an unusable socket path (missing parent, no permission, too long) into a
    ConfigError naming it; errors after start-up pass through."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"cannot serve on {sock}: {exc.strerror or exc}") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def read_pid(sock: Path) -> int | None:
    """The pid recorded for the daemon of ``sock``, if any."""
    try:
        return int(paths.pid_file_for(sock).read_text().strip())
    except (OSError, ValueError):
        return None


def _hung_up(stream: anyio.abc.ByteStream) -> bool:
    """Whether the peer closed its socket altogether (not just its sending side, as
    ``socat`` and ``nc -N`` do once they have sent everything)."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _, ev in poller.poll(0))


class Daemon:
    """Listeners + supervisor. ``await tg.start(daemon.run)`` returns once it accepts."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        registry = load_registry(config.models_file)
        audit = AuditLog(paths.audit_file(), include_prompts=config.audit_prompts)
        self.supervisor = Supervisor(
            registry, limits=config.limits, auto_load=config.auto_load, audit=audit,
            on_shutdown=self.stop, keep_alive=config.keep_alive, rpc=config.rpc,
            max_loaded_models=config.max_loaded_models,
            reload=lambda: load_registry(config.models_file),
            resolve=lambda name: manage.resolve(name, config.models_file),
        )
        self._stop = anyio.Event()
        self._connections: set[SocketPeer] = set()
        self.keys = KeyStore()
        self.tcp_port: int | None = None
        self._idle: anyio.Event | None = None
        self.audit = audit
        if config.tcp is not None:
            host = config.tcp[0]
            if not _is_loopback(host) and not config.allow_remote:
                raise ConfigError(f"--tcp {host} is not a loopback address; add --allow-remote")
            self.keys.default_token = load_or_create_token()
        self.http_port: int | None = None
        self._http: Any = None  # the HttpApi, imported only when asked for
        self._tls: Any = None  # its ssl.SSLContext, with --tls-cert
        self._http_server: Any = None
        self._http_done = anyio.Event()
        if config.http is not None:
            host = config.http[0]
            remote = not _is_loopback(host)
            if remote and not config.allow_remote:
                raise ConfigError(f"--http {host} is not a loopback address; add --allow-remote")
            from .http import HttpApi
            from .tls import listener_context

            self._tls = listener_context(config.tls, host, remote=remote)
            from .metrics import Metrics

            if remote or config.http_auth:
                self.keys.default_token = load_or_create_token()
            self._http = HttpApi(self.supervisor, Metrics(self.supervisor), keys=self.keys,
                                 require_key=remote or config.http_auth, loopback=not remote,
                                 allowed_hosts=config.allowed_hosts,
                                 cors_origins=config.cors_origins,
                                 heartbeat_s=config.http_heartbeat)
        self.keys.keys()  # a loose or broken key file stops start-up, naming it
        for name in config.load:
            if not self.supervisor.knows(name):
                raise ConfigError(f"--load {name}: the registry has no model '{name}' "
                                  "(`everycycle models` lists them)")

    async def drain(self, grace_s: float | None = None) -> None:
        """Take no new work, let what runs and waits finish (for up to ``grace_s``,
        the config's by default; then cancel the rest), and stop: SIGTERM's way."""
        grace = self.config.drain_grace if grace_s is None else grace_s
        await self.supervisor.handle(Told("drain"), Shutdown(uuid.uuid4().hex,
                                                              drain_ms=int(grace * 1000)))

    async def _preload(self, name: str) -> None:
        """``--load NAME``: load it as a Load request would (its failure is logged;
        requests may still load it later)."""
        try:
            await self.supervisor.handle(Told(f"--load {name}"), Load(uuid.uuid4().hex, name))
        finally:
            self.supervisor.readiness.preloading -= 1

    def stop(self) -> None:
        """Begin a graceful shutdown (from the event loop)."""
        self._stop.set()
        if self._http_server is not None:
            self._http_server.should_exit = True

    def _bind_http(self) -> Any:
        """The HTTP listening socket, bound now so that errors surface at start-up."""
        from .httpserver import bind

        assert self.config.http is not None
        host, port = self.config.http
        sock = bind(host, port)
        self.http_port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        scheme = "https" if self._tls is not None else "http"
        self.supervisor.http_address = f"{scheme}://{shown}:{self.http_port}"
        log.info("HTTP API on %s/v1; the console at %s/console/",
                 self.supervisor.http_address, self.supervisor.http_address)
        return sock

    async def _serve_http(self, sock: Any) -> None:
        from .httpserver import http_server

        server = http_server(self._http.asgi, self._tls)
        self._http_server = server
        try:
            if not self._stop.is_set():
                await server.serve(sockets=[sock])
        finally:
            sock.close()
            self._http_done.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Serve until ``stop()`` or cancellation.

        Raises AlreadyRunningError, and ConfigError when the socket or TCP address
        cannot be used (naming it and why).
        """
        sock = self.config.socket
        with contextlib.ExitStack() as held:
            with _startup_errors(sock):
                held.enter_context(socket_lock(sock))
                with contextlib.suppress(FileNotFoundError):
                    sock.unlink()  # we hold the lock: any socket here is stale
                listeners = [await anyio.create_unix_listener(sock)]
                os.chmod(sock, 0o600)
            if self.config.tcp is not None:
                host, port = self.config.tcp
                try:
                    tcp = await anyio.create_tcp_listener(local_host=host, local_port=port)
                except OSError as exc:
                    raise ConfigError(f"cannot listen on {host}:{port}: "
                                      f"{exc.strerror or exc}") from None
                self.tcp_port = tcp.extra(anyio.abc.SocketAttribute.local_port)
                listeners.extend(typing.cast(list[anyio.abc.SocketListener], tcp.listeners))
            http_sock = self._bind_http() if self._http is not None else None
            async with anyio.create_task_group() as tg:
                await tg.start(self.supervisor.run)
                self.supervisor.readiness.preloading = len(self.config.load)
                self.supervisor.readiness.notice_s = self.config.drain_notice
                for name in self.config.load:
                    tg.start_soon(self._preload, name)
                if http_sock is not None:
                    self._http.bind(tg)
                    tg.start_soon(self._serve_http, http_sock)
                try:
                    async with anyio.create_task_group() as accepting:
                        for i, listener in enumerate(listeners):
                            accepting.start_soon(self._accept, listener, i > 0, tg)
                        log.info("serving on %s (pid %d)", sock, os.getpid())
                        task_status.started()
                        await self._stop.wait()
                        accepting.cancel_scope.cancel()
                finally:
                    with anyio.CancelScope(shield=True):
                        for listener in listeners:
                            await listener.aclose()
                await self.supervisor.close()
                for conn in list(self._connections):
                    conn.close()
                self._idle = anyio.Event()
                with anyio.move_on_after(2):  # let writers flush the terminal events
                    if self._connections:
                        await self._idle.wait()
                    if http_sock is not None:  # uvicorn closes its connections
                        await self._http_done.wait()
                tg.cancel_scope.cancel()

    async def _accept(
        self, listener: anyio.abc.SocketListener, is_tcp: bool, tg: anyio.abc.TaskGroup
    ) -> None:
        """Accept connections until cancelled; each runs in ``tg``, outliving this loop."""
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # e.g. EMFILE: keep serving the connections we have
                log.warning("accept failed: %s", exc)
                await anyio.sleep(0.1)
                continue
            tg.start_soon(self._serve_connection, stream, is_tcp)

    async def _serve_connection(self, stream: anyio.abc.ByteStream, is_tcp: bool) -> None:
        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        conn = SocketPeer(ServerConnection(
            None if is_tcp else self.keys.principal(LOCAL.name), self.keys.authenticate),
            allow_paths=not is_tcp,
            # (a Unix socket's stream writes to it itself; a TCP one, through asyncio's
            # transport, which must see every write)
            sock=raw if type(raw) is socket.socket else None)
        self._connections.add(conn)
        try:
            async with anyio.create_task_group() as tg:

                async def writer() -> None:
                    try:
                        while True:
                            # One write for everything queued: a decode step emits an
                            # event per slot at once.
                            data = b"".join(await conn.outgoing.take())
                            conn.writing = True
                            await stream.send(data)
                            conn.writing = False
                            conn.sent(len(data))
                    except (anyio.EndOfStream, anyio.BrokenResourceError,
                            anyio.ClosedResourceError, OSError):
                        pass
                    finally:
                        if conn.overflowed:
                            log.warning("closing a connection that read none of %d bytes "
                                        "of output", conn.unsent)
                        conn.close()
                        self.supervisor.disconnect(conn)
                        wake_reader(stream)

                tg.start_soon(writer)
                try:
                    await self._read_loop(stream, conn, tg)
                finally:
                    self.supervisor.disconnect(conn)
                    conn.close()
        finally:
            self._connections.discard(conn)
            if not self._connections and self._idle is not None:
                self._idle.set()
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _read_loop(self, stream: anyio.abc.ByteStream, conn: SocketPeer,
                         tg: anyio.abc.TaskGroup) -> None:
        protocol = conn.protocol
        while protocol.closed is None:
            await conn.wait_for_room()
            if conn.outgoing.closed:
                return
            try:
                data = await stream.receive(65536)
            except anyio.EndOfStream:
                data = b""
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
            for item in protocol.receive_data(data):
                if isinstance(item, Error):
                    conn.emit(item)
                elif isinstance(item, AuthFailed):
                    self.supervisor.bus.publish(AuthRefused(outcome=item.outcome))
                else:
                    tg.start_soon(conn.handle, self.supervisor, item)
        if protocol.closed == "end of stream":
            # The client sent all it will (a half-close): answer it, then close.
            await self._after_eof(stream, conn)

    HALF_CLOSE_POLL_S = 0.02

    async def _after_eof(self, stream: anyio.abc.ByteStream, conn: SocketPeer) -> None:
        """Wait for the requests a half-closed client sent to end (their events still
        go out); return at once when it closed altogether, or when its output stops."""
        while (conn.pending or self.supervisor.inflight(conn)) and not conn.outgoing.closed:
            if _hung_up(stream):
                return
            await anyio.sleep(self.HALF_CLOSE_POLL_S)


async def serve(config: DaemonConfig, *, handle_signals: bool = True) -> None:
    """Run a daemon until SIGTERM/SIGINT or a Shutdown request.

    Raises AlreadyRunningError and ConfigError as themselves (not in a group).
    """
    import signal

    daemon = Daemon(config)

    async def watch_signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if (signum == signal.SIGTERM and config.drain_grace > 0
                        and not daemon.supervisor.readiness.draining):
                    tg.start_soon(daemon.drain)  # (a second SIGTERM stops at once)
                    continue
                log.info("signal %d: shutting down", signum)
                daemon.stop()
                return

    with unwrap_groups():
        async with anyio.create_task_group() as tg:
            if handle_signals:
                tg.start_soon(watch_signals)
            await daemon.run()
            tg.cancel_scope.cancel()
