"""``everycycle keys`` (add, list, rm): API keys and their limits; ``everycycle usage``:
what each key, model or day used, from the audit log."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated, Any

import typer

from ..errors import ConfigError, EverycycleError
from .common import app, exit_for, fail

keys_app = typer.Typer(no_args_is_help=True,
                       help="API keys for TCP and HTTP clients, each with its own limits.")
app.add_typer(keys_app, name="keys")


KeyNameArg = Annotated[str, typer.Argument(
    metavar="NAME", help='A key\'s name; "local" and "default" name the socket\'s user and '
    "the daemon's token.")]
ConcurrentOpt = Annotated[int | None, typer.Option(
    "--concurrent", min=1, help="Requests in flight (running or queued) at once.")]
RpmOpt = Annotated[float | None, typer.Option(
    "--requests-per-minute", "--rpm", min=0.001, help="Requests per minute.")]
TpmOpt = Annotated[float | None, typer.Option(
    "--tokens-per-minute", "--tpm", min=0.001, help="Generated tokens per minute.")]
PromptBytesOpt = Annotated[float | None, typer.Option(
    "--prompt-bytes-per-minute", min=1, help="Prompt bytes per minute.")]
ModelsAllowedOpt = Annotated[list[str] | None, typer.Option(
    "--model", "-m", help="A model it may use (repeat; default: all).")]
BackgroundOpt = Annotated[bool, typer.Option(
    "--background", help="Every request it makes waits in the background lane, behind "
    "interactive work (batch jobs, CI).")]


def _limits(concurrent: int | None, rpm: float | None, tpm: float | None,
            prompt_bytes: float | None, model: list[str] | None, background: bool) -> Any:
    from ..daemon.keys import KeyLimits

    if model:
        _warn_unknown_models(model)

    return KeyLimits(concurrent=concurrent, requests_per_minute=rpm, tokens_per_minute=tpm,
                     prompt_bytes_per_minute=prompt_bytes,
                     models=tuple(model) if model else None, background=background or None)


def _warn_unknown_models(names: list[str]) -> None:
    """A model the registry does not know may be added later: say so, do not refuse."""
    from ..models.registry import load_registry

    try:
        known = load_registry().models
    except EverycycleError:
        return
    for name in names:
        if name not in known:
            sys.stderr.write(f"everycycle: warning: the registry has no model '{name}' "
                             f"(known: {', '.join(sorted(known))}); the key may use it once "
                             "it has\n")


@keys_app.command("add")
def keys_add(name: KeyNameArg, concurrent: ConcurrentOpt = None, rpm: RpmOpt = None,
             tpm: TpmOpt = None, prompt_bytes: PromptBytesOpt = None,
             model: ModelsAllowedOpt = None, background: BackgroundOpt = False,
             secret_stdin: Annotated[bool, typer.Option(
                 "--secret-stdin", help="Take the secret from stdin (one `keys add` made "
                 "on another daemon) instead of making one: one key for every daemon "
                 "behind a router.")] = False) -> None:
    """Make a key; prints its secret once (only a hash is kept).

    \b
    Example:
      everycycle keys add ci --rpm 60 --tpm 20000 -m smollm2-135m
      everycycle keys add team | ssh box2 everycycle keys add team --secret-stdin
    """
    from ..daemon.keys import KeyStore

    limits = _limits(concurrent, rpm, tpm, prompt_bytes, model, background)
    given = sys.stdin.readline().strip() if secret_stdin else None
    try:
        secret = KeyStore().add(name, limits, given)
    except EverycycleError as exc:
        exit_for(exc)
    sys.stdout.write(secret + "\n")
    sys.stderr.write(f"key '{name}' added (limits: {limits.describe()}). The secret above "
                     "is shown only now: clients send it as their TCP Auth token or HTTP "
                     "bearer token.\n")


@keys_app.command("limit")
def keys_limit(name: KeyNameArg, concurrent: ConcurrentOpt = None, rpm: RpmOpt = None,
               tpm: TpmOpt = None, prompt_bytes: PromptBytesOpt = None,
               model: ModelsAllowedOpt = None, background: BackgroundOpt = False) -> None:
    """Replace a key's limits (none given: unlimited). NAME may also be "local" (the Unix
    socket's user) or "default" (the daemon's token). A running daemon applies them to
    the next request.

    \b
    Example:
      everycycle keys limit ci --rpm 120
    """
    from ..daemon.keys import KeyStore

    limits = _limits(concurrent, rpm, tpm, prompt_bytes, model, background)
    try:
        KeyStore().set_limits(name, limits)
    except EverycycleError as exc:
        exit_for(exc)
    sys.stderr.write(f"key '{name}': limits {limits.describe()}\n")


@keys_app.command("list")
def keys_list(as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object per key.")] = False) -> None:
    """List the keys and their limits (never their secrets).

    \b
    Example:
      everycycle keys list --json
    """
    from .. import paths
    from ..daemon.keys import KeyStore

    try:
        keys = KeyStore().keys()
    except ConfigError as exc:
        exit_for(exc)
    rows = []
    if paths.token_file().exists() and "default" not in keys:
        rows.append({"name": "default", "created": paths.token_file().stat().st_mtime,
                     "limits": {}, "describe": "none"})
    for key in keys.values():
        limits = {k: v for k, v in dataclasses.asdict(key.limits).items() if v is not None}
        rows.append({"name": key.name, "created": key.created, "limits": limits,
                     "describe": key.limits.describe()})
    if as_json:
        for row in rows:
            row.pop("describe")
            sys.stdout.write(json.dumps(row) + "\n")
        return
    from rich.console import Console

    from .render import keys_view

    Console().print(keys_view(rows))


@keys_app.command("rm")
def keys_rm(name: KeyNameArg) -> None:
    """Remove a key: its clients are refused from their next connection or request.

    \b
    Example:
      everycycle keys rm ci
    """
    from ..daemon.keys import KeyStore

    try:
        KeyStore().remove(name)
    except EverycycleError as exc:
        exit_for(exc)
    sys.stderr.write(f"key '{name}' removed\n")


@app.command()
def usage(
    since: Annotated[str | None, typer.Option(
        "--since", help="From a date (2026-11-30), a time (2026-11-30T12:00) or an age "
        "(7d, 12h).")] = None,
    by: Annotated[str, typer.Option("--by", help="Group by key, model, day or hour.")] = "key",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """What each key (or model, or day) asked for and got, from the audit log.

    \b
    Example:
      everycycle usage --since 7d --by model
    """
    from .. import paths
    from ..daemon.usage import audit_records, parse_since, summarize

    try:
        start = parse_since(since) if since else None
        rows = summarize(audit_records(paths.audit_file()), by=by, since=start)
    except ValueError as exc:
        fail(str(exc), 2)
    if as_json:
        for row in rows:
            sys.stdout.write(json.dumps(row.as_json(by)) + "\n")
        return
    from rich.console import Console

    from .render import usage_view

    Console().print(usage_view(rows, by))
