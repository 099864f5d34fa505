"""A tool list never refuses a turn: what the constraint engine cannot enforce is relaxed
where it stands (and named, with its JSON pointer), the rest still enforced, and the
call checked against the whole schema afterwards; ``strict`` tools and response_format
are refused naming the keyword and its place; a list has no fixed cap and compiles once.

The grammars are checked by the constraint engine itself on SmolLM2's vocabulary (as in
test_call_grammar.py); the daemon's side (the check after generation, its counter and
log line) runs through a real daemon and the `openai` client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemonhelp import daemon_process
from httphelp import fleet_http, openai_client
from tinymodel import write_tiny_gguf

from everycycle.chatfmt.callgrammar import CallGrammars, call_grammar
from everycycle.chatfmt.constraint import json_schema
from everycycle.chatfmt.schemacheck import ArgumentCheck, Relaxed, keywords, places
from everycycle.chatfmt.tools import ToolFormat
from everycycle.errors import InvalidRequestError

llamacheck = pytest.importorskip("llamacheck")

H, G = ToolFormat.HERMES, ToolFormat.GENERIC


def fn(name: str, parameters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters, **extra}}


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


@pytest.fixture(scope="module")
def vocab() -> Any:
    return llamacheck.smollm2()


UNENFORCEABLE = {
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                      "additionalProperties": {"type": "string"}},
    "not": {"type": "object", "properties": {"a": {"not": {"type": "null"}}}},
    "uniqueItems": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
    "if": {"type": "object", "properties": {"a": {"type": "string"}},
           "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "contains": {"type": "object", "properties": {"xs": {"type": "array",
                                                          "contains": {"const": 1}}}},
    "dependentSchemas": {"type": "object", "properties": {"a": {"type": "string"}},
                         "dependentSchemas": {"a": {"required": ["b"]}}},
    "oneOf": {"type": "object", "properties": {"v": {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}},
        {"type": "object", "properties": {"b": {"type": "string"}}}]}}},
}


@pytest.mark.parametrize("keyword", sorted(UNENFORCEABLE))
def test_a_keyword_the_engine_cannot_enforce_is_relaxed_and_named(vocab: Any,
                                                                  keyword: str) -> None:
    schema = UNENFORCEABLE[keyword]
    compiled = call_grammar(H, [fn("t", schema), fn("ok", {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]})], forced=True)
    [*found] = compiled.relaxed["t"]
    assert keyword in {r.keyword for r in found}, found
    assert "ok" not in compiled.relaxed  # the other tool is enforced whole
    assert vocab.accepts(compiled.grammar, call("ok", '{"n": 1}'))
    assert not vocab.accepts(compiled.grammar, call("ok", '{"n": "one"}'))
    assert vocab.compiles(compiled.grammar)
    # as a strict tool: refused, naming the tool, the keyword and its place
    with pytest.raises(InvalidRequestError) as info:
        call_grammar(H, [fn("t", schema, strict=True)], forced=True)
    message = info.value.message
    assert message.startswith("tool 't' (strict): ") and f"`{keyword}` (at #" in message
    assert "without `strict: true` the tool is served" in message


def test_the_place_is_a_json_pointer_and_data_is_not_a_keyword() -> None:
    schema = {"type": "object", "properties": {
        "not": {"type": "string", "enum": ["not", "uniqueItems"]},
        "a/b": {"type": "array", "uniqueItems": True, "default": {"uniqueItems": 1}},
        "deep": {"anyOf": [{"type": "null"}, {"type": "object", "propertyNames": {
            "maxLength": 3}}]}}}
    assert places(schema, {"uniqueItems", "not", "propertyNames"}) == [
        Relaxed("#/properties/a~1b", "uniqueItems"),
        Relaxed("#/properties/deep/anyOf/1", "propertyNames")]
    assert keywords(['Unimplemented keys: ["uniqueItems", "not"]',
                     "oneOf not fully supported, falling back to anyOf.",
                     "Unknown format: zip-code"]) == {"uniqueItems", "not", "oneOf",
                                                      "format:zip-code"}


def test_response_format_is_refused_with_the_keyword_and_its_place() -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(
            "json_schema: `uniqueItems` (at #/properties/tags) is not enforced by the "
            "constraint engine")):
        json_schema(UNENFORCEABLE["uniqueItems"])
    with pytest.raises(InvalidRequestError, match=re.escape(
            "json_schema: a `oneOf` (at #/properties/v) has branches the constraint engine "
            "cannot prove disjoint")):
        json_schema(UNENFORCEABLE["oneOf"])


def test_a_subschema_that_does_not_compile_is_relaxed_alone(vocab: Any) -> None:
    # Firecrawl's domain pattern with a maxLength: llguidance cannot decide whether the
    # intersection is empty; Netlify's empty enum: no value at all
    domain = {"type": "string", "maxLength": 253,
              "pattern": r"^(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z0-9][a-z0-9-]{0,61}"
                         r"[a-z0-9]$"}
    schema = {"type": "object", "properties": {"domains": {"type": "array", "items": domain},
                                               "kind": {"type": "string", "enum": []},
                                               "limit": {"type": "integer"}},
              "required": ["limit", "kind"]}
    compiled = call_grammar(H, [fn("search", schema)], forced=True)
    assert [r.pointer for r in compiled.relaxed["search"]] == [
        "#/properties/domains/items", "#/properties/kind"]
    g = compiled.grammar
    assert vocab.accepts(g, call("search", '{"domains": ["any at all"], "kind": "x", "limit": 3}'))
    assert not vocab.accepts(g, call("search", '{"kind": 1, "limit": "three"}'))  # enforced
    assert not vocab.accepts(g, call("search", '{"kind": 1}'))  # required, too


def test_arguments_are_checked_against_the_whole_schema() -> None:
    compiled = call_grammar(H, [fn("t", UNENFORCEABLE["uniqueItems"]),
                                fn("plain", {"type": "object"})], forced=True)
    check = compiled.check
    assert check.problem("t", '{"tags": ["a", "b"]}') is None
    problem = check.problem("t", '{"tags": ["a", "a"]}')
    assert problem is not None and "(at #/tags, by `uniqueItems`)" in problem
    assert check.problem("plain", '{"anything": 1}') is None  # (enforced whole)
    assert ArgumentCheck({"x": {"type": "object"}}).problem("x", "[1") is not None


def test_a_megabyte_list_has_no_cap_and_compiles_once() -> None:
    tools = [fn(f"tool_{i}", {"type": "object", "properties": {
        f"p{j}": {"type": "string", "description": "x" * 60, "enum": [f"v{k}" for k in
                                                                   range(6)]}
        for j in range(30)}}) for i in range(300)]
    text = json.dumps(tools)
    assert len(text) > 1_000_000
    kept = CallGrammars()
    first = kept.get(G, text, forced=False, name=None, parallel=True)
    again = kept.get(G, text, forced=False, name=None, parallel=True)
    assert again is first and kept.compiled == 1 and kept.hits == 1  # (compiled once)
    # bounded by bytes: another list pushes it out
    small = CallGrammars(max_bytes=len(text) + len(first.grammar) + 10)
    small.get(G, text, forced=False, name=None, parallel=True)
    small.get(G, json.dumps(tools[:1]), forced=False, name=None, parallel=True)
    small.get(G, text, forced=False, name=None, parallel=True)
    assert small.compiled == 3


def test_a_list_past_the_compile_budget_names_it_and_the_largest_tool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from everycycle.chatfmt import constraint

    tools = [fn(f"t{i}", {"type": "object", "properties": {f"p{j}": {"type": "string",
                                                                      "pattern": "[a-z]{1,9}"}
                                                          for j in range(i + 2)}})
             for i in range(40)]
    monkeypatch.setattr(constraint, "LEXER_FUEL", 5_000)
    monkeypatch.setattr(constraint, "FUEL_PER_CHAR", 0)
    constraint._limits.cache_clear()
    try:
        with pytest.raises(InvalidRequestError, match=r"tools: the list is past the constraint "
                           r"engine's compile budget \(5,000 lexer fuel for [0-9,]+ characters of grammar: "
                           r"initial lexer configuration \(grammar\) too big \(limit for this "
                           r"grammar: 5000\)\), though each tool compiles alone; the largest "
                           r"is 't39' \(2,156 bytes of schema\)$"):
            call_grammar(G, tools, forced=False)
    finally:
        constraint._limits.cache_clear()


# -- through the daemon ----------------------------------------------------------------


@pytest.fixture
def hermes(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A daemon serving a tiny model with Qwen2.5's (Hermes) template: its URL, and the
    file its stderr (the log) goes to."""
    from templatehelp import fixture_source

    model = write_tiny_gguf(tmp_path / "hermes.gguf",
                            chat_template=fixture_source("qwen2.5-instruct"))
    models = tmp_path / "models.toml"
    models.write_text(f'[models.hermes]\npath = "{model}"\ncontext = 2048\nparallel = 1\n')
    log = tmp_path / "daemon.log"
    with daemon_process("--models", str(models), "--http", "127.0.0.1:0", stderr=log):
        yield fleet_http(), log


