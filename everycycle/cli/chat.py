"""``everycycle chat``: a conversation with a model, on a terminal or over a pipe.

Each turn sends the whole conversation as ``Generate.messages``; the daemon renders
it with the model's chat template and, through prefix reuse, only prefills what is
new. Line editing and the history file are prompt_toolkit's (imported only here).

Keys and commands: Enter sends; Alt-Enter (or Esc then Enter) starts a new line, and
so does a line ending in a backslash; a message may also be wrapped in triple quotes
across lines. Ctrl-C during an answer cancels that answer (on the daemon) and keeps
what was shown of it; Ctrl-C on an empty prompt, Ctrl-D and ``/bye`` leave.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import anyio
import anyio.to_thread

from .. import paths, statefile
from ..conversations import Saved
from ..errors import (
    DaemonUnavailableError,
    ErrorKind,
    EverycycleError,
    FileBusyError,
    unwrap_groups,
)
from ..protocol import (
    Accepted,
    Error,
    Generate,
    Message,
    Role,
    Tokens,
    ToolCall,
    ToolCalls,
    ToolChoice,
    Usage,
)
from .common import EXIT_CODES, image_part, with_images
from .interrupt import Interrupt
from .render import queued_line
from .thinking import Thoughts
from .toolloop import MAX_ROUNDS, Toolbox, assistant_turn

if TYPE_CHECKING:
    from ..client.aio import BaseClient

PROMPT = ">>> "
CONTINUATION = "... "

HELP = """\
Commands:
  /help, /?      this help
  /clear         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (and forget the conversation); /system shows it
  /image PATH    an image for your next message (a vision model reads it)
  /tools         the MCP tools the model may call (each call asks you first)
  /bye           leave (so do Ctrl-D, and Ctrl-C on an empty prompt)
Enter sends. Alt-Enter, or a line ending in \\, starts a new line; so does \"\"\" (until \"\"\").
Ctrl-C during an answer stops it and keeps what was shown.
"""


@dataclass
class Conversation:
    """The messages so far, and the system prompt that leads them."""

    system: str | None = None
    turns: list[Message] = field(default_factory=list)
    pending: str | None = None
    """A message the daemon went away before answering: sent again first."""
    images: list[Path] = field(default_factory=list)
    """Images for the next message (``/image PATH``)."""

    def messages(self) -> tuple[Message, ...]:
        lead = (Message(Role.SYSTEM, self.system),) if self.system else ()
        return (*lead, *self.turns)

    saved: Saved | None = None
    """Where it is kept (``chat --resume``); None: not kept."""

    def clear(self) -> None:
        self.turns.clear()
        if self.saved is not None:  # (a new conversation; the old one stays on disk)
            self.saved = Saved(model=self.saved.model)

    def keep(self) -> None:
        """Write it to its file; a failure is one line on stderr, and the chat goes on."""
        if self.saved is None or not self.turns:
            return
        self.saved.system, self.saved.messages = self.system, list(self.turns)
        try:
            self.saved.save()
        except (OSError, EverycycleError) as exc:
            sys.stderr.write(f"everycycle: the conversation was not saved: {exc}\n")

    def recap(self, out: TextIO) -> None:
        """The conversation so far, as it was shown (a resumed chat)."""
        for m in self.turns:
            if m.role is Role.USER:
                out.write(f"{PROMPT}{m.text}\n")
            elif m.role is Role.ASSISTANT and m.tool_calls:
                out.write("".join(f"⚒ {c.name}\n" for c in m.tool_calls))
            elif m.role is Role.ASSISTANT:
                out.write(f"{m.text}\n\n")
        out.flush()


class LineReader(Protocol):
    async def read(self) -> str | None:
        """The user's next message; None when they leave. Raises KeyboardInterrupt."""
        ...


