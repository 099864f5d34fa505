"""HTTPS for the HTTP API: the server's certificate and key, checked at start-up so that
a wrong file is one sentence before anything listens (llama-server's ``--ssl-cert-file``
and ``--ssl-key-file``). TLS 1.2 at least, the ``ssl`` module's defaults otherwise.
No I/O beyond reading the two files."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger(__name__)


def listener_context(tls: tuple[Path, Path] | None, host: str, *, remote: bool
                     ) -> ssl.SSLContext | None:
    """The TLS context of the HTTP listener on ``host`` (None: plain HTTP, with a warning
    in the log when it is reachable off this machine)."""
    if tls is not None:
        return server_context(*tls)
    if remote:
        log.warning("HTTP on %s is not encrypted: keys and prompts cross the network "
                    "readable (--tls-cert and --tls-key serve HTTPS)", host)
    return None


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The TLS context a listener serves with. Raises ConfigError naming the file and
    what is wrong with it (missing, not PEM, a key that is not the certificate's)."""
    for what, path in (("certificate", cert), ("key", key)):
        if not path.is_file():
            raise ConfigError(f"TLS {what} {path}: no such file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        why = ("the key is not the certificate's" if "KEY_VALUES_MISMATCH" in str(exc)
               else f"not a PEM certificate and key ({exc.reason or exc})")
        raise ConfigError(f"TLS certificate {cert} with key {key}: {why}") from None
    except OSError as exc:
        raise ConfigError(f"TLS certificate {cert} with key {key}: "
                          f"{exc.strerror or exc}") from None
    return context
