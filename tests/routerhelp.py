"""Several daemons behind a real router from PyPI (vllm-router), on one machine: each
daemon with its own state directory (no shared prompt cache), socket and port; the
router started as docs/many-machines.md says. For tests/test_router.py and
bench/router.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

EC = [sys.executable, "-m", "everycycle"]

ROUTER_FLAGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
                "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "5")
"""What docs/many-machines.md gives the router besides its workers and policy: health
checked each second (a daemon that drains or dies leaves the rotation within one),
and a circuit that opens after two failed attempts, so a retry goes to another daemon
even under a sticky policy, and closes again 5 s later."""


def router_binary() -> str | None:
    """vllm-router: $EVERYCYCLE_VLLM_ROUTER (.ci/vllm-router), else on PATH."""
    return os.environ.get("EVERYCYCLE_VLLM_ROUTER") or shutil.which("vllm-router")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError):
            if check():  # type: ignore[operator]
                return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Member:
    """One daemon of the fleet: its home (state), socket, port and process."""

    home: Path
    port: int
    models: Path
    load: str
    extra: Sequence[str] = ()
    ca: Path | None = None
    """With TLS (``--tls-cert`` in ``extra``): the CA that signed its certificate."""
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.home / "daemon.log"

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://127.0.0.1:{self.port}"

    def get(self, path: str) -> httpx.Response:
        verify = ssl.create_default_context(cafile=str(self.ca)) if self.ca else True
        return httpx.get(f"{self.url}{path}", timeout=10, verify=verify)

    @property
    def sock(self) -> Path:
        return self.home / "d.sock"

    def env(self) -> dict[str, str]:
        return {**os.environ, "EVERYCYCLE_HOME": str(self.home), "HF_HUB_OFFLINE": "1"}

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*EC, "daemon", "--models", str(self.models), "--socket", str(self.sock),
                 "--http", f"127.0.0.1:{self.port}", "--load", self.load, *self.extra],
                stdout=subprocess.DEVNULL, stderr=log, env=self.env())
        wait_for(self.ready, f"the daemon on port {self.port} to be ready")

    def ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, \
            f"the daemon on port {self.port} exited: {self.log.read_text()[-2000:]}"
        return self.get("/health").status_code == 200

    def requests_served(self) -> int:
        """Generate requests this daemon has ended, from its own /metrics."""
        return self._metric("everycycle_requests_total{")

    def requests_running(self) -> int:
        """Requests in a slot here now (``vllm:num_requests_running``)."""
        return self._metric("vllm:num_requests_running")

    def _metric(self, prefix: str) -> int:
        """The sum of /metrics samples whose line begins with ``prefix``."""
        text = self.get("/metrics").text
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(prefix)))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Router:
    """vllm-router in front of ``members`` with ``policy``."""

    binary: str
    members: list[Member]
    policy: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log: Path) -> None:
        cas = {str(m.ca) for m in self.members if m.ca}
        env = {**os.environ, **({"SSL_CERT_FILE": cas.pop()} if cas else {})}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [self.binary, "--host", "127.0.0.1", "--port", str(self.port),
                 "--worker-urls", *(m.url for m in self.members), "--policy", self.policy,
                 "--prometheus-port", str(free_port()), "--log-level", "warning",
                 *ROUTER_FLAGS], stdout=out, stderr=out, env=env)

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, log.read_text()[-3000:]
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200

        wait_for(up, "the router to find its daemons healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def routed(binary: str, models: Path, load: str, policy: str, n: int = 3,
           extra: Sequence[str] = (), tls: tuple[Path, Path, Path] | None = None
           ) -> Iterator[Router]:
    """``n`` daemons serving ``load`` (each its own state directory) behind a router;
    with ``tls`` (CA, certificate, key), over HTTPS, the router trusting the CA as
    docs/many-machines.md says (SSL_CERT_FILE)."""
    if tls is not None:
        extra = (*extra, "--tls-cert", str(tls[1]), "--tls-key", str(tls[2]))
    with tempfile.TemporaryDirectory(prefix="rt", dir="/tmp") as d:
        root = Path(d)
        members = []
        for i in range(n):
            home = root / f"d{i}"
            home.mkdir()
            members.append(Member(home, free_port(), models, load, extra,
                                  tls[0] if tls else None))
        router = Router(binary, members, policy)
        try:
            for m in members:
                m.start()
            router.start(root / "router.log")
            yield router
        finally:
            router.stop()
            for m in members:
                m.stop()
