"""everycycle.chatfmt.tools: format detection, parsing whole and streamed, and the system prompt."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from templatehelp import SMOLLM2, fixture_source, gguf_chat

from everycycle.chatfmt import toolparse
from everycycle.chatfmt import tools as tc
from everycycle.chatfmt.jsonscan import JsonEnd
from everycycle.chatfmt.toolparse import (
    CallDelta,
    Parsed,
    StreamParser,
    TextDelta,
    ToolCall,
    collect,
    parse,
)
from everycycle.chatfmt.tools import ToolFormat
from everycycle.errors import InvalidRequestError

H, L, M, G = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL, ToolFormat.GENERIC
NAMES = ("add", "get_weather")
ADD = '{"a":1,"b":2}'
PARIS = '{"city":"Paris"}'


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def whole(fmt: ToolFormat, text: str) -> Parsed:
    return parse(fmt, text, names=NAMES, make_id=ids())


def streamed(fmt: ToolFormat, pieces: list[str]) -> Parsed:
    parser = StreamParser(fmt, names=NAMES, make_id=ids())
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    return collect(deltas, parser.malformed)


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
    return [text[i:j] for i, j in itertools.pairwise([0, *cuts, len(text)])]


def assert_streams_like_whole(fmt: ToolFormat, text: str) -> None:
    expected = whole(fmt, text)
    assert streamed(fmt, list(text)) == expected  # char by char
    for i in range(1, len(text)):  # split once at every position
        assert streamed(fmt, [text[:i], text[i:]]) == expected, i
    rng = random.Random(text)
    for _ in range(30):
        assert streamed(fmt, random_pieces(text, rng)) == expected


def calls(*pairs: tuple[str, str]) -> list[tuple[str, str]]:
    return list(pairs)


# (format, output, content, [(name, arguments)], malformed)
CASES: list[tuple[ToolFormat, str, str, list[tuple[str, str]], int]] = [
    # Hermes / Qwen
    (H, ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>'), "Let me check.", calls(("get_weather", PARIS)), 0),
    (H, ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
     "", calls(("add", ADD), ("get_weather", PARIS)), 0),
    (H, 'Hi <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call> bye',
     'Hi <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call> bye', [], 1),
    (H, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', [], 1),
    (H, "Text with <b>tags</b> and a cut <tool", "Text with <b>tags</b> and a cut <tool", [], 0),
    (H, ('<tool_call>\n{"name":"add","arguments":"{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>\n\n'
        "Done."), "Done.", calls(("add", ADD)), 0),
    (H, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "",
     calls(("add", ADD)), 0),  # unclosed at the end of output, but whole
    (H, '<tool_call>\n{"name": "add", "arguments": {"a": 1', ('<tool_call>\n{"name": "add", '
        '"arguments": {"a": 1'), [], 1),
    (H, "  spaced out  \n", "  spaced out  \n", [], 0),
    # Llama 3.x
    (L, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     calls(("get_weather", PARIS)), 0),
    (L, ' \n{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}', "",
     calls(("add", ADD)), 0),
    (L, 'I will call it.<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
     "I will call it.", calls(("add", ADD)), 0),
    (L, ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
        '"parameters": {"city": "Paris"}}'), "", calls(("add", ADD), ("get_weather", PARIS)), 0),
    (L, ('<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "get_weather", '
        '"parameters": {"city": "Paris"}}\nThat is all.'), "That is all.",
     calls(("add", ADD), ("get_weather", PARIS)), 0),
    (L, '{"name": "add", "parameters": {"a": 1, "b": }}',
     '{"name": "add", "parameters": {"a": 1, "b": }}', [], 1),
    (L, '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', [], 1),
    (L, '{"answer": 42}', '{"answer": 42}', [], 0),
    (L, 'The {"name": "add"} thing', 'The {"name": "add"} thing', [], 0),
    (L, "<|python_tag|>print(1)", "<|python_tag|>print(1)", [], 1),
    (L, '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', [], 1),
    # Mistral
    (M, 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abc123XYZ"}]',
     "Sure.", calls(("add", ADD)), 0),
    (M, ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
        '"arguments": {"city": "Paris"}}]'), "", calls(("add", ADD), ("get_weather", PARIS)), 0),
    (M, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1,}}] ok',
     '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1,}}] ok', [], 1),
    (M, '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
     '[TOOL_CALLS][{"name": "nope", "arguments": {}}]', [], 1),
    (M, '[TOOL_CALLS] {"name": "add", "arguments": {"a": 1, "b": 2}}', "",
     calls(("add", ADD)), 0),
    (M, "Arrays [1, 2] and a cut [TOOL", "Arrays [1, 2] and a cut [TOOL", [], 0),
    (M, "[TOOL_CALLS]add[ARGS]{}", "[TOOL_CALLS]add[ARGS]{}", [], 1),
    # Generic
    (G, '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}', "",
     calls(("add", ADD)), 0),
    (G, (' {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": '
        '"get_weather", "arguments": {"city": "Paris"}}]}\n'), "",
     calls(("add", ADD), ("get_weather", PARIS)), 0),
    (G, '{"response": "Hi \\"you\\"\\n\\u00e9\\ud83d\\ude00\\/"}', 'Hi "you"\né😀/', [], 0),
    (G, ' \n{ "response" : "hi" } \n', "hi", [], 0),
    (G, '{"tool_calls": [{"name": "add", "arguments": {"a": 1,}}]}',
     '{"tool_calls": [{"name": "add", "arguments": {"a": 1,}}]}', [], 1),
    (G, '{"tool_calls": [{"name": "nope", "arguments": {}}]}',
     '{"tool_calls": [{"name": "nope", "arguments": {}}]}', [], 1),
    (G, "Plain text, no JSON.", "Plain text, no JSON.", [], 0),
    (G, '{"response": "cut short', "cut short", [], 0),
    (G, '{"response": "hi", "extra": 1}', 'hi, "extra": 1}', [], 1),
    (G, '{"response": "lone \\ud800 surrogate"}', "lone \ufffd surrogate", [], 0),
]


@pytest.mark.parametrize(("fmt", "text", "content", "expected", "malformed"), CASES)
def test_parse(fmt: ToolFormat, text: str, content: str, expected: list[tuple[str, str]],
               malformed: int) -> None:
    got = whole(fmt, text)
    assert got.content == content
    assert [(c.name, c.arguments) for c in got.calls] == expected
    assert got.malformed == malformed


@pytest.mark.parametrize(("fmt", "text"), [(c[0], c[1]) for c in CASES])
def test_streaming_matches_whole_at_every_split(fmt: ToolFormat, text: str) -> None:
    assert_streams_like_whole(fmt, text)


def test_partial_marker_is_held_back_then_released() -> None:
    p = StreamParser(H, names=NAMES)
    assert p.feed("Hello <tool_") == [TextDelta("Hello")]
    assert p.feed("x") == [TextDelta(" <tool_x")]
    assert p.feed(" <") == []
    assert p.finish() == [TextDelta(" <")]


def test_call_is_emitted_when_it_closes() -> None:
    p = StreamParser(H, names=NAMES, make_id=lambda: "call1")
    assert p.feed('Ok\n\n<tool_call>\n{"name": "add", "arguments": {"a"') == [TextDelta("Ok")]
    assert p.feed(": 1, \"b\": 2}}\n</tool_") == []
    assert p.feed("call>\n") == [CallDelta(0, "call1", "add", ADD)]
    assert p.finish() == []


def test_generic_response_streams_as_it_comes() -> None:
    p = StreamParser(G)
    assert p.feed('{"respo') == []
    assert p.feed('nse": "Hel') == [TextDelta("Hel")]
    assert p.feed("lo\\") == [TextDelta("lo")]
    assert p.feed('n wor') == [TextDelta("\n wor")]
    assert p.feed('ld"}') == [TextDelta("ld")]
    assert p.finish() == []


def test_llama3_start_decision_waits_only_as_long_as_needed() -> None:
    p = StreamParser(L)
    assert p.feed(' {"na') == []
    assert p.feed("y") == [TextDelta(' {"nay')]
    q = StreamParser(L)
    assert q.feed("{ ") == []
    assert q.feed("x") == [TextDelta("{ x")]


def test_ids_given_by_the_model_are_kept_and_others_made() -> None:
    got = parse(M, '[TOOL_CALLS][{"name": "add", "arguments": {}, "id": "abc123XYZ"}, '
                   '{"name": "add", "arguments": {}}]')
    assert got.calls[0].id == "abc123XYZ"
    assert re.fullmatch(r"[A-Za-z0-9]{9}", got.calls[1].id)
    assert got.calls[0].id != got.calls[1].id


def test_without_names_any_tool_name_is_accepted() -> None:
    got = parse(H, '<tool_call>{"name": "anything", "arguments": {"x": [1, "é"]}}</tool_call>',
                make_id=lambda: "i")
    assert got == Parsed("", [ToolCall("anything", '{"x":[1,"é"]}', "i")], 0)


def test_feed_after_finish_is_an_error() -> None:
    p = StreamParser(H)
    p.finish()
    assert p.finish() == []
    with pytest.raises(ValueError):
        p.feed("x")


# -- property: any text, any split, same result ------------------------------------------

FRAGMENTS = {
    H: ["<tool_call>", "</tool_call>", "<tool", "_call", "</", "\n", " ", "x",
        '{"name": "add", "arguments": {"a": 1}}', '{"name": "nope", "arguments": {}}',
        "{", "}", '"', "\\"],
    L: ["<|python_tag|>", "<|python", '{"name": "add", "parameters": {}}', '{"type": "function",',
        ' "name": "add", "parameters": {"a": 1}}', ";", "\n", " ", "x", "{", "}", '"name"', ":"],
    M: ["[TOOL_CALLS]", "[TOOL", '[{"name": "add", "arguments": {}}]', "[", "]", "{", "}", " ",
        "x", '"', ','],
    G: ['{"response": "', '{"tool_calls": [', '{"name": "add", "arguments": {}}', "]}", '"}',
        "\\u00e9", "\\ud83d", "\\ude00", "\\", "n", '"', " ", "x", "{", "}"],
}


@settings(max_examples=150, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(list(ToolFormat)))
def test_any_split_of_any_text_gives_the_whole_result(data: st.DataObject,
                                                      fmt: ToolFormat) -> None:
    parts = data.draw(st.lists(st.sampled_from(FRAGMENTS[fmt]), max_size=12))
    text = "".join(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    bounds = sorted({0, len(text), *cuts})
    pieces = [text[i:j] for i, j in itertools.pairwise(bounds)]
    assert streamed(fmt, pieces) == whole(fmt, text)


ARGS = st.dictionaries(st.text(st.characters(codec="utf-8"), max_size=5),
                       st.one_of(st.integers(), st.text(max_size=5), st.booleans(), st.none()),
                       max_size=3)


def render(fmt: ToolFormat, before: str, made: list[tuple[str, dict[str, object]]]) -> str:
    """Output a model would write, in ``fmt``, with ``before`` as text before the calls."""
    if fmt is H:
        return before + "".join(
            f"\n<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
            for n, a in made)
    if fmt is L:
        return before + "<|python_tag|>" + "; ".join(
            json.dumps({"name": n, "parameters": a}) for n, a in made)
    if fmt is M:
        return before + "[TOOL_CALLS]" + json.dumps(
            [{"name": n, "arguments": a} for n, a in made])
    return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in made]})


@settings(max_examples=100, deadline=None)
@given(fmt=st.sampled_from(list(ToolFormat)),
       before=st.text(st.characters(codec="utf-8"), max_size=20),
       made=st.lists(st.tuples(st.sampled_from(NAMES), ARGS), min_size=1, max_size=3))
def test_calls_round_trip(fmt: ToolFormat, before: str,
                          made: list[tuple[str, dict[str, object]]]) -> None:
    if any(w in before for w in ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]")):
        return
    got = whole(fmt, render(fmt, before, made))
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == made
    assert got.malformed == 0
    if fmt is not G:
        assert got.content == before.rstrip()


# -- detection, triggers, the generic prompt ---------------------------------------------


@pytest.mark.parametrize(("name", "fmt"), [
    ("qwen2.5-instruct", H), ("hermes-2-pro-tool_use", H), ("qwen3", H),
    ("llama-3.1-instruct", L), ("mistral-nemo-instruct", M), ("gemma-3-it", G),
    ("deepseek-r1-distill", G),
    ("ministral-3-reasoning", M),  # (its [TOOL_CALLS]name[ARGS]{..} form is not parsed)
])
def test_detect_format(name: str, fmt: ToolFormat) -> None:
    assert tc.detect_format(fixture_source(name)) is fmt


def test_detect_format_edge_cases() -> None:
    assert tc.detect_format(None) is G
    assert tc.detect_format("") is G
    source, _, _ = gguf_chat(SMOLLM2)
    assert tc.detect_format(source) is G
    qwen3_coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n<parameter=' }}"
    assert tc.detect_format(qwen3_coder) is G
    assert tc.detect_format("role ipython ... 'parameters'") is L


def test_triggers() -> None:
    assert tc.triggers(H) == ["<tool_call>"]
    assert tc.triggers(L) == ["<|python_tag|>"]
    assert tc.triggers(M) == ["[TOOL_CALLS]"]
    assert tc.triggers(G) == []


START_BITS = ["{", "}", '"name"', '"type"', '"function"', '"func', '"nam', ":", ",", " ",
              "\n", "\t", "x", '"']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(START_BITS), max_size=10))
def test_llama3_start_agrees_with_its_trigger_pattern(bits: list[str]) -> None:
    """Where the parser's start-of-output test has decided, it agrees with the lazy
    grammar's pattern (the same output starts a call for both)."""
    text = "".join(bits)
    decided = toolparse.match_seq(text.lstrip(), toolparse._LLAMA3_SEQS)
    if decided is not None:
        assert bool(decided) == bool(re.match(tc.LLAMA3_START, text))


