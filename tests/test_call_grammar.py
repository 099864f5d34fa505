"""everycycle.chatfmt.callgrammar.call_grammar, checked by the constraint engine itself: llguidance
compiles each grammar, and its matcher (on SmolLM2's vocabulary, no weights, built as the
engine builds it) accepts the calls each format's model would write, token by token, and
refuses malformed ones."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from everycycle.chatfmt import callgrammar
from everycycle.chatfmt import tools as tc
from everycycle.chatfmt.toolparse import parse
from everycycle.chatfmt.tools import ToolFormat
from everycycle.errors import InvalidRequestError

llamacheck = pytest.importorskip("llamacheck")

H, L, M, G = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL, ToolFormat.GENERIC


def call_grammar(*args: Any, **kwargs: Any) -> str:
    """The grammar text of ``callgrammar.call_grammar``."""
    return callgrammar.call_grammar(*args, **kwargs).grammar


def fn(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"{name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [
    fn("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0},
                                                "b": {"type": "number"}},
               "required": ["a", "b"]}),
    fn("get_weather", {"type": "object",
                       "properties": {"city": {"type": "string"},
                                      "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}),
    fn("now"),
]
ADD = '{"name": "add", "%s": {"a": 1, "b": 2.5}}'
WEATHER = '{"name": "get_weather", "%s": {"city": "Paris", "unit": "c"}}'
NOW = '{"name": "now", "%s": {}}'


@pytest.fixture(scope="module")
def vocab() -> Any:
    if not llamacheck.SMOLLM2.exists():
        pytest.skip("SmolLM2's GGUF is not on this machine")
    return llamacheck.smollm2()


def key(fmt: ToolFormat) -> str:
    return "parameters" if fmt is L else "arguments"


def good_outputs(fmt: ToolFormat) -> list[str]:
    k = key(fmt)
    add, weather, now = ADD % k, WEATHER % k, NOW % k
    if fmt is H:
        return [f"<tool_call>\n{add}\n</tool_call>",
                f"<tool_call>{weather}</tool_call>\n<tool_call>\n{now}\n</tool_call>"]
    if fmt is L:
        return [add, f"<|python_tag|>{weather}", f"{add}; {now}", f"<|python_tag|>{now}\n{add}"]
    if fmt is M:
        idd = ', "id": "abcDEF123"}'
        return [f"[TOOL_CALLS][{add[:-1]}{idd}]",
                f"[TOOL_CALLS] [{weather[:-1]}{idd}, {now[:-1]}{idd}]"]
    return [f'{{"tool_calls": [{add}]}}', f'{{"tool_calls": [{weather}, {now}]}}',
            '{"response": "Hello, \\"world\\" é"}']


def bad_outputs(fmt: ToolFormat) -> list[str]:
    k = key(fmt)
    wrap = {H: "<tool_call>%s</tool_call>", L: "%s", M: "[TOOL_CALLS][%s]",
            G: '{"tool_calls": [%s]}'}[fmt]
    idd = ', "id": "abcDEF123"' if fmt is M else ""
    return [
        wrap % f'{{"name": "add", "{k}": {{"a": 1}}{idd}}}',  # a required argument missing
        wrap % f'{{"name": "add", "{k}": {{"a": "one", "b": 2}}{idd}}}',  # wrong type
        wrap % f'{{"name": "nope", "{k}": {{}}{idd}}}',  # unknown tool
        wrap % f'{{"name": "get_weather", "{k}": {{"city": "X", "unit": "k"}}{idd}}}',  # enum
        wrap % f'{{"name": "now", "{k}": {{}}{idd}',  # cut short
        "Just text.",
    ]


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize(("forced", "parallel"), list(itertools.product([False, True], repeat=2)))
def test_grammar_compiles_for_the_vocabulary(vocab: Any, fmt: ToolFormat, forced: bool,
                                            parallel: bool) -> None:
    grammar = call_grammar(fmt, TOOLS, forced=forced, parallel=parallel)
    assert vocab.compiles(grammar)


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_grammar_accepts_well_formed_calls_which_parse(vocab: Any, fmt: ToolFormat) -> None:
    gbnf = call_grammar(fmt, TOOLS, forced=False)
    names = tc.tool_names(TOOLS)
    for text in good_outputs(fmt):
        assert vocab.accepts(gbnf, text), text
        got = parse(fmt, text, names=names)
        assert got.malformed == 0, text
        assert got.calls or fmt is G, text


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("forced", [False, True])
def test_grammar_refuses_malformed_calls(vocab: Any, fmt: ToolFormat, forced: bool) -> None:
    grammar = call_grammar(fmt, TOOLS, forced=forced)
    for text in bad_outputs(fmt):
        if text == "Just text." and not forced and fmt is not G:
            assert vocab.accepts(grammar, text)  # free text, until a call begins
        else:
            assert not vocab.accepts(grammar, text), text


def test_forced_generic_refuses_a_plain_response(vocab: Any) -> None:
    gbnf = call_grammar(G, TOOLS, forced=True)
    assert not vocab.accepts(gbnf, '{"response": "no"}')
    assert vocab.accepts(gbnf, '{"tool_calls": [%s]}' % (NOW % "arguments"))


def single(fmt: ToolFormat, call: str) -> str:
    """One call, as ``fmt`` writes it."""
    if fmt is M:
        call = call[:-1] + ', "id": "abcDEF123"}'
    return {H: "<tool_call>\n%s\n</tool_call>", L: "%s", M: "[TOOL_CALLS][%s]",
            G: '{"tool_calls": [%s]}'}[fmt] % call


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_named_tool_only(vocab: Any, fmt: ToolFormat) -> None:
    gbnf = call_grammar(fmt, TOOLS, forced=True, name="get_weather")
    assert vocab.accepts(gbnf, single(fmt, WEATHER % key(fmt)))
    assert not vocab.accepts(gbnf, single(fmt, ADD % key(fmt)))
    assert not vocab.accepts(gbnf, single(fmt, NOW % key(fmt)))


@pytest.mark.parametrize("fmt", [H, L, M])
def test_not_parallel_allows_one_call(vocab: Any, fmt: ToolFormat) -> None:
    gbnf = call_grammar(fmt, TOOLS, forced=False, parallel=False)
    outputs = good_outputs(fmt)
    assert vocab.accepts(gbnf, outputs[0])
    assert not vocab.accepts(gbnf, outputs[-1] if fmt is not L else outputs[2])


def test_lazy_grammars_start_at_the_trigger(vocab: Any) -> None:
    hermes = call_grammar(H, TOOLS, forced=False)
    text = "Let me look.\n<tool_call>\n" + WEATHER % "arguments" + "\n</tool_call>"
    assert vocab.accepts(hermes, text)
    assert vocab.accepts(hermes, "No call <tool here.")
    assert not vocab.accepts(hermes, "Let me look.<tool_call>not a call")
    llama = call_grammar(L, TOOLS, forced=False)
    assert vocab.accepts(llama, " " + ADD % "parameters")
    assert vocab.accepts(llama, "Sure.<|python_tag|>" + NOW % "parameters")
    assert vocab.accepts(llama, 'A JSON answer later: {"name": 1}')
    assert not vocab.accepts(llama, '{"name": 1}')  # at the start, it must be a call
    mistral = call_grammar(M, TOOLS, forced=False)
    assert vocab.accepts(mistral, "Plain words, [TOOL_ a near miss.")


def test_defs_of_several_tools_do_not_collide(vocab: Any) -> None:
    def with_defs(name: str, item: dict[str, Any]) -> dict[str, Any]:
        return fn(name, {"type": "object", "$defs": {"Item": item},
                         "properties": {"items": {"type": "array",
                                                  "items": {"$ref": "#/$defs/Item"}}},
                         "required": ["items"]})

    tools = [with_defs("ints", {"type": "integer"}), with_defs("strs", {"type": "string"})]
    gbnf = call_grammar(H, tools, forced=True)
    assert vocab.compiles(gbnf)
    ok = ['<tool_call>{"name": "ints", "arguments": {"items": [1, 2]}}</tool_call>',
          '<tool_call>{"name": "strs", "arguments": {"items": ["a"]}}</tool_call>']
    bad = ['<tool_call>{"name": "ints", "arguments": {"items": ["a"]}}</tool_call>',
           '<tool_call>{"name": "strs", "arguments": {"items": [1]}}</tool_call>']
    assert all(vocab.accepts(gbnf, t) for t in ok)
    assert not any(vocab.accepts(gbnf, t) for t in bad)


def test_definitions_and_nested_refs_are_rewritten(vocab: Any) -> None:
    tool = fn("t", {"type": "object", "definitions": {"P": {"type": "object", "properties": {
        "q": {"$ref": "#/definitions/Q"}}}, "Q": {"type": "boolean"}},
        "properties": {"p": {"$ref": "#/definitions/P"},
                       "r": {"$ref": "#/properties/p"}}})
    gbnf = call_grammar(H, [tool], forced=True)
    call = '<tool_call>{"name": "t", "arguments": %s}</tool_call>'
    assert vocab.accepts(gbnf, call % '{"p": {"q": true}, "r": {"q": false}}')
    assert not vocab.accepts(gbnf, call % '{"p": {"q": 1}}')


def test_numeric_bounds_are_enforced(vocab: Any) -> None:
    tools = [fn("n", {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 1, "maximum": 9},
        "y": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}}}})]
    gbnf = call_grammar(H, tools, forced=True)
    call = '<tool_call>{"name": "n", "arguments": %s}</tool_call>'
    assert vocab.accepts(gbnf, call % '{"x": 5, "y": [0.5, 3]}')
    assert not vocab.accepts(gbnf, call % '{"x": 50}')
    assert not vocab.accepts(gbnf, call % '{"x": 5, "y": [0]}')


def test_an_untyped_property_is_any_value(vocab: Any) -> None:
    """Claude Code's tools have a property with a description and no type: any JSON."""
    tools = [fn("script", {"type": "object", "properties": {
        "input": {"description": "Optional input value exposed to the script"}}})]
    gbnf = call_grammar(H, tools, forced=True)
    call = '<tool_call>{"name": "script", "arguments": {"input": %s}}</tool_call>'
    for value in ('1', '"text"', '[1, {"a": null}]', 'true', '{"k": [2.5]}'):
        assert vocab.accepts(gbnf, call % value), value
    assert not vocab.accepts(gbnf, call % "undefined")


