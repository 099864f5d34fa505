"""HTTPS for the HTTP API (``daemon --http … --tls-cert FILE --tls-key FILE``), with a CA
and a server certificate the test makes: the real ``openai`` client and curl trust the
CA and get answers, ``fleet --host https://…`` reads the fleet through it, a plain-HTTP
request to the TLS port is refused without harm, and wrong files are one sentence."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from daemonhelp import EC, daemon_process
from httphelp import fleet_http, hostport, openai_client
from tlshelp import Pki, make_pki

from everycycle.client import SyncClient


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def https(pki: Pki, models_file: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A daemon serving HTTPS: its base URL, and its log."""
    log = tmp_path / "daemon.stderr"
    with daemon_process("--models", str(models_file), "--http", "127.0.0.1:0",
                        "--tls-cert", str(pki.cert), "--tls-key", str(pki.key), stderr=log):
        yield fleet_http(), log


def test_the_openai_client_gets_an_answer_over_https(https: tuple[str, Path], pki: Pki) -> None:
    url, _ = https
    assert url.startswith("https://127.0.0.1:")
    with openai_client(url, http_client=httpx.Client(
            verify=ssl.create_default_context(cafile=pki.ca))) as client:
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0)
    assert answer.choices[0].message.content is not None
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    # Without the CA, the client refuses the daemon (nothing was sent in the clear).
    with openai_client(url) as untrusting, pytest.raises(openai.APIConnectionError):
        untrusting.models.list()


def test_curl_with_the_ca_and_a_plain_request_refused(https: tuple[str, Path], pki: Pki) -> None:
    url, log = https
    ok = subprocess.run(["curl", "-sS", "--cacert", str(pki.ca), f"{url}/v1/models"],
                        capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0 and '"tiny"' in ok.stdout, ok.stderr
    untrusted = subprocess.run(["curl", "-sS", f"{url}/health"], capture_output=True,
                               text=True, timeout=60, check=False)
    assert untrusted.returncode == 60, untrusted  # (curl: the peer's certificate: not trusted)
    # Plain HTTP to the TLS port: no answer in the clear, the connection closed.
    with socket.create_connection(hostport(url), timeout=30) as plain:
        plain.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        try:
            got = plain.recv(4096)
        except ConnectionResetError:
            got = b""
        assert not got.startswith(b"HTTP/1.1 200")
    with SyncClient() as c:  # the daemon serves on
        assert c.describe_fleet().http == url
    assert "Traceback" not in log.read_text()


def test_fleet_host_reads_a_daemon_over_https(https: tuple[str, Path], pki: Pki) -> None:
    url, _ = https
    env = {**os.environ, "SSL_CERT_FILE": str(pki.ca)}
    shown = subprocess.run([*EC, "fleet", "--host", url, "--json"], capture_output=True,
                           text=True, timeout=60, env=env, check=False)
    assert shown.returncode == 0, shown.stderr
    assert '"FleetDescription"' in shown.stdout and url in shown.stdout
    env.pop("SSL_CERT_FILE")
    refused = subprocess.run([*EC, "fleet", "--host", url], capture_output=True, text=True,
                             timeout=60, env=env, check=False)
    assert refused.returncode == 69
    assert "TLS certificate is not trusted here" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.splitlines()) <= 3


@pytest.mark.parametrize("case", ["mismatch", "missing", "half"])
def test_wrong_tls_files_are_one_sentence(pki: Pki, models_file: Path, tmp_path: Path,
                                          case: str) -> None:
    files = {"mismatch": ["--tls-cert", str(pki.cert), "--tls-key", str(pki.other_key)],
             "missing": ["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(pki.key)],
             "half": ["--tls-cert", str(pki.cert)]}[case]
    out = subprocess.run([*EC, "daemon", "--models", str(models_file), "--http",
                          "127.0.0.1:0", "--socket", str(tmp_path / "s.sock"), *files],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0
    said = {"mismatch": "the key is not the certificate's", "missing": "no such file",
            "half": "--tls-cert and --tls-key go together"}[case]
    assert said in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_plain_http_off_loopback_warns_at_start(models_file: Path, tmp_path: Path) -> None:
    log = tmp_path / "daemon.stderr"
    with daemon_process("--models", str(models_file), "--http", "0.0.0.0:0",
                        "--allow-remote", stderr=log):
        pass
    warned = [ln for ln in log.read_text().splitlines() if "is not encrypted" in ln]
    assert len(warned) == 1 and "--tls-cert" in warned[0]
