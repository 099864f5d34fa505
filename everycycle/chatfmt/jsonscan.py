"""Reading JSON as it streams in: where a value ends in a growing buffer, literal
sequences with optional whitespace, and a string's text before its closing quote.
No I/O; used by the tool-call parser (toolparse.py)."""

from __future__ import annotations


class JsonEnd:
    """Finds the index just past the bracket that closes the one at ``begin`` (strings
    respected), resuming where the last look stopped as the text grows."""

    def __init__(self, begin: int) -> None:
        self.begin = begin
        self._pos = begin
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def find(self, text: str) -> int | None:
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        i = self._pos
        try:
            while i < len(text):
                c = text[i]
                i += 1
                if in_string:
                    if escaped:
                        escaped = False
                    elif c == "\\":
                        escaped = True
                    elif c == '"':
                        in_string = False
                elif c == '"':
                    in_string = True
                elif c in "{[":
                    depth += 1
                elif c in "}]":
                    depth -= 1
                    if depth == 0:
                        return i
            return None
        finally:
            self._pos, self._depth, self._in_string, self._escaped = i, depth, in_string, escaped


WS = " \t\n\r"
W = None  # a run of optional whitespace, in match_seq's sequences
def match_seq(text: str, seqs: tuple[tuple[str | None, ...], ...]) -> int | None:
    """Whether ``text`` starts with one of ``seqs`` (literals and whitespace runs): the
    length matched, 0 when none can match, None when ``text`` is too short to tell."""
    undecided = False
    for seq in seqs:
        i, outcome = 0, "match"
        for part in seq:
            if part is None:
                while i < len(text) and text[i] in WS:
                    i += 1
                if i == len(text):
                    outcome = "short"
                    break
            elif text.startswith(part, i):
                i += len(part)
            else:
                outcome = "short" if part.startswith(text[i:]) else "no"
                break
        if outcome == "match":
            return i
        undecided = undecided or outcome == "short"
    return None if undecided else 0


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}
_HEX = set("0123456789abcdefABCDEF")


def _hex4(text: str, at: int) -> int | None:
    chunk = text[at:at + 4]
    return int(chunk, 16) if len(chunk) == 4 and set(chunk) <= _HEX else None


def decode_string(text: str, final: bool) -> tuple[str, int, bool]:
    """Decode a JSON string body from the start of ``text``: (decoded text, characters
    consumed, whether the closing quote was reached). Unless ``final``, stops before an
    escape that is not complete yet; an invalid escape is kept as written, a lone
    surrogate becomes U+FFFD."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            return "".join(out), i + 1, True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = text[i + 1:i + 2]
        if e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
            continue
        if not e or (e == "u" and len(text) < i + 6):
            if not final:
                break
            out.append(text[i:])
            i = len(text)
            continue
        code = _hex4(text, i + 2) if e == "u" else None
        if code is None:
            out.append(text[i:i + 2])
            i += 2
        elif 0xD800 <= code < 0xDC00:
            follow = text[i + 6:i + 12]
            if not final and len(follow) < 6 and "\\u".startswith(follow[:2]):
                break  # (its low surrogate may follow)
            low = _hex4(follow, 2) if follow.startswith("\\u") else None
            if low is not None and 0xDC00 <= low < 0xE000:
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
            else:
                out.append("\ufffd")
                i += 6
        else:
            out.append("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code))
            i += 6
    return "".join(out), i, False
