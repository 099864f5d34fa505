"""Golden renders: conversations (with and without a system message, with tools, with a
tool call and its result) through real chat templates — the default model's own, and
published ones — by the daemon's own path (chatfmt/chat.py). The expected prompts are
checked in under tests/data/renders; EVERYCYCLE_REGOLD=1 writes them anew (then read
the diff)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from templatehelp import SMOLLM2, fixture_source, gguf_chat

from everycycle.chatfmt.chat import ChatFormat
from everycycle.protocol import Message, Role, ToolCall

RENDERS = Path(__file__).parent / "data" / "renders"
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
ASK = Message(Role.USER, "What is 2 plus 3?")
CASES: dict[str, tuple[tuple[Message, ...], list[dict[str, object]] | None]] = {
    "user": ((ASK,), None),
    "system": ((Message(Role.SYSTEM, "Answer briefly."), ASK), None),
    "tools": ((ASK,), [ADD]),
    "tool-result": ((ASK, Message(Role.ASSISTANT, "", (ToolCall("call0abcd", "add",
                                                                '{"a": 2, "b": 3}'),)),
                     Message(Role.TOOL, "5", tool_call_id="call0abcd")), [ADD]),
}


def _formats() -> dict[str, ChatFormat]:
    out = {name: ChatFormat(fixture_source(name), bos="", eos="<|im_end|>", strip_bos=False)
           for name in ("qwen2.5-instruct", "qwen3", "mistral-nemo-instruct")}
    if SMOLLM2.exists():
        source, bos, eos = gguf_chat(SMOLLM2)
        out["smollm2"] = ChatFormat(source, bos=bos, eos=eos, strip_bos=False)
    return out


FORMATS = _formats()


@pytest.mark.parametrize("template", sorted(FORMATS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_the_checked_in_prompt(template: str, case: str) -> None:
    messages, tools = CASES[case]
    got = FORMATS[template].render(messages, tools=tools).text
    golden = RENDERS / f"{template}.{case}.txt"
    if os.environ.get("EVERYCYCLE_REGOLD"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got, encoding="utf-8")
    assert got == golden.read_text(encoding="utf-8")


def test_smollm2_gives_its_own_system_prompt_when_none_is_given() -> None:
    if "smollm2" not in FORMATS:
        pytest.skip("the default model is not installed")
    text = FORMATS["smollm2"].render((ASK,)).text
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "Answer briefly" in FORMATS["smollm2"].render(CASES["system"][0]).text
