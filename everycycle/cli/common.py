"""What every command of the CLI shares: the Typer app, common options, exit codes,
one-line error reporting, the status line, and the blocking daemon call.

Nothing heavy is imported here: commands import what they need when they run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from ..errors import (
    DaemonUnavailableError,
    ErrorKind,
    EverycycleError,
    ProtocolError,
    UnavailableError,
)
from ..protocol import MAX_TOKENS_LIMIT, ContentPart, sampling

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
    # Click's own help: options on one line, text wrapped whole at the terminal's width
    # (Rich's tables squeeze help into a narrow column and cut option names at 80).
    rich_markup_mode=None,
)

SocketOpt = Annotated[Path | None, typer.Option("--socket", help="Daemon socket path.",
                                                envvar="EVERYCYCLE_SOCKET")]
ModelsOpt = Annotated[Path | None, typer.Option("--models", help="Use this models.toml only.")]
ModelOpt = Annotated[str | None, typer.Option("-m", "--model", help="Model name.")]
MaxTokensOpt = Annotated[int | None, typer.Option(
    "-n", "--max-tokens", min=1, max=MAX_TOKENS_LIMIT, help="Longest answer, in tokens.")]


def _sampling_option(p: sampling.Param[Any]) -> Any:
    """The CLI option of a sampling parameter with its own flag, from the table."""
    default = "" if p.default is None else f" (default {p.default:g}, or the model's)"
    return typer.Option(f"--{p.name.replace('_', '-')}", min=p.low, max=p.high,
                        help=p.help.rstrip(".") + default + ".")


TemperatureOpt = Annotated[float | None, _sampling_option(sampling.TEMPERATURE)]
TopPOpt = Annotated[float | None, _sampling_option(sampling.TOP_P)]
TopKOpt = Annotated[int | None, _sampling_option(sampling.TOP_K)]
SeedOpt = Annotated[int | None, _sampling_option(sampling.SEED)]
SamplingOpt = Annotated[list[str] | None, typer.Option(
    "-o", "--option", metavar="NAME=VALUE",
    help="A sampling parameter, repeatable: "
    + ", ".join(p.name for p in sampling.PARAMS if not p.flag)
    + " (DRY breakers comma-separated; logit_bias as JSON, '{\"1234\": -100}').")]
NoDaemonOpt = Annotated[bool, typer.Option("--no-daemon", help="Run in-process.")]
OfflineOpt = Annotated[bool, typer.Option("--offline", help="Never download a model.")]
VerboseOpt = Annotated[bool, typer.Option(
    "-v", "--verbose", help="Say what happens on stderr (loading, queue position).")]


def sampling_fields(options: list[str] | None, **flags: Any) -> dict[str, Any]:
    """The sampling parameters given on the command line: its own flags (``flags``, by
    name) and ``-o NAME=VALUE``, checked against the table. Exits 2 on a mistake."""
    fields = {name: value for name, value in flags.items() if value is not None}
    for option in options or ():
        name, eq, text = option.partition("=")
        if not eq:
            fail(f"usage: -o takes NAME=VALUE, not {option!r}", 2)
        try:
            key, value = sampling.from_text(name.strip(), text.strip())
            sampling.checked({key: value})
        except ProtocolError as exc:
            fail(f"usage: -o {option}: {exc.message}", 2)
        fields[key] = value
    return fields


def fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"everycycle: {message}\n")
    raise typer.Exit(code)


def exit_for(exc: EverycycleError) -> NoReturn:
    raise typer.Exit(report(exc))


class Status:
    """A one-line status on stderr, only on a terminal (or with -v), cleared when text comes."""

    def __init__(self, verbose: bool) -> None:
        self.tty = sys.stderr.isatty()
        self.verbose = verbose
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

    def settle(self) -> None:
        """Keep the status shown as a line of its own (what follows starts below it)."""
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.shown = False


def report(exc: EverycycleError) -> int:
    """One line on stderr; the exit code for ``exc``."""
    if isinstance(exc, DaemonUnavailableError):
        sys.stderr.write(f"everycycle: {exc.message}; start one with `everycycle daemon "
                         "--detach`\n")
        return EXIT_UNAVAILABLE
    if isinstance(exc, UnavailableError):
        sys.stderr.write(f"everycycle: {exc.message}\n")
        return EXIT_UNAVAILABLE
    sys.stderr.write(f"everycycle: {exc.kind.value}: {exc.message}\n")
    return EXIT_CODES[exc.kind]


def call(socket: Path | None, fn: Any, *, unavailable_raises: bool = False) -> Any:
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
        exit_for(exc)
    except EverycycleError as exc:
        exit_for(exc)


def hub_model(name: str, models: Path | None, offline: bool) -> str:
    """``name``, or for a hub URL (``hf://owner/repo[:QUANT]``) the registry entry
    recorded for it, pulled and recorded the first time (progress on stderr), as
    ``ollama run hf.co/…`` does. Raises EverycycleError subclasses."""
    from ..models import manage

    if not manage.is_hub_url(name):
        return name
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    return manage.resolve(name, models, progress=sys.stderr.isatty())


def draft_source(name: str, models: Path | None, offline: bool) -> str:
    """``--draft-model``'s value as the daemon reads it: a GGUF path made absolute, a hub
    repo URL pulled and recorded as ``hub_model`` does, an entry pulled as ``prepull``
    does; an ``hf://…/file.gguf`` URL as given. Raises EverycycleError subclasses."""
    if name.endswith(".gguf") and not name.startswith("hf:"):
        return str(Path(name).expanduser().absolute())
    if not name.endswith(".gguf"):
        name = hub_model(name, models, offline)
        prepull(name, models, offline)
    return name


def prepull(name: str, models: Path | None, offline: bool) -> None:
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


def image_part(path: Path) -> ContentPart:
    """An image file as a message part. Raises InvalidRequestError for a file that
    cannot be read or is over the size limit (what the image is, the model decides)."""
    import base64

    from ..errors import InvalidRequestError, ProtocolError
    from ..protocol import MAX_IMAGE_BYTES, PartType

    path = path.expanduser()
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise InvalidRequestError(f"{path}: {size >> 20} MiB; an image is at most "
                                      f"{MAX_IMAGE_BYTES >> 20} MiB")
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"{path}: {exc.strerror or exc}") from None
    try:
        return ContentPart(PartType.IMAGE, data=base64.b64encode(data).decode("ascii"))
    except ProtocolError as exc:
        raise InvalidRequestError(f"{path}: {exc.message}") from None


