"""The everycycle command line: parse, call the client, render, map errors to exit codes.

stdout of ``run`` carries generated text only; every diagnostic goes to stderr.
Nothing heavy is imported at start: llama_cpp only on the embedded path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .. import __version__
from ..errors import (
    DaemonUnavailableError,
    EverycycleError,
)
from ..protocol import (
    Accepted,
    Error,
    Format,
    Generate,
    Message,
    Priority,
    Progress,
    Role,
    Tokens,
    ToolCall,
    ToolCalls,
    ToolChoice,
    Usage,
    encode,
)
from .common import (
    EXIT_CODES,
    EXIT_INTERRUPTED,
    MaxTokensOpt,
    ModelOpt,
    ModelsOpt,
    NoDaemonOpt,
    OfflineOpt,
    SamplingOpt,
    SeedOpt,
    SocketOpt,
    Status,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    VerboseOpt,
    app,
    exit_for,
    fail,
    hub_model,
    open_client,
    prepull,
    refuse_completion_model,
    registry_default,
    report,
    sampling_fields,
    with_images,
)
from .render import queued_line
from .runargs import read_text, tool_fields
from .stats import RunStats
from .thinking import Thoughts

if TYPE_CHECKING:
    from ..conversations import Saved


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


@app.command()
def run(
    prompt: Annotated[str | None, typer.Argument(
        metavar="[PROMPT]", help="The prompt; piped stdin is appended.")]
    = None,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    seed: SeedOpt = None,
    option: SamplingOpt = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")]
    = None,
    deadline: Annotated[float | None, typer.Option(
        "--deadline", min=0.001, help="Give up after this many seconds.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template.")] = False,
    json_schema: Annotated[Path | None, typer.Option(
        "--json-schema", help="Output must validate against this JSON Schema file.")] = None,
    grammar: Annotated[Path | None, typer.Option(
        "--grammar", help="Output must follow this GBNF grammar file (rule `root`).")] = None,
    tools: Annotated[Path | None, typer.Option(
        "--tools", help="Tools the model may call (a JSON file of OpenAI tool objects): "
        "its calls are printed as JSON lines.")] = None,
    tool_choice: Annotated[str | None, typer.Option(
        "--tool-choice", metavar="auto|required|NAME",
        help="With --tools: may call (auto), must call, or must call NAME.")] = None,
    think: Annotated[bool | None, typer.Option(
        "--think/--no-think", help="Show a thinking model's thoughts on stderr / ask it "
        "not to think (where its template can say).")] = None,
    image: Annotated[list[Path] | None, typer.Option(
        "--image", metavar="FILE", help="An image for a vision model to read (PNG, JPEG, "
        "WebP, GIF; repeatable), before the prompt.")] = None,
    mcp: Annotated[bool, typer.Option(
        "--mcp", help="Offer the MCP servers' tools (mcp.json); each call asks on the "
        "terminal, and without one is denied unless --allow/--yes allow it.")] = False,
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", metavar="TOOL", help="With --mcp: run this tool without asking.")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="With --mcp: run every call without "
                                      "asking.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the ServerEvent lines.")]
    = False,
    background: Annotated[bool, typer.Option(
        "--background", help="Batch work: wait behind interactive requests, and give a "
        "slot up to one while it runs (it resumes where it stopped).")] = False,
    no_daemon: NoDaemonOpt = False,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text, streaming it to stdout; with no PROMPT on a terminal, chat.

    \b
    Example:
      cat notes.md | everycycle run "Summarize:" | tee out.txt
    """
    chosen = sampling_fields(option, temperature=temperature, top_p=top_p, top_k=top_k,
                             seed=seed)
    if prompt is None and sys.stdin.isatty() and not as_json:
        _chat(model=model, system=None, max_tokens=max_tokens, chosen=chosen,
              no_daemon=no_daemon, offline=offline, models=models, socket=socket,
              verbose=verbose, tools=((), False))  # (as `chat`: tools asked for per call)
        return
    text = prompt or ""
    if not sys.stdin.isatty():
        piped = sys.stdin.buffer.read().decode("utf-8", "replace")
        if piped:
            text = f"{text}\n\n{piped}" if text else piped
    if not text.strip():
        fail("usage: the prompt is empty: give a PROMPT or pipe text on stdin", 2)
    status = Status(verbose)
    try:
        name = hub_model(model or registry_default(models), models, offline)
        if image and raw:
            fail("usage: --image needs the chat template (not --raw)", 2)
        if mcp and (raw or tools):
            fail("usage: --mcp needs the chat template and its own tools (not --raw or "
                 "--tools)", 2)
        turn = tool_fields(tools, tool_choice, with_images(text, image))
        if (image or mcp) and not turn:
            turn = {"messages": (Message(Role.USER, with_images(text, image)),)}
        req = Generate(
            request_id=uuid.uuid4().hex, model=name, prompt=None if turn else text,
            think=think, **turn, max_tokens=max_tokens, **chosen,
            stop=tuple(stop) if stop else None, format=Format.RAW if raw else None,
            deadline_ms=None if deadline is None else max(1, int(deadline * 1000)),
            json_schema=read_text(json_schema, "--json-schema"),
            grammar=read_text(grammar, "--grammar"), usage=True,
            progress=True if status.tty and not as_json else None,  # (the status line)
            priority=Priority.BACKGROUND if background else None,
        )
        prepull(name, models, offline)
        if not raw:
            _note_if_no_template(name, models)
    except EverycycleError as exc:
        exit_for(exc)
    import anyio

    code = anyio.run(_run, req, socket, models, no_daemon, as_json, status, think is True,
                     (tuple(allow or ()), yes) if mcp else None)
    raise typer.Exit(code)


