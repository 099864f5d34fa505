"""everycycle.chatfmt.reasoning: markers from templates, prompts that open thinking, streamed splits."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from templatehelp import fixture_source

from everycycle.chatfmt import reasoning as rs
from everycycle.chatfmt.reasoning import ReasoningFormat, ReasoningSplitter, split
from everycycle.chatfmt.template import ChatTemplate
from everycycle.chatfmt.toolparse import parse
from everycycle.chatfmt.tools import ToolFormat

THINK, THINKING, MAGISTRAL = (ReasoningFormat.THINK, ReasoningFormat.THINKING,
                              ReasoningFormat.MAGISTRAL)


def streamed(fmt: ReasoningFormat, pieces: list[str], inside: bool) -> tuple[str, str]:
    s = ReasoningSplitter(fmt, starts_inside=inside)
    got = [s.feed(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in got), "".join(a for _, a in got)


@pytest.mark.parametrize(("name", "fmt"), [
    ("qwen3", THINK), ("deepseek-r1-distill", THINK), ("ministral-3-reasoning", MAGISTRAL),
    ("qwen2.5-instruct", None), ("llama-3.1-instruct", None), ("gemma-3-it", None),
])
def test_detect(name: str, fmt: ReasoningFormat | None) -> None:
    assert rs.detect(fixture_source(name)) is fmt


def test_detect_inline() -> None:
    assert rs.detect("{{ '<thinking>' }}") is THINKING
    assert rs.detect(None) is None
    assert rs.detect("{{ '</think>' }}") is THINK


def test_starts_inside_from_rendered_prompts() -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    r1 = ChatTemplate.compile(fixture_source("deepseek-r1-distill"), bos_token="<s>",
                              eos_token="</s>")
    assert rs.starts_inside(r1.render(msgs))
    assert rs.starts_inside(r1.render(msgs), THINK)
    assert not rs.starts_inside(r1.render(msgs), MAGISTRAL)
    qwen3 = ChatTemplate.compile(fixture_source("qwen3"), bos_token="", eos_token="")
    assert not rs.starts_inside(qwen3.render(msgs))
    assert not rs.starts_inside(qwen3.render(msgs, enable_thinking=False))
    assert rs.starts_inside("[INST]x[/INST][THINK]")


def test_accepts_enable_thinking() -> None:
    assert rs.accepts_enable_thinking(fixture_source("qwen3"))
    assert not rs.accepts_enable_thinking(fixture_source("deepseek-r1-distill"))
    assert not rs.accepts_enable_thinking(fixture_source("qwen2.5-instruct"))
    assert rs.accepts_enable_thinking("{% if enable_thinking %}")  # (broken: by its text)
    assert not rs.accepts_enable_thinking("{% set enable_thinking = true %}{{ enable_thinking }}")


# (format, starts inside, output, reasoning, answer)
CASES = [
    (THINK, False, "<think>\nLet me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (THINK, True, "Let me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (THINK, True, "<think>\nagain\n</think>answer", "again", "answer"),
    (THINK, False, "  plain answer\n", "", "  plain answer\n"),
    (THINK, False, "<think>cut short  ", "cut short", ""),
    (THINK, True, "all thinking <", "all thinking <", ""),
    (THINK, False, "<think>\n\n</think>\n\nNo thought.", "", "No thought."),
    (THINK, False, "<th", "", "<th"),
    (THINK, False, "<thinking>x</thinking>", "", "<thinking>x</thinking>"),
    (THINK, False, "<think>a</think>b</think>c", "a", "b</think>c"),
    (THINK, False, "Answer first <think>no</think>", "", "Answer first <think>no</think>"),
    (THINKING, False, "<thinking>\nhm\n</thinking>\nyes", "hm", "yes"),
    (MAGISTRAL, False, "[THINK]Draft: 2+2[/THINK]Four.", "Draft: 2+2", "Four."),
    (MAGISTRAL, False, "[THINK]keep [/THIN] in [/THINK] out", "keep [/THIN] in", "out"),
    (THINK, True, "", "", ""),
]


@pytest.mark.parametrize(("fmt", "inside", "text", "reasoning", "answer"), CASES)
def test_split(fmt: ReasoningFormat, inside: bool, text: str, reasoning: str,
               answer: str) -> None:
    assert split(text, fmt, starts_inside=inside) == (reasoning, answer)


@pytest.mark.parametrize(("fmt", "inside", "text"), [c[:3] for c in CASES])
def test_streaming_matches_whole(fmt: ReasoningFormat, inside: bool, text: str) -> None:
    expected = split(text, fmt, starts_inside=inside)
    assert streamed(fmt, list(text), inside) == expected
    for i in range(len(text) + 1):
        assert streamed(fmt, [text[:i], text[i:]], inside) == expected
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        pieces = [text[i:j] for i, j in itertools.pairwise([0, *cuts, len(text)])]
        assert streamed(fmt, pieces, inside) == expected


def test_partial_markers_are_held_back() -> None:
    s = ReasoningSplitter(THINK)
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>\nstep one") == ("step one", "")
    assert s.feed("\n</th") == ("", "")
    assert s.feed("ink>\n\nDone") == ("", "Done")
    assert s.feed(" now.\n") == ("", " now.\n")
    assert s.finish() == ("", "")
    t = ReasoningSplitter(THINK, starts_inside=True)
    assert t.feed("a </b") == ("a </b", "")
    assert t.feed(" </th") == ("", "")
    assert t.feed("x> c") == (" </thx> c", "")


def test_feed_after_finish_is_an_error() -> None:
    s = ReasoningSplitter(THINK)
    s.finish()
    assert s.finish() == ("", "")
    with pytest.raises(ValueError):
        s.feed("x")


BITS = ["<think>", "</think>", "<th", "</", "ink>", "\n", " ", "a", "b", "<", ">"]


@settings(max_examples=200, deadline=None)
@given(bits=st.lists(st.sampled_from(BITS), max_size=12), inside=st.booleans(),
       cuts=st.lists(st.integers(0, 60), max_size=5))
def test_any_split_gives_the_whole_result(bits: list[str], inside: bool,
                                          cuts: list[int]) -> None:
    text = "".join(bits)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[i:j] for i, j in itertools.pairwise(bounds)]
    assert streamed(THINK, pieces, inside) == split(text, THINK, starts_inside=inside)


def test_reasoning_then_tool_call_qwen3() -> None:
    out = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
           '"arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning, answer = split(out, THINK)
    assert reasoning == "The user wants weather."
    got = parse(ToolFormat.HERMES, answer, names=["get_weather"], make_id=lambda: "x")
    assert got.content == "" and got.calls[0].arguments == '{"city":"Paris"}'