def with_images(text: str, images: list[Path] | None) -> str | tuple[ContentPart, ...]:
    """A user's content: ``text``, after the images (each a part), if any."""
    if not images:
        return text
    from ..protocol import PartType

    return (*(image_part(p) for p in images), ContentPart(PartType.TEXT, text))


@contextlib.asynccontextmanager
async def open_client(socket: Path | None, models: Path | None, no_daemon: bool,
                      status: Status) -> AsyncIterator[BaseClient]:
    """A client of the daemon on ``socket``, or (none running, or ``no_daemon``) of
    one in this process."""
    from ..client.aio import connect
    from ..client.inprocess import embedded

    async with contextlib.AsyncExitStack() as stack:
        client: BaseClient | None = None
        if not no_daemon:
            try:  # (only the connecting: what the body raises is the caller's)
                client = await stack.enter_async_context(connect(socket))
            except DaemonUnavailableError:
                status.show("no daemon: running in-process")
        if client is None:
            client = await stack.enter_async_context(embedded(models))
        yield client


def registry_default(models: Path | None) -> str:
    """The registry's default model name. Raises ConfigError when none is set."""
    from ..models.registry import load_registry

    return load_registry(models).default_name()


def refuse_completion_model(name: str, models: Path | None) -> None:
    """A chat with a completion model (``format = "raw"``: a base model) is a usage
    error that says what works instead."""
    from ..models.registry import load_registry
    from ..protocol import Format

    spec = load_registry(models).models.get(name)
    if spec is not None and spec.format is Format.RAW:
        fail(f"{name} is a completion model: it continues text and has no chat; try "
             f'everycycle run -m {name} "Once upon a time"', 2)