async def _run(req: Generate, socket: Path | None, models: Path | None, no_daemon: bool,
               as_json: bool, status: Status, show_thoughts: bool,
               mcp: tuple[tuple[str, ...], bool] | None) -> int:
    import anyio

    from .chat import open_toolbox
    from .interrupt import Interrupt
    from .toolloop import MAX_ROUNDS, assistant_turn

    out = sys.stdout.buffer
    interrupt = Interrupt()
    stats = RunStats(req, status)
    thoughts = Thoughts(sys.stderr)
    try:
        async with open_client(socket, models, no_daemon, status) as client:
            stats.begin()
            toolbox = None if mcp is None else await open_toolbox(
                client, allow=mcp[0], yes=mcp[1], announce=False,
                on_wait=lambda text: status.show(text) if text else status.clear())
            if toolbox is not None:
                req = dataclasses.replace(req, tools=toolbox.offered)
            elif mcp is not None:
                sys.stderr.write("everycycle: --mcp: no MCP tools to offer (`everycycle "
                                 "mcp add` adds a server)\n")
            status.show("loading…")
            async def stream(req: Generate) -> tuple[int, str, tuple[ToolCall, ...]]:
                """One request's events shown: (its exit code, its text, its calls)."""
                result, said = 0, []
                calls: tuple[ToolCall, ...] = ()
                async for event in client.request(req):
                    if as_json:
                        out.write(encode(event))
                        out.flush()
                    if isinstance(event, Accepted):
                        if event.queue_position:
                            status.show(queued_line(event))
                        else:
                            status.show("generating…")
                    elif isinstance(event, Progress):
                        status.show(f"reading the prompt: {event.processed:,} of "
                                    f"{event.total:,} tokens")
                    elif isinstance(event, Tokens):
                        status.clear()
                        stats.tokens(event)
                        if show_thoughts and not as_json:
                            thoughts.write(event.chunk.reasoning or "")
                        said.append(event.chunk.text)
                        if not as_json and event.chunk.text:
                            thoughts.end(fold=False)
                            out.write(event.chunk.text.encode("utf-8"))
                            out.flush()
                    elif isinstance(event, ToolCalls):
                        calls = event.calls
                        if toolbox is None and not as_json:  # (--tools: printed, not run)
                            for call in event.calls:
                                out.write(json.dumps(
                                    {"id": call.id, "name": call.name,
                                     "arguments": json.loads(call.arguments)},
                                    ensure_ascii=False).encode() + b"\n")
                            out.flush()
                    elif isinstance(event, Usage):
                        stats.usage = event
                    elif isinstance(event, Error):
                        status.clear()
                        if interrupt.pressed:
                            result = EXIT_INTERRUPTED
                        else:
                            sys.stderr.write(f"everycycle: {event.kind.value}: "
                                             f"{event.message}\n")
                            result = EXIT_CODES[event.kind]
                return result, "".join(said), calls

            async with anyio.create_task_group() as tg:
                await tg.start(interrupt.watch, client, req.request_id)
                result = 0
                try:
                    for round_ in range(MAX_ROUNDS + 1):
                        result, text, calls = await stream(req)
                        if toolbox is None or not calls or result:
                            break
                        status.clear()
                        answers = [await toolbox.run(call) for call in calls]
                        last = round_ == MAX_ROUNDS - 1  # (the model must answer now)
                        req = dataclasses.replace(
                            req, request_id=uuid.uuid4().hex, messages=(
                                *(req.messages or ()), assistant_turn(text, calls), *answers),
                            tool_choice=ToolChoice.NONE if last else req.tool_choice)
                        interrupt.target = req.request_id
                except BrokenPipeError:
                    # The reader went away (`| head`): cancel on the daemon, exit quietly.
                    with anyio.move_on_after(2, shield=True):
                        await client.cancel_if_active(interrupt.target)
                    _silence_stdout()
                    result = 0
                except EverycycleError as exc:  # e.g. the daemon died mid-stream
                    status.clear()
                    result = report(exc)
                tg.cancel_scope.cancel()
            thoughts.end(fold=False)
            if not as_json and result == 0 and sys.stdout.isatty():
                out.write(b"\n")
                out.flush()
            if result == 0:
                stats.end()
            return result
    except EverycycleError as exc:
        status.clear()
        return report(exc)


