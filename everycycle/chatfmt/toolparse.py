"""Parsing tool calls out of a model's output, whole or streamed, for each format of
tools.py. One state machine (``StreamParser``); ``parse`` feeds it the whole text, so
streamed and whole results agree. A call that does not decode, or names an unknown
tool, goes back into the content verbatim and is counted in ``malformed``.
"""

from __future__ import annotations

import enum
import json
import secrets
import string
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from .jsonscan import WS, JsonEnd, W, decode_string, match_seq
from .tools import HERMES_CLOSE, HERMES_OPEN, MISTRAL_OPEN, PYTHON_TAG, ToolFormat, triggers


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name, its arguments as compact JSON text, and an id."""

    name: str
    arguments: str
    id: str


@dataclass(frozen=True)
class Parsed:
    """A whole output, split: free text, the calls, and how many calls were malformed."""

    content: str
    calls: list[ToolCall]
    malformed: int


@dataclass(frozen=True)
class TextDelta:
    """Content to emit now."""

    text: str


@dataclass(frozen=True)
class CallDelta:
    """A tool-call event: call ``index`` (from 0), its id and name (set in the first event
    of a call), and a fragment of its arguments (the whole arguments, here)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


Delta = TextDelta | CallDelta

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A random call id: 9 letters and digits (the form Mistral's templates demand)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _as_call(obj: object, names: Collection[str] | None) -> tuple[str, str, str | None] | None:
    """(name, arguments JSON, id) from a decoded call object, or None when it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    call_id = obj.get("id")
    return name, _compact(args), call_id if isinstance(call_id, str) and call_id else None


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


_INVALID = object()


_LLAMA3_SEQS: tuple[tuple[str | None, ...], ...] = (
    ("{", W, '"name"', W, ":"),
    ("{", W, '"type"', W, ":", W, '"function"', W, ",", W, '"name"', W, ":"),
)
_RESPONSE_SEQS: tuple[tuple[str | None, ...], ...] = (("{", W, '"response"', W, ":", W, '"'),)


class _State(enum.Enum):
    START = enum.auto()  # LLAMA3/GENERIC: nothing decided yet
    CONTENT = enum.auto()  # free text, watching for a trigger word
    CALL = enum.auto()  # the buffer starts with a trigger word
    LLAMA_JSON = enum.auto()  # LLAMA3: the buffer starts with a call's "{"
    LLAMA_NEXT = enum.auto()  # LLAMA3: after a call, another may follow
    OBJECT = enum.auto()  # GENERIC: one JSON object, whole
    RESPONSE = enum.auto()  # GENERIC: inside the "response" string
    RESPONSE_END = enum.auto()  # GENERIC: after it, expecting "}"
    VERBATIM = enum.auto()  # everything left is content


class StreamParser:
    """Splits a streamed output into content and tool calls as it arrives.

    ``feed`` returns what can be emitted now: text that could still begin a trigger word,
    or whitespace that may precede a call, is held back; a call is emitted whole (name
    and complete arguments) once it has ended. ``names`` limits calls to known tools;
    ``make_id`` makes the id of a call the model gave none.
    """

    def __init__(self, fmt: ToolFormat, *, names: Collection[str] | None = None,
                 make_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.malformed = 0
        self._names = names
        self._make_id = make_id
        self._buf = ""
        self._held_ws = ""
        self._after_call = False
        self._calls = 0
        self._out: list[Delta] = []
        self._final = False
        self._scan: JsonEnd | None = None
        self._state = (_State.START if fmt in (ToolFormat.LLAMA3, ToolFormat.GENERIC)
                       else _State.CONTENT)

    def feed(self, piece: str) -> list[Delta]:
        """Take the next piece of output; return the deltas it settles."""
        if self._final:
            raise ValueError("feed after finish")
        self._buf += piece
        return self._run()

    def finish(self) -> list[Delta]:
        """End of output: settle everything held back."""
        if self._final:
            return []
        self._final = True
        out = self._run()
        if self._held_ws:
            out = _merged([*out, TextDelta(self._held_ws)])
            self._held_ws = ""
        return out

    # -- emitting

    def _run(self) -> list[Delta]:
        while self._step():
            pass
        out, self._out = _merged(self._out), []
        return out

    def _text(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        held = self._held_ws + text
        core = held.rstrip()
        self._held_ws = held[len(core):]
        if core:
            self._out.append(TextDelta(core))

    def _call(self, name: str, arguments: str, call_id: str | None) -> None:
        self._held_ws = ""
        self._after_call = True
        self._out.append(CallDelta(self._calls, call_id or self._make_id(), name, arguments))
        self._calls += 1

    def _bad(self, verbatim: str) -> None:
        self.malformed += 1
        self._text(verbatim)

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._scan = None
        return taken

    def _json_end(self, start: int) -> int | None:
        """Where the JSON value opening at ``start`` of the buffer ends (None: not yet)."""
        if self._scan is None or self._scan.begin != start:
            self._scan = JsonEnd(start)
        return self._scan.find(self._buf)

    # -- the machine: each step consumes something and returns True, or waits

    def _step(self) -> bool:
        if not self._buf:
            return False
        return {
            _State.START: self._start,
            _State.CONTENT: self._content,
            _State.CALL: self._call_block,
            _State.LLAMA_JSON: self._llama_json,
            _State.LLAMA_NEXT: self._llama_next,
            _State.OBJECT: self._object,
            _State.RESPONSE: self._response,
            _State.RESPONSE_END: self._response_end,
            _State.VERBATIM: self._verbatim,
        }[self._state]()

    def _start(self) -> bool:
        stripped = self._buf.lstrip(WS)
        if not stripped and not self._final:
            return False
        lead = len(self._buf) - len(stripped)
        if self.fmt is ToolFormat.LLAMA3:
            found = match_seq(stripped, _LLAMA3_SEQS)
            if found is None and not self._final:
                return False
            if found:
                self._take(lead)
                self._state = _State.LLAMA_JSON
            else:
                self._state = _State.CONTENT
            return True
        if not stripped.startswith("{"):
            self._state = _State.VERBATIM
            return True
        found = match_seq(stripped, _RESPONSE_SEQS)
        if found is None and not self._final:
            return False
        if found:
            self._take(lead + found)
            self._state = _State.RESPONSE
        else:
            self._state = _State.OBJECT
        return True

    def _content(self) -> bool:
        words = triggers(self.fmt)
        hits = [(p, w) for w in words if (p := self._buf.find(w)) >= 0]
        if hits:
            p = min(hits)[0]
            self._text(self._take(p))
            self._state = _State.CALL
            return True
        keep = 0 if self._final else _partial_suffix(self._buf, words)
        if keep == len(self._buf):
            return False
        self._text(self._take(len(self._buf) - keep))
        return True

    def _hermes_block(self) -> bool:
        close = self._buf.find(HERMES_CLOSE, len(HERMES_OPEN))
        if close < 0 and not self._final:
            return False
        end = close + len(HERMES_CLOSE) if close >= 0 else len(self._buf)
        inner = self._buf[len(HERMES_OPEN):close if close >= 0 else end]
        call = _as_call(_loads(inner.strip()), self._names)
        return self._settle([call], self._take(end), _State.CONTENT, _State.CONTENT)

    def _call_block(self) -> bool:
        if self.fmt is ToolFormat.HERMES:
            return self._hermes_block()
        word = PYTHON_TAG if self.fmt is ToolFormat.LLAMA3 else MISTRAL_OPEN
        rest = self._buf[len(word):]
        start = len(self._buf) - len(rest.lstrip(WS))
        if start == len(self._buf):
            if not self._final:
                return False
            self._bad(self._take(len(self._buf)))
            return True
        opener = "{" if self.fmt is ToolFormat.LLAMA3 else "{["
        if self._buf[start] not in opener:
            self._bad(self._take(len(self._buf)))
            self._state = _State.VERBATIM
            return True
        end = self._json_end(start)
        if end is None:
            if not self._final:
                return False
            end = len(self._buf)
        value = _loads(self._buf[start:end])
        segment = self._take(end)
        items = value if isinstance(value, list) and self.fmt is ToolFormat.MISTRAL else [value]
        calls = [_as_call(item, self._names) for item in items]
        after = _State.LLAMA_NEXT if self.fmt is ToolFormat.LLAMA3 else _State.CONTENT
        return self._settle(calls, segment, after, _State.CONTENT)

    def _llama_json(self) -> bool:
        end = self._json_end(0)
        if end is None:
            if not self._final:
                return False
            end = len(self._buf)
        call = _as_call(_loads(self._buf[:end]), self._names)
        return self._settle([call], self._take(end), _State.LLAMA_NEXT, _State.CONTENT)

    def _settle(self, calls: list[tuple[str, str, str | None] | None], segment: str,
                good: _State, bad: _State) -> bool:
        """A block of output read whole: its calls when every one parsed (then state
        ``good``), else the block back as text (``bad``)."""
        if calls and all(calls):
            for call in calls:
                assert call is not None
                self._call(*call)
            self._state = good
        else:
            self._bad(segment)
            self._state = bad
        return True

    def _rest(self) -> str | None:
        """The buffer past its leading whitespace; None when that is all it holds (then
        taken at the end of the output, else kept until more comes)."""
        stripped = self._buf.lstrip(WS)
        if stripped:
            return stripped
        if self._final:
            self._take(len(self._buf))
        return None

    def _llama_next(self) -> bool:
        stripped = self._rest()
        if stripped is None:
            return self._final
        self._take(len(self._buf) - len(stripped))
        if stripped.startswith(";"):
            self._take(1)
        elif stripped.startswith("{"):
            self._state = _State.LLAMA_JSON
        else:
            self._state = _State.CONTENT
        return True

    def _object(self) -> bool:
        start = len(self._buf) - len(self._buf.lstrip(WS))
        end = self._json_end(start)
        if end is None:
            if not self._final:
                return False
            end = len(self._buf)
        value = _loads(self._buf[start:end])
        segment = self._take(end)
        items = value.get("tool_calls") if isinstance(value, dict) and len(value) == 1 else None
        calls = [_as_call(item, self._names) for item in items] if isinstance(items, list) else []
        return self._settle(calls, segment, _State.VERBATIM, _State.VERBATIM)

    def _response(self) -> bool:
        text, used, closed = decode_string(self._buf, self._final)
        if not used:
            return False
        self._take(used)
        self._text(text)
        if closed:
            self._state = _State.RESPONSE_END
        return True

    def _response_end(self) -> bool:
        stripped = self._rest()
        if stripped is None:
            return self._final
        if stripped.startswith("}"):
            self._take(len(self._buf) - len(stripped) + 1)
            self._after_call = True
        else:
            self._bad(self._take(len(self._buf)))
        self._state = _State.VERBATIM
        return True

    def _verbatim(self) -> bool:
        self._text(self._take(len(self._buf)))
        return True


def _partial_suffix(text: str, words: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``words``."""
    best = 0
    for word in words:
        for n in range(min(len(word) - 1, len(text)), best, -1):
            if word.startswith(text[-n:]):
                best = n
                break
    return best


def _merged(deltas: list[Delta]) -> list[Delta]:
    out: list[Delta] = []
    for d in deltas:
        if isinstance(d, TextDelta) and out and isinstance(out[-1], TextDelta):
            out[-1] = TextDelta(out[-1].text + d.text)
        else:
            out.append(d)
    return out


def collect(deltas: Sequence[Delta], malformed: int = 0) -> Parsed:
    """Reassemble streamed deltas into a Parsed (argument fragments joined per call)."""
    text: list[str] = []
    calls: dict[int, list[str]] = {}
    heads: dict[int, tuple[str, str]] = {}
    for d in deltas:
        if isinstance(d, TextDelta):
            text.append(d.text)
            continue
        if d.index not in heads:
            heads[d.index] = (d.name or "", d.id or "")
        calls.setdefault(d.index, []).append(d.arguments)
    return Parsed("".join(text), [ToolCall(heads[i][0], "".join(calls[i]), heads[i][1])
                                  for i in sorted(heads)], malformed)


def parse(fmt: ToolFormat, text: str, *, names: Collection[str] | None = None,
          make_id: Callable[[], str] = new_call_id) -> Parsed:
    """Split a whole output into content and calls (as ``StreamParser`` would)."""
    parser = StreamParser(fmt, names=names, make_id=make_id)
    deltas = parser.feed(text) + parser.finish()
    return collect(deltas, parser.malformed)
