"""The wire protocol: golden lines, round trips, and a malformed corpus. No sockets."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from everycycle import protocol as p
from everycycle.errors import ErrorKind, LineTooLongError, ProtocolError
from everycycle.protocol import codec

GOLDEN = Path(__file__).parent / "data" / "events.golden.jsonl"
GOLDEN_LINES = GOLDEN.read_bytes().splitlines(keepends=True)


def test_golden_file_is_not_empty() -> None:
    assert len(GOLDEN_LINES) >= 10


@pytest.mark.parametrize("line", GOLDEN_LINES, ids=lambda b: b[:40].decode())
def test_golden_lines_round_trip_byte_for_byte(line: bytes) -> None:
    event = p.decode_event(line)
    assert p.encode(event) == line


def test_golden_values_decode_to_the_expected_objects() -> None:
    events = [p.decode_event(line) for line in GOLDEN_LINES]
    assert events[0] == p.Accepted("r-1", 0)
    assert events[3] == p.Tokens("r-1", p.TokenChunk(" wörld ✓", (2134, 1202, 99)), False)
    fleet = events[5]
    assert isinstance(fleet, p.FleetDescription)
    assert fleet.snapshot.loaded_models[1].revision is None
    assert fleet.snapshot.executors[0] == p.ExecutorSummary("cuda", "NVIDIA", 2)
    assert [e.kind for e in events[6:] if isinstance(e, p.Error)] == list(ErrorKind)


# ----------------------------------------------------------------- hypothesis round trips

rid = st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True)
text = st.text()
name = st.text(
    alphabet=st.characters(min_codepoint=0x20, exclude_characters="\x7f", exclude_categories=["Cs"]),
    min_size=1,
    max_size=40,
)
u32 = st.integers(0, 2**32 - 1)
token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=8).map(tuple)
chunks = st.builds(p.TokenChunk, text, token_ids)
memory = st.none() | st.integers(0, 2**63 - 1)
executors = st.builds(p.ExecutorSummary, name, name, u32, memory, memory)
opt_u32 = st.none() | u32
loaded = st.builds(p.LoadedModel, name, st.none() | name, name, opt_u32, opt_u32, opt_u32)
snapshots = st.builds(
    p.FleetSnapshot,
    name,
    st.lists(executors, max_size=3).map(tuple),
    st.lists(loaded, max_size=3).map(tuple),
    u32,
)
events = st.one_of(
    st.builds(p.Accepted, rid, u32),
    st.builds(p.Tokens, rid, chunks, st.booleans()),
    st.builds(p.FleetDescription, snapshots),
    st.builds(p.Error, st.just("") | rid, st.sampled_from(ErrorKind), text),
    st.builds(p.Done, rid),
)


def opt(s: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.none() | s


unit = st.floats(0.0, 1.0)
generates = st.builds(
    p.Generate,
    request_id=rid,
    model=name,
    prompt=text,
    max_tokens=opt(st.integers(1, p.MAX_TOKENS_LIMIT)),
    temperature=opt(st.floats(0.0, 100.0)),
    top_p=opt(unit),
    top_k=opt(st.integers(0, 1_000_000)),
    min_p=opt(unit),
    repeat_penalty=opt(st.floats(0.01, 10.0)),
    seed=opt(st.integers(0, 2**32 - 2)),
    stop=opt(st.lists(st.text(min_size=1, max_size=10), max_size=4).map(tuple)),
    format=opt(st.sampled_from(p.Format)),
    auto_load=opt(st.booleans()),
    deadline_ms=opt(st.integers(1, 604_800_000)),
)
messages = st.lists(st.builds(p.Message, st.sampled_from(p.Role), text), min_size=1,
                    max_size=4).map(tuple)
conversations = st.builds(
    p.Generate, request_id=rid, model=name, messages=messages,
    max_tokens=opt(st.integers(1, p.MAX_TOKENS_LIMIT)), temperature=opt(st.floats(0.0, 100.0)),
    format=opt(st.just(p.Format.CHAT)),
)
requests = st.one_of(
    generates,
    conversations,
    st.builds(p.DescribeFleet, rid),
    st.builds(p.Cancel, rid, rid),
    st.builds(p.Load, rid, name, st.none() | name),
    st.builds(p.Unload, rid, name),
    st.builds(p.Shutdown, rid),
    st.builds(p.Auth, text),
)


@given(events)
def test_events_round_trip(event: p.ServerEvent) -> None:
    line = p.encode(event)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert p.decode_event(line) == event


@given(requests)
def test_requests_round_trip(request: p.Request) -> None:
    line = p.encode(request)
    assert line.count(b"\n") == 1
    assert p.decode_request(line) == request


def test_optional_fields_encode_as_null_and_may_be_absent() -> None:
    line = p.encode(p.Generate("a", "m", "hi"))
    assert b'"max_tokens":null' in line
    assert p.decode_request(b'{"Generate":{"request_id":"a","model":"m","prompt":"hi"}}') == (
        p.Generate("a", "m", "hi")
    )


def test_extension_fields_are_omitted_when_unset() -> None:
    snap = p.FleetSnapshot("h", (p.ExecutorSummary("cpu", "AMD", 1),), (), 0)
    assert p.encode(p.FleetDescription(snap)) == (
        b'{"FleetDescription":{"hostname":"h","executors":'
        b'[{"name":"cpu","vendor":"AMD","device_count":1}],"loaded_models":[],"active_requests":0}}\n'
    )
    full = p.ExecutorSummary("cpu", "AMD", 1, memory_total=10, memory_free=5)
    snap = p.FleetSnapshot("h", (full,), (), 0)
    assert b'"memory_total":10,"memory_free":5' in p.encode(p.FleetDescription(snap))


def test_unknown_fields_are_ignored_as_serde_does() -> None:
    req = p.decode_request(b'{"Shutdown":{"request_id":"x","extra":[1,{"a":2}]}}')
    assert req == p.Shutdown("x")


def test_integers_are_accepted_for_float_fields() -> None:
    req = p.decode_request(
        b'{"Generate":{"request_id":"a","model":"m","prompt":"","temperature":1}}'
    )
    assert isinstance(req, p.Generate) and req.temperature == 1.0
    assert b'"temperature":1.0' in p.encode(req)


def test_control_characters_are_escaped_like_serde_json() -> None:
    line = p.encode(p.Tokens("a", p.TokenChunk('\x00\x1f\n\t"\\\x7fé', ()), False))
    assert b'"\\u0000\\u001f\\n\\t\\"\\\\\x7f\xc3\xa9"' in line


# ----------------------------------------------------------------- malformed corpus

MALFORMED: list[tuple[bytes, str]] = [
    (b"", ""),
    (b"   ", ""),
    (b"not json", ""),
    (b"\xff\xfe", ""),
    (b'"Shutdown"', ""),
    (b"[]", ""),
    (b"null", ""),
    (b"{}", ""),
    (b'{"Shutdown":{"request_id":"a"},"Cancel":{}}', ""),
    (b'{"Nope":{"request_id":"a"}}', "a"),
    (b'{"Shutdown":null}', ""),
    (b'{"Shutdown":[]}', ""),
    (b'{"Shutdown":{}}', ""),
    (b'{"Shutdown":{"request_id":""}}', ""),
    (b'{"Shutdown":{"request_id":"has space"}}', ""),
    (b'{"Shutdown":{"request_id":"' + b"x" * 65 + b'"}}', ""),
    (b'{"Shutdown":{"request_id":5}}', ""),
    (b'{"Generate":{"request_id":"g","model":"m"}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":7}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"","prompt":""}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m\\u0000","prompt":""}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","max_tokens":0}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","max_tokens":40000}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","max_tokens":1.5}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","max_tokens":true}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","max_tokens":1e400}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","temperature":NaN}}', ""),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","temperature":-1}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","temperature":1e999}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","top_p":2}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","seed":-1}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","seed":99999999999999999999}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","stop":"x"}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","stop":[""]}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","stop":[1]}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","format":"yaml"}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","deadline_ms":0}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"\\ud800"}}', "g"),
    (b'{"Generate":{"request_id":"g","model":"m","prompt":"","prompt":"x"}}', ""),
    (b'{"Cancel":{"request_id":"c","target":"bad id"}}', "c"),
    (b'{"Load":{"request_id":"l","model":"m","executor":3}}', "l"),
    (b"[" * 100_000 + b"]" * 100_000, ""),
    (b'{"Shutdown":{"request_id":"a"}} trailing', ""),
]


@pytest.mark.parametrize(("line", "rid"), MALFORMED, ids=lambda v: repr(v)[:50])
def test_malformed_lines_raise_the_typed_error(line: bytes, rid: str) -> None:
    with pytest.raises(ProtocolError) as info:
        p.decode_request(line)
    assert info.value.kind is ErrorKind.INVALID
    assert info.value.request_id == rid
    assert info.value.message


@pytest.mark.parametrize(
    "make",
    [
        lambda: p.Load("a", "\ud800"),
        lambda: p.Generate("a", "m", "x\udfff"),
        lambda: p.Tokens("a", p.TokenChunk("\ud800", ()), False),
        lambda: p.Auth("\ud800"),
        lambda: p.Generate("a", "m", "", stop=("ok", "\ud800")),
    ],
)
def test_a_message_with_a_lone_surrogate_cannot_be_built(make: object) -> None:
    with pytest.raises(ProtocolError, match="not valid Unicode"):
        make()  # type: ignore[operator]


def test_error_messages_match_the_seed_wording() -> None:
    with pytest.raises(ProtocolError, match="max_tokens must be between 1 and 32768"):
        p.Generate("a", "m", "", max_tokens=0)


SAID = (p.Message(p.Role.USER, "hi"),)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: p.ToolCall("c", "f", "{"), "tool call arguments are not JSON: "),
        (lambda: p.ToolCall("c", "f", "[1]"), "tool call arguments must be a JSON object"),
        (lambda: p.Generate("a", "m", "", json_schema="[]"),
         "`json_schema` must be a JSON object"),
        (lambda: p.Generate("a", "m", "", json_schema="{x"), "`json_schema` is not JSON: "),
        (lambda: p.Generate("a", "m", messages=SAID, tools="[]"),
         "`tools` must be a non-empty JSON array"),
        (lambda: p.Generate("a", "m", messages=SAID, tools="{}"),
         "`tools` must be a non-empty JSON array"),
        (lambda: p.Generate("a", "m", messages=SAID, tools="nope"), "`tools` is not JSON: "),
    ],
)
def test_json_text_fields_say_what_is_wrong(make: object, says: str) -> None:
    with pytest.raises(ProtocolError) as info:
        make()  # type: ignore[operator]
    assert info.value.message.startswith(says), info.value.message


@given(st.binary(max_size=300))
def test_arbitrary_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    try:
        request = p.decode_request(data)
    except ProtocolError as exc:
        assert exc.kind is ErrorKind.INVALID and exc.message
    else:  # whatever decodes is a valid message that encodes back to the same value
        assert p.decode_request(p.encode(request)) == request


def _containers(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(children) | st.dictionaries(st.text(), children)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    _containers,
    max_leaves=20,
)


@given(st.sampled_from(sorted(["Generate", "Cancel", "Load", "Unload", "Shutdown", "X"])), json_values)
def test_wrong_shapes_only_ever_raise_protocol_error(tag: str, payload: object) -> None:
    line = json.dumps({tag: payload}).encode()
    try:
        request = p.decode_request(line)
    except ProtocolError as exc:
        assert exc.kind is ErrorKind.INVALID and exc.message
    else:
        assert type(request).__name__ == tag
        assert p.decode_request(p.encode(request)) == request


# ----------------------------------------------------------------- framing


def test_framer_splits_lines_across_feeds() -> None:
    f = p.LineFramer()
    assert list(f.feed(b'{"a":1}\n{"b"')) == [b'{"a":1}']
    assert list(f.feed(b":2}\n\n")) == [b'{"b":2}', b""]
    assert f.pending == 0


def test_framer_rejects_an_overlong_line_even_without_newline() -> None:
    f = p.LineFramer(max_line=10)
    assert list(f.feed(b"0123456789\n")) == [b"0123456789"]
    with pytest.raises(LineTooLongError):
        list(f.feed(b"0123456789A"))


def test_decoder_rejects_overlong_line() -> None:
    with pytest.raises(LineTooLongError):
        p.decode_request(b"x" * (p.MAX_LINE_BYTES + 1))


def test_is_terminal() -> None:
    assert not p.is_terminal(p.Accepted("a", 0))
    assert not p.is_terminal(p.Tokens("a", p.TokenChunk("", ()), False))
    assert p.is_terminal(p.Tokens("a", p.TokenChunk("", ()), True))
    assert p.is_terminal(p.Done("a"))
    assert p.is_terminal(p.Error("a", ErrorKind.INTERNAL, "x"))


def test_a_seed_generate_line_is_unchanged_by_the_messages_extension() -> None:
    line = p.encode(p.Generate("a", "m", "hi"))
    assert b'"prompt":"hi"' in line and b"messages" not in line
    convo = p.encode(p.Generate("a", "m", messages=(p.Message(p.Role.USER, "hi"),)))
    assert b'"prompt"' not in convo
    assert b'"messages":[{"role":"user","content":"hi"}]' in convo


def test_messages_with_a_lone_surrogate_cannot_be_built() -> None:
    with pytest.raises(ProtocolError, match="not valid Unicode"):
        p.Message(p.Role.USER, "\ud800")


# ----------------------------------------------------------------- the one codec
# Encoders and decoders are compiled per type. What they make of each golden line, and
# of every variant of it with one field (at any depth) replaced by an odd value or
# dropped, is recorded in tests/data/decode_cases.jsonl.gz: the exact object (as its
# line) or the exact error. The record was made by the generic decoder this codec
# replaced, so the two accept the same lines and raise the same errors.

CASES = Path(__file__).parent / "data" / "decode_cases.jsonl.gz"


def test_every_recorded_case_decodes_or_fails_as_recorded() -> None:
    with gzip.open(CASES, "rt") as f:
        cases = [json.loads(raw) for raw in f]
    assert len(cases) > 1500
    for case in cases:
        decode = p.decode_event if case["event"] else p.decode_request
        try:
            got = {"ok": p.encode(decode(case["line"])).decode()}
        except ProtocolError as exc:
            got = {"error": exc.message, "request_id": exc.request_id}
        assert got == {k: case[k] for k in ("ok", "error", "request_id") if k in case}, case


@given(st.builds(p.Tokens, rid, chunks, st.booleans()))
def test_tokens_encode_as_the_standard_json_encoder_writes_them(event: p.Tokens) -> None:
    body = {"Tokens": {"request_id": event.request_id,
                       "chunk": {"text": event.chunk.text, "ids": list(event.chunk.ids)},
                       "finished": event.finished}}
    want = json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n"
    assert p.encode(event) == want.encode()


ODD_VALUES = [None, True, 0, -1, 1.5, 2**40, "", "x", "\ud800", "é", [], [1, "a"], [True],
              ["\ud800"], {}, {"a": 1}]


def _variants(value: object) -> list[object]:
    """``value`` with each field (at any depth) replaced by each odd value, or dropped."""
    out: list[object] = []
    if isinstance(value, dict):
        for key in value:
            for odd in ODD_VALUES:
                out.append({**value, key: odd})
            out.append({k: v for k, v in value.items() if k != key})
            out.extend({**value, key: inner} for inner in _variants(value[key]))
    elif isinstance(value, list) and value:
        out.extend([inner, *value[1:]] for inner in _variants(value[0]))
    return out


@given(requests)
def test_odd_requests_decode_to_valid_requests_or_protocol_errors(request: p.Request) -> None:
    line = p.encode(request)
    ((tag, payload),) = json.loads(line).items()
    for case in [payload, *_variants(payload)][:60]:
        try:
            decoded = p.decode_request(json.dumps({tag: case}))
        except ProtocolError as exc:
            assert exc.message
            continue
        assert p.decode_request(p.encode(decoded)) == decoded


def test_duplicate_fields_are_refused_naming_the_first_repeated_one() -> None:
    with pytest.raises(ProtocolError, match="duplicate field `b`"):
        p.decode_event(b'{"Done":{"request_id":"r","b":1,"c":2,"b":3,"c":4}}')


def test_an_absent_option_without_a_default_decodes_as_none() -> None:
    line = (b'{"FleetDescription":{"hostname":"h","executors":[],"loaded_models":[{"name":"m",'
            b'"assigned_executor":"cpu"}],"active_requests":0}}')
    event = p.decode_event(line)
    assert isinstance(event, p.FleetDescription)
    assert event.snapshot.loaded_models[0].revision is None


_TOKEN_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)


@given(rid=st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True), text=_TOKEN_TEXT,
       ids=st.lists(st.integers(0, 2**31 - 1), max_size=4), finished=st.booleans())
def test_the_per_token_line_decodes_as_the_general_decoder_does(
        rid: str, text: str, ids: list[int], finished: bool) -> None:
    event = p.Tokens(rid, p.TokenChunk(text, tuple(ids)), finished)
    line = p.encode(event)
    assert p.decode_event(line) == event
    assert codec._plain_tokens(line) == event  # (the short way takes what encode writes)
    # The same event written another way (spaces, \u escapes, a field twice) is not
    # what the short way takes: the general decoder reads it, or refuses it, as before.
    spaced = json.dumps(json.loads(line), ensure_ascii=True).encode()
    assert codec._plain_tokens(spaced) is None
    assert p.decode_event(spaced) == event
    twice = line.replace(b'"finished":', b'"finished":true,"finished":', 1)
    with pytest.raises(ProtocolError, match="duplicate field `finished`"):
        p.decode_event(twice)


@pytest.mark.parametrize("line, message", [
    (b'{"Tokens":{"request_id":"r","chunk":{"text":"a","ids":[1]},"finished":false}} x',
     "not JSON"),
    (b'{"Tokens":{"request_id":"r","chunk":{"text":"a","ids":[-1]},"finished":false}}',
     "token id"),
    (b'{"Tokens":{"request_id":"r","chunk":{"text":"a","ids":[1.0]},"finished":false}}',
     "expected an integer"),
    (b'{"Tokens":{"request_id":"r r","chunk":{"text":"a","ids":[1]},"finished":false}}',
     "request_id"),
    (b'{"Tokens":{"request_id":"r","chunk":{"text":"a","ids":[1]},"finished":0}}',
     "expected a boolean"),
])
def test_a_bad_per_token_line_is_refused_as_any_line_is(line: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        p.decode_event(line)


def test_a_per_token_line_with_a_field_from_a_newer_daemon_still_decodes() -> None:
    line = b'{"Tokens":{"request_id":"r","chunk":{"text":"a","ids":[1],"x":1},"finished":false}}'
    assert p.decode_event(line) == p.Tokens("r", p.TokenChunk("a", (1,)), False)