@app.command("chat")
def chat_cmd(
    model: ModelOpt = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    seed: SeedOpt = None,
    option: SamplingOpt = None,
    no_daemon: NoDaemonOpt = False,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
    verbose: VerboseOpt = False,
    tools: Annotated[bool, typer.Option(
        "--tools/--no-tools", help="Offer the model the MCP servers' tools (mcp.json); "
        "each call asks you first.")] = True,
    allow: Annotated[list[str] | None, typer.Option(
        "--allow", metavar="TOOL", help="Run this tool without asking (repeatable).")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Run every tool call without asking.")
                   ] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Carry on with the last conversation.")] = False,
    resume_id: Annotated[str | None, typer.Option(
        "--resume-id", metavar="ID", help="Carry on with this saved conversation.")] = None,
    listing: Annotated[bool, typer.Option(
        "--list", help="List the saved conversations and leave.")] = False,
    plain: Annotated[bool, typer.Option(
        "--plain", help="Show answers as the model wrote them (no Markdown rendering).")
                     ] = False,
) -> None:
    """Chat with a model: the whole conversation goes with every turn.

    \b
    Example:
      everycycle chat --system "Answer in one sentence."
    """
    if listing:
        _list_conversations()
        return
    resumed = None
    if resume or resume_id:
        from .. import conversations

        try:
            resumed = conversations.load(resume_id) if resume_id else conversations.latest()
        except EverycycleError as exc:
            exit_for(exc)
        model, system = model or resumed.model, system or resumed.system
    _chat(model=model, system=system, max_tokens=max_tokens, resumed=resumed, plain=plain,
          chosen=sampling_fields(option, temperature=temperature, top_p=top_p, top_k=top_k,
                                 seed=seed),
          no_daemon=no_daemon, offline=offline, models=models, socket=socket,
          verbose=verbose, tools=(tuple(allow or ()), yes) if tools else None)