def test_generic_system_prompt_and_merge() -> None:
    tools = [{"type": "function", "function": {"name": "add", "description": "Adds",
                                               "parameters": {"type": "object"}}}]
    text = tc.generic_system_prompt(tools)
    assert '{"name": "add", "description": "Adds", "parameters": {"type": "object"}}' in text
    assert '{"tool_calls": [' in text and '{"response": ' in text
    merged = tc.add_system_prompt([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}], text)
    assert merged[0] == {"role": "system", "content": "Be brief.\n\n" + text}
    added = tc.add_system_prompt([{"role": "user", "content": "Hi"}], text)
    assert added[0] == {"role": "system", "content": text} and len(added) == 2


def test_tools_are_validated() -> None:
    assert tc.tool_names([{"name": "flat"}, {"type": "function", "function": {"name": "x"}}]) \
        == ["flat", "x"]
    for bad, match in [
        ([{"type": "function", "function": {"name": ""}}], "name must be a non-empty"),
        ([{"name": "a"}, {"name": "a"}], "two tools are named"),
        ([{"type": "retrieval", "function": {"name": "a"}}], "type must be"),
        ([{"name": "a", "parameters": []}], "parameters must be"),
        (["nope"], "must be an object"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            tc.normalize_tools(bad)  # type: ignore[arg-type]


class CountingEnd(JsonEnd):
    """The parser's own JSON scan, counting the characters it examines."""

    examined = 0

    def find(self, text: str) -> int | None:
        before = self._pos
        try:
            return super().find(text)
        finally:
            CountingEnd.examined += self._pos - before


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_long_calls_stream_in_linear_time(fmt: ToolFormat,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 28 kB call fed 4 characters at a time: the JSON scan resumes, never restarts
    (counted: each character examined once)."""
    monkeypatch.setattr(toolparse, "JsonEnd", CountingEnd)
    CountingEnd.examined = 0
    code = "x = 1\n" * 4000
    text = {H: f"<tool_call>{json.dumps({'name': 'add', 'arguments': {'c': code}})}</tool_call>",
            L: json.dumps({"name": "add", "parameters": {"c": code}}),
            M: "[TOOL_CALLS]" + json.dumps([{"name": "add", "arguments": {"c": code}}]),
            G: json.dumps({"tool_calls": [{"name": "add", "arguments": {"c": code}}]})}[fmt]
    got = streamed(fmt, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert CountingEnd.examined <= len(text)
    assert (CountingEnd.examined > 0) == (fmt is not H)  # (Hermes ends a call by its tag)
    assert [json.loads(c.arguments) for c in got.calls] == [{"c": code}]