def test_a_call_that_breaks_the_relaxed_part_is_returned_counted_and_logged(
        hermes: tuple[str, Path]) -> None:
    url, log = hermes
    # every value the grammar can write ({"a": 1}) breaks the `not`, which it relaxes
    tool = fn("never", {"type": "object", "properties": {"a": {"const": 1}},
                        "required": ["a"], "additionalProperties": False,
                        "not": {"required": ["a"]}})
    with openai_client(url, "unused") as client:
        r = client.chat.completions.create(
            model="hermes", messages=[{"role": "user", "content": "go"}], tools=[tool],  # type: ignore[list-item]
            tool_choice="required", max_tokens=300, temperature=0)
        with pytest.raises(openai.BadRequestError, match=re.escape(
                "tool 'never' (strict): `not` (at #) is not enforced")):
            client.chat.completions.create(
                model="hermes", messages=[{"role": "user", "content": "go"}],
                tools=[{**tool, "function": {**tool["function"], "strict": True}}],  # type: ignore[list-item]
                max_tokens=4)
    [made] = r.choices[0].message.tool_calls or []
    assert made.function.name == "never" and json.loads(made.function.arguments) == {"a": 1}
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as m:
        metrics = m.read().decode()
    assert re.search(r'everycycle_tool_calls_total\{model="hermes",outcome="invalid"\} 1\.0',
                     metrics), metrics
    text = log.read_text()
    assert "tools: not enforced while generating, checked after: 'never': `not` at #" in text
    assert re.search(r"request \S+: a call of 'never': .* \(at #, by `not`\); returned as "
                     "the model wrote it", text), text