def test_a_property_named_like_a_bound() -> None:
    call_grammar(H, [fn("range", {"type": "object", "properties": {
        "minimum": {"type": "integer"}, "maximum": {"type": "integer"}}})], forced=True)


def test_grammar_errors() -> None:
    with pytest.raises(InvalidRequestError, match="not in tools"):
        call_grammar(H, TOOLS, forced=True, name="missing")
    with pytest.raises(InvalidRequestError, match="tools is empty"):
        call_grammar(H, [], forced=False)


def test_objects_generate_only_the_properties_they_name(vocab: Any) -> None:
    # JSON Schema lets an object without additionalProperties hold any key; a sampled
    # model given that choice invents keys until max_tokens (a CI failure: `"type":
    # "number", "properties": ...` inside add's arguments). As llama.cpp's converter does,
    # only the named properties are generated; additionalProperties says otherwise.
    from everycycle.chatfmt.constraint import json_schema

    point = {"type": "object", "properties": {"x": {"type": "integer"},
                                              "tag": {"type": "object",
                                                      "properties": {"k": {"type": "string"}}}}}
    closed = json_schema(point)
    assert vocab.accepts(closed, '{"x": 1, "tag": {"k": "a"}}')
    assert not vocab.accepts(closed, '{"x": 1, "y": 2}')
    assert not vocab.accepts(closed, '{"x": 1, "tag": {"k": "a", "j": "b"}}')
    opened = json_schema({**point, "additionalProperties": True})
    assert vocab.accepts(opened, '{"x": 1, "y": 2}')
    call = call_grammar(G, [fn("move", point)], forced=True)
    assert vocab.accepts(call, '{"tool_calls": [{"name": "move", "arguments": {"x": 1}}]}')
    assert not vocab.accepts(
        call, '{"tool_calls": [{"name": "move", "arguments": {"x": 1, "type": "number"}}]}')


