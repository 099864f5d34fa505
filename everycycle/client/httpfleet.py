"""A daemon's fleet over its HTTP API (``GET /v1/fleet``), for ``fleet --host
https://…``: a daemon reached across a network through HTTPS, where its TCP socket is not
exposed. The certificate is checked as any HTTPS client checks it (the system's CAs, or
``SSL_CERT_FILE`` for a private CA)."""

from __future__ import annotations

import json
import ssl

from ..errors import DaemonUnavailableError, EverycycleError
from ..protocol import FleetDescription, FleetSnapshot
from ..protocol.codec import decode_event


def fetch_fleet(url: str, token: str | None, timeout: float = 30.0) -> FleetSnapshot:
    """The snapshot of the daemon at ``url`` (its HTTP base, ``https://HOST:PORT``).
    Raises DaemonUnavailableError when it cannot be reached or its certificate is not
    trusted, EverycycleError when it refuses the key or answers something else."""
    import httpx

    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.get(f"{url.rstrip('/')}/v1/fleet", headers=headers, timeout=timeout)
    except httpx.ConnectError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY" in str(exc):
            raise DaemonUnavailableError(
                f"{url}: its TLS certificate is not trusted here ({_reason(exc)}); set "
                "SSL_CERT_FILE to the CA that signed it") from None
        raise DaemonUnavailableError(f"{url}: cannot connect ({_reason(exc)})") from None
    except httpx.HTTPError as exc:
        raise DaemonUnavailableError(f"{url}: {_reason(exc)}") from None
    if answer.status_code != 200:
        raise EverycycleError(f"{url}: HTTP {answer.status_code}: {_message(answer.text)}")
    try:
        event = decode_event(json.dumps({"FleetDescription": answer.json()}))
    except (ValueError, EverycycleError) as exc:
        raise EverycycleError(f"{url}: not an everycycle fleet ({exc})") from None
    assert isinstance(event, FleetDescription)
    return event.snapshot


def _reason(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _message(body: str) -> str:
    """An error body's message (the APIs' ``{"error": {"message"}}``), else its start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200]