class TerminalReader:
    """prompt_toolkit on a terminal: line editing, a history file, multi-line input."""

    def __init__(self, history: Path) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()

        @bindings.add("escape", "enter")
        def _newline(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        @bindings.add("enter")
        def _enter(event: Any) -> None:
            buf = event.current_buffer
            text = buf.text
            if text.endswith("\\") and buf.cursor_position == len(text):
                buf.delete_before_cursor(1)
                buf.insert_text("\n")
            elif text.startswith('"""') and not (len(text) >= 6 and text.endswith('"""')):
                buf.insert_text("\n")
            else:
                buf.validate_and_handle()

        @bindings.add("c-c")
        def _interrupt(event: Any) -> None:
            buf = event.current_buffer
            if buf.text:
                buf.reset()
            else:
                event.app.exit(exception=KeyboardInterrupt)

        class LockedHistory(FileHistory):
            """prompt_toolkit's history file, each entry appended whole under the file's
            lock (two chats at once never interleave their lines)."""

            def store_string(self, string: str) -> None:
                entry = f"\n# {datetime.datetime.now()}\n" + "".join(
                    f"+{line}\n" for line in string.split("\n"))
                try:
                    statefile.append(history, entry[:-1])
                except (OSError, FileBusyError) as exc:  # the chat goes on without it
                    sys.stderr.write(f"everycycle: chat history not kept in {history}: "
                                     f"{exc}\n")

        history.parent.mkdir(parents=True, exist_ok=True)
        self._session: Any = PromptSession(
            history=LockedHistory(str(history)), key_bindings=bindings, multiline=True,
            prompt_continuation=lambda width, line, soft: CONTINUATION,
        )

    async def read(self) -> str | None:
        try:
            text: str = await self._session.prompt_async(PROMPT)
        except EOFError:
            return None
        return _unquote(text)


class PipeReader:
    """Plain lines from a non-terminal stdin; a message per line (or a \"\"\" block)."""

    async def read(self) -> str | None:
        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            return None
        text = line.rstrip("\n")
        if text.startswith('"""'):
            while not (len(text) >= 6 and text.endswith('"""')):
                more = await anyio.to_thread.run_sync(sys.stdin.readline)
                if not more:
                    break
                text += "\n" + more.rstrip("\n")
        return _unquote(text)


def _unquote(text: str) -> str:
    if text.startswith('"""'):
        text = text[3:]
        text = text.removesuffix('"""')
    return text.strip()


def history_file() -> Path:
    """Where chat input history is kept (the state directory)."""
    return paths.state_dir() / "chat_history"


async def ask_on_terminal(question: str) -> str:
    """One answer typed on the terminal (a tool call's consent). Raises EOFError,
    KeyboardInterrupt."""
    from prompt_toolkit import PromptSession

    answer: str = await PromptSession[str]().prompt_async(question)
    return answer


async def open_toolbox(client: BaseClient, *, allow: tuple[str, ...], yes: bool,
                       announce: bool = True,
                       on_wait: Callable[[str], None] | None = None) -> Toolbox | None:
    """The daemon's MCP tools for this chat (None when the user configured none, or
    they cannot be had: said in one line, and the chat goes on without them).
    ``on_wait`` shows a status while the servers start ("" clears it)."""
    from ..tooluse import config

    try:
        if not config.load():
            return None  # (no mcp.json: nothing to ask the daemon)
    except EverycycleError as exc:
        sys.stderr.write(f"everycycle: no tools in this chat: {exc.message}\n")
        return None
    toolbox = Toolbox(client, sys.stderr, allow=allow, yes=yes,
                      ask=ask_on_terminal if sys.stdin.isatty() else None)
    if on_wait is not None:
        on_wait("starting MCP servers…")
    try:
        notes = await toolbox.start()
    except EverycycleError as exc:
        notes = [f"everycycle: no tools in this chat: {exc.message}"]
        toolbox.tools = {}
    finally:
        if on_wait is not None:
            on_wait("")
    sys.stderr.write("".join(f"{note}\n" for note in notes))
    if toolbox.tools and announce and sys.stdin.isatty():
        servers = sorted({t.server for t in toolbox.tools.values()})
        sys.stderr.write(f"Tools: {len(toolbox.tools)} from {', '.join(servers)} "
                         "(/tools lists them; each call asks you first).\n")
    return toolbox if toolbox.tools else None


def default_reader() -> LineReader:
    return TerminalReader(history_file()) if sys.stdin.isatty() else PipeReader()


async def chat(client: BaseClient, model: str, *, system: str | None = None,
               options: dict[str, Any] | None = None,
               reader: LineReader | None = None,
               on_loading: Callable[[str], None] | None = None,
               convo: Conversation | None = None, toolbox: Toolbox | None = None,
               markdown: bool = False) -> int:
    """Converse until the user leaves; the exit code (0, or 130 when interrupted).
    With ``markdown``, answers are rendered on the terminal as they arrive.

    Raises DaemonUnavailableError when the daemon goes away; ``convo`` (pass one to
    carry on with another client) then holds the conversation and the message that
    was not answered.
    """
    if reader is None:
        reader = default_reader()
    if convo is None:
        convo = Conversation(system=system)
    notice = sys.stderr
    if sys.stdin.isatty() and convo.pending is None:
        notice.write(f"Chatting with {model}. /help for help, /bye or Ctrl-D to leave.\n")
        notice.flush()
    code = 0  # the exit code: that of the last answer's error, if it failed
    while True:
        try:
            text = convo.pending if convo.pending is not None else await reader.read()
            convo.pending = None
        except KeyboardInterrupt:
            return code
        if text is None:
            return code
        if not text:
            continue
        if text.startswith("/"):
            command, _, arg = text.partition(" ")
            if command in ("/bye", "/exit", "/quit"):
                return code
            if command in ("/help", "/?"):
                notice.write(HELP)
            elif command == "/clear":
                convo.clear()
                notice.write("(conversation cleared)\n")
            elif command == "/system" and not arg.strip():  # show it; never clear it silently
                notice.write(f"(system prompt: {convo.system})\n" if convo.system else
                             "(no system prompt; /system TEXT sets one)\n")
            elif command == "/system":
                convo.system = arg.strip()
                convo.clear()
                notice.write("(system prompt set; conversation cleared)\n")
            elif command == "/tools":
                notice.write("".join(f"  {t.name} ({t.server}): {t.description[:70]}\n"
                                     for t in (toolbox.tools.values() if toolbox else ()))
                             or "(no MCP tools: `everycycle mcp add` adds a server)\n")
            elif command == "/image":
                path = Path(arg.strip())
                try:  # (readable, and not too big: said now, not later)
                    await anyio.to_thread.run_sync(image_part, path)
                except EverycycleError as exc:
                    notice.write(f"{exc.message}\n")
                else:
                    convo.images.append(path)
                    notice.write(f"(image {path.name} goes with your next message)\n")
            else:
                notice.write(f"unknown command {command}; /help lists them\n")
            notice.flush()
            continue
        try:
            content = await anyio.to_thread.run_sync(with_images, text, convo.images)
        except EverycycleError as exc:  # (an image changed since /image)
            notice.write(f"{exc.message}\n")
            convo.images.clear()
            continue
        convo.images.clear()
        convo.turns.append(Message(Role.USER, content))
        asked = len(convo.turns)
        tools: dict[str, Any] = {"tools": toolbox.offered} if toolbox and toolbox.offered else {}
        try:
            for round_ in range(MAX_ROUNDS + 1):
                if round_ == MAX_ROUNDS:  # (the model must answer now)
                    tools = {**tools, "tool_choice": ToolChoice.NONE} if tools else {}
                with unwrap_groups():
                    answer, ok, failed, calls = await _answer(
                        client, model, convo.messages(), {**(options or {}), **tools},
                        on_loading, markdown)
                if not (calls and toolbox and ok):
                    break
                convo.turns.append(assistant_turn(answer, calls))
                for call in calls:
                    convo.turns.append(await toolbox.run(call))
        except DaemonUnavailableError:
            del convo.turns[asked - 1:]
            convo.pending = text
            raise
        code = EXIT_CODES[failed] if failed is not None else 0
        if ok or answer:
            convo.turns.append(Message(Role.ASSISTANT, answer))
            convo.keep()
        elif len(convo.turns) == asked:
            convo.turns.pop()  # nothing came back: the question is not part of the talk


async def _answer(client: BaseClient, model: str, messages: tuple[Message, ...],
                  options: dict[str, Any], on_loading: Callable[[str], None] | None,
                  markdown: bool = False
                  ) -> tuple[str, bool, ErrorKind | None, tuple[ToolCall, ...]]:
    """Stream one answer to stdout: (the text shown, whether it finished, the kind of
    the error that ended it unless the user pressed Ctrl-C, the tools it called)."""
    from ..client.connection import new_request_id

    req = Generate(request_id=new_request_id(), model=model, messages=messages, usage=True,
                   **options)
    cut: str | None = None
    out = sys.stdout
    rendered = None
    if markdown:
        from .markdown import MarkdownStream

        rendered = MarkdownStream(out)
    shown: list[str] = []
    ok = False
    failed: ErrorKind | None = None
    calls: tuple[ToolCall, ...] = ()
    interrupt = Interrupt()
    thoughts = Thoughts(out)
    with _no_echo():
        async with anyio.create_task_group() as tg:
            await tg.start(interrupt.watch, client, req.request_id)
            try:
                if on_loading is not None:
                    on_loading("loading…")  # (the words `run` uses)
                async for event in client.request(req):
                    if isinstance(event, Accepted) and on_loading:
                        on_loading(queued_line(event) if event.queue_position
                                   else "generating…")
                    elif isinstance(event, Tokens):
                        if on_loading is not None:
                            on_loading("")
                        if interrupt.pressed:
                            continue  # stopped: what still comes is not shown
                        thoughts.write(event.chunk.reasoning or "")
                        if event.chunk.text:
                            thoughts.end(fold=True)  # the answer begins
                            shown.append(event.chunk.text)
                            if rendered is not None:
                                rendered.write(event.chunk.text)
                            else:
                                out.write(event.chunk.text)
                                out.flush()
                        ok = event.finished
                    elif isinstance(event, ToolCalls):
                        calls = event.calls
                    elif isinstance(event, Usage) and event.finish_reason in ("length", "context"):
                        cut = (f"(cut off after {event.generated_tokens} tokens: "
                               + ("-n)" if event.finish_reason == "length" else "the context is full)"))
                    elif isinstance(event, Error):
                        if on_loading is not None:
                            on_loading("")
                        if not interrupt.pressed:
                            failed = event.kind
                            sys.stderr.write(f"\neverycycle: {event.kind.value}: {event.message}\n")
            finally:
                tg.cancel_scope.cancel()
    thoughts.end(fold=True)
    if rendered is not None:
        rendered.end()  # (Rich ends each block with its blank line)
    else:
        out.write("\n")
    out.flush()
    if interrupt.pressed:
        sys.stderr.write("(stopped)\n")
    elif cut is not None:
        sys.stderr.write(cut + "\n")
    return "".join(shown), ok, failed, calls


@contextlib.contextmanager
def _no_echo() -> Iterator[None]:
    """While an answer streams, what the user types is not echoed into it ("generating…
    banana"); it stays in the terminal's input and reaches the next prompt (a Ctrl-C
    discards it, as the terminal does for an interrupt)."""
    if not sys.stdin.isatty():
        yield
        return
    import termios

    fd = sys.stdin.fileno()
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