def _chat(*, model: str | None, system: str | None, max_tokens: int | None,
          chosen: dict[str, Any], no_daemon: bool, offline: bool,
          models: Path | None, socket: Path | None, verbose: bool,
          tools: tuple[tuple[str, ...], bool] | None, resumed: Saved | None = None,
          plain: bool = False) -> None:
    status = Status(verbose)
    try:
        name = hub_model(model or registry_default(models), models, offline)
        refuse_completion_model(name, models)
        prepull(name, models, offline)
        options: dict[str, Any] = {**chosen, **({} if max_tokens is None
                                                else {"max_tokens": max_tokens})}
        Generate(request_id="probe", model=name, prompt="", **options)  # validate options
    except EverycycleError as exc:
        exit_for(exc)
    import anyio

    async def session() -> int:
        from .chat import Conversation, chat, default_reader, open_toolbox

        def loading(text: str) -> None:
            if text:
                status.show(text)
            else:
                status.clear()

        from ..conversations import Saved

        convo = Conversation(system=system, saved=resumed or Saved(model=name))
        if resumed is not None:
            convo.turns = list(resumed.messages)
            if sys.stdout.isatty():
                convo.recap(sys.stdout)
        reader = default_reader()
        while True:
            try:
                async with open_client(socket, models, no_daemon, status) as client:
                    status.settle()  # "no daemon: running in-process" stays, on its own line
                    toolbox = None if tools is None else await open_toolbox(
                        client, allow=tools[0], yes=tools[1], on_wait=loading)
                    return await chat(client, name, options=options, on_loading=loading,
                                      reader=reader, convo=convo, toolbox=toolbox,
                                      markdown=not plain and sys.stdout.isatty())
            except DaemonUnavailableError:
                # The daemon went away between or during answers: the conversation
                # carries on, on a daemon if one is back, else in this process.
                status.clear()
                sys.stderr.write("\neverycycle: the daemon went away; carrying on "
                                 "(the conversation is kept)\n")
                sys.stderr.flush()
            except EverycycleError as exc:
                status.clear()
                return report(exc)

    raise typer.Exit(anyio.run(session))


def _list_conversations() -> None:
    from rich.console import Console

    from ..conversations import listed
    from .render import conversations_view

    Console().print(conversations_view([(s.id, s.updated, s.model, len(s.messages), s.title)
                                        for s in listed()]))


def _note_if_no_template(name: str, models: Path | None) -> None:
    """Say once, on stderr, that a chat-format request goes to a model without a chat
    template (its prompt is then sent as is). Quiet when the file is not local yet."""
    from ..hardware.gguf import read_metadata
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


def _silence_stdout() -> None:
    # Point fd 1 at /dev/null so the interpreter's final flush cannot fail again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main() -> None:
    """Console-script entry point."""
    usage_error: type[Exception] = typer.BadParameter.__mro__[1]  # Click's UsageError
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:  # Ctrl-C outside any request (e.g. as one just ended)
        sys.stderr.write("\n")
        raise SystemExit(EXIT_INTERRUPTED) from None
    except usage_error as exc:
        # One line, as every other failure: what is wrong, and where help is.
        shown: Any = exc  # (typed as Click's own: format_message, show, ctx, exit_code)
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `everycycle`: the help
            shown.show()
            raise SystemExit(shown.exit_code) from None
        ctx = getattr(exc, "ctx", None)
        path = ctx.command_path.split() if ctx is not None else []
        while path and path[0] != "everycycle":  # (`python -m everycycle …`)
            path.pop(0)
        where = " ".join(path or ["everycycle"])
        sys.stderr.write(f"everycycle: {shown.format_message()} (`{where} --help` says more)\n")
        raise SystemExit(2) from None
    raise SystemExit(code if isinstance(code, int) else 0)


# The other commands register themselves on ``app`` when imported.
from . import daemon as _daemon_commands  # noqa: F401
from . import fleet as _fleet_commands  # noqa: F401
from . import keys as _keys_commands  # noqa: F401
from . import launch as _launch_commands  # noqa: F401
from . import mcp as _mcp_commands  # noqa: F401
from . import models as _models_commands  # noqa: F401
from . import rpc as _rpc_commands  # noqa: F401
from . import vectors as _vector_commands  # noqa: F401