@pytest.mark.parametrize("schema,text", [
    # closing one branch of an intersection would refuse what the other allows
    ({"allOf": [{"properties": {"a": {"type": "integer"}}},
                {"properties": {"b": {"type": "integer"}}}]}, '{"a": 1, "b": 2}'),
    ({"$defs": {"base": {"properties": {"a": {"type": "integer"}}}},
      "$ref": "#/$defs/base", "properties": {"b": {"type": "integer"}}}, '{"a": 1, "b": 2}'),
    # under oneOf, narrower branches could seem disjoint where the written ones are not
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                 "required": ["a"]}, {"type": "string"}]}, '{"a": 1, "b": "x"}'),
])
def test_objects_are_left_open_where_closing_would_not_only_narrow(
        vocab: Any, schema: dict[str, Any], text: str) -> None:
    from everycycle.chatfmt.constraint import closed_objects, json_schema

    assert closed_objects(schema) == schema
    assert vocab.accepts(json_schema(schema), text)


def test_whitespace_is_llama_cpps_a_space_or_a_line_break_and_indent(vocab: Any) -> None:
    from everycycle.chatfmt.constraint import json_schema

    grammar = json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert vocab.accepts(grammar, '{"a":1}')
    assert vocab.accepts(grammar, '{\n  "a": 1\n}')
    assert vocab.accepts(grammar, '{\n\n\t"a" : 1 }')
    assert not vocab.accepts(grammar, '{\n\n\n"a": 1}')  # a run of blank lines
    assert not vocab.accepts(grammar, '{  "a": 1}')  # two spaces and no line break
