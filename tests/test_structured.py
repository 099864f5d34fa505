"""Structured output: JSON Schema and GBNF through llama.cpp's grammar sampler, on the
real daemon with real llama.cpp."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, Raw, running_daemon
from httphelp import openai_client

from everycycle.client import SyncClient, connect
from everycycle.errors import ErrorKind
from everycycle.protocol import Error, Generate, Tokens, encode

pytestmark = pytest.mark.anyio

# No free-form strings: the tiny model's byte-level tokens can form invalid UTF-8, which
# llama.cpp's grammar counts byte by byte (see the closing note of the structured-output work).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "color", "size", "owner"],
    "additionalProperties": False,
}

ARITHMETIC = r'''
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9] | [1-9] [0-9] | "(" expr ")"
'''
ARITHMETIC_RE = re.compile(r"[0-9()+\-*/]+")


def balanced_expression(text: str) -> bool:
    """The same little language, checked by hand: digits, operators, balanced parens."""
    if not ARITHMETIC_RE.fullmatch(text):
        return False
    try:
        compile(text, "<expr>", "eval")
    except SyntaxError:
        return False
    return not re.search(r"(^|[^0-9])0[0-9]", text)


async def test_fifty_sampled_generations_validate_against_the_schema(models_file: Path) -> None:
    schema = json.dumps(SCHEMA)
    async with running_daemon(models_file) as daemon, connect() as client:
        texts = []
        for seed in range(50):
            events = [e async for e in client.generate(
                "tiny4", "Describe a thing as JSON:", json_schema=schema, temperature=1.0,
                seed=seed, max_tokens=400)]
            end = events[-1]
            assert isinstance(end, Tokens) and end.finished, end
            texts.append("".join(e.chunk.text for e in events if isinstance(e, Tokens)))
        assert daemon.supervisor.snapshot().active_requests == 0
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one fixed answer


async def test_a_gbnf_grammar_is_always_obeyed_greedy_and_sampled(models_file: Path) -> None:
    async with running_daemon(models_file), connect() as client:
        outputs = []
        for seed in range(20):
            events = [e async for e in client.generate(
                "tiny4", "x", grammar=ARITHMETIC, temperature=1.0 if seed else 0.0, seed=seed,
                max_tokens=60)]
            outputs.append((events[-1], "".join(
                e.chunk.text for e in events if isinstance(e, Tokens))))
    for end, text in outputs:
        assert isinstance(end, Tokens)
        if end.chunk.ids and len(text) < 60:  # ended by the grammar, not by max_tokens
            assert balanced_expression(text), text
        assert ARITHMETIC_RE.fullmatch(text), text


async def test_constrained_and_free_slots_share_a_batch(models_file: Path,
                                                       tiny_batches_exact: bool) -> None:
    async with running_daemon(models_file), connect() as client:
        alone = [e async for e in client.generate("tiny4", "free one", max_tokens=30,
                                                  temperature=0.0)]

        async def run(**kw: object) -> str:
            return "".join([e.chunk.text async for e in client.generate(  # type: ignore[union-attr]
                "tiny4", "free one" if "grammar" not in kw else "x", max_tokens=30,
                temperature=0.0, **kw) if isinstance(e, Tokens)])

        import anyio

        results: dict[str, str] = {}
        async with anyio.create_task_group() as tg:
            for i in range(2):
                async def constrained(i: int = i) -> None:
                    results[f"c{i}"] = await run(grammar=ARITHMETIC)

                async def free(i: int = i) -> None:
                    results[f"f{i}"] = await run()

                tg.start_soon(constrained)
                tg.start_soon(free)
    expected = "".join(e.chunk.text for e in alone if isinstance(e, Tokens))
    assert results["f0"] and results["f1"]
    if tiny_batches_exact:  # the engine's probe: batched rows are bit-exact on this CPU
        assert results["f0"] == results["f1"] == expected
    assert ARITHMETIC_RE.fullmatch(results["c0"]) and results["c0"] == results["c1"]


@pytest.mark.parametrize("field,value,match", [
    ("grammar", "root ::= foo", "grammar: Rule 'foo' not found"),
    ("grammar", 'root ::= "a" | [b-', "grammar: Unexpected end of input at line 1"),
    ("json_schema", '{"type": "strang"}', "json_schema: Invalid type: strang"),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/definitions/x"}}}',
     "json_schema: Pointer '/definitions/x' does not exist"),
    ("json_schema", '{"type": "array", "uniqueItems": true}',
     "json_schema: `uniqueItems` (at #) is not enforced by the constraint engine"),
    ("json_schema", ('{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, '
                    '"$ref": "#/$defs/a"}'), "grammar: it matches no text at all"),
])
async def test_broken_schemas_and_grammars_are_invalid_before_queueing(
    models_file: Path, field: str, value: str, match: str
) -> None:
    async with running_daemon(models_file) as daemon, Raw.open() as c:
        # (resident first: a request for a model still loading has its Accepted at once)
        await c.send(encode(Generate("warm", "tiny", "x", max_tokens=1)))
        await c.until_terminal("warm")
        await c.send(encode(Generate("b", "tiny", "x", **{field: value})))  # type: ignore[arg-type]
        events = await c.until_terminal("b")
        assert len(events) == 1  # no Accepted: refused before anything was queued
        assert isinstance(events[0], Error) and events[0].kind is ErrorKind.INVALID
        assert match in events[0].message, events[0].message
        assert daemon.supervisor.snapshot().active_requests == 0


async def test_a_schema_that_is_not_json_is_refused_by_the_protocol(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(b'{"Generate":{"request_id":"j","model":"tiny","prompt":"x",'
                     b'"json_schema":"{nope"}}')
        ev = await c.next()
        assert isinstance(ev, Error) and "json_schema` is not JSON" in ev.message


def test_run_with_a_schema_file_and_a_grammar_file(models_file: Path, tmp_path: Path) -> None:
    import subprocess

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    out = subprocess.run([*EC, "run", "--no-daemon", "--models", str(models_file), "-m",
                          "tiny4", "--json-schema", str(schema), "-n", "400", "x"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), SCHEMA)
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= foo\n")
    out = subprocess.run([*EC, "run", "--no-daemon", "--models", str(models_file), "--grammar",
                          str(bad), "x"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 2 and "grammar: Rule 'foo' not found" in out.stderr
    assert out.stderr.count("\n") == 1, out.stderr  # one line, no traceback


def test_response_format_over_http(
    request: pytest.FixtureRequest, spawn_daemon: SpawnDaemon,
) -> None:
    spawn_daemon("--http", "127.0.0.1:0")
    with SyncClient() as c:
        url = c.describe_fleet().http
    client = openai_client(url, "x")
    request.addfinalizer(client.close)
    r = client.chat.completions.create(
        model="tiny4", messages=[{"role": "user", "content": "a thing"}], max_tokens=400,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "thing", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
    r = client.chat.completions.create(
        model="tiny4", messages=[{"role": "user", "content": "an object"}], max_tokens=300,
        temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    with pytest.raises(openai.BadRequestError, match="Invalid type: strang"):
        client.chat.completions.create(
            model="tiny4", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "strang"}}})
