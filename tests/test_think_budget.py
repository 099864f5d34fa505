"""Reasoning budgets: a thinking model's thinking ends after its budget, as its template
ends it (the close marker, then the answer), asked for in each dialect's own field —
Anthropic's ``thinking.budget_tokens``, OpenAI's ``reasoning_effort`` and llama-server's
``thinking_budget_tokens``, Responses' ``reasoning.effort``, Ollama's think levels — or
by the model's models.toml default; usage says the thinking tokens where the dialect
has a field for them. On the tiny model (random weights: it never closes its thinking
by itself) with a DeepSeek-R1-style template that opens the thinking section."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SpawnDaemon
from enginehelp import Collector
from httphelp import anthropic_client, fleet_http, ollama_client, openai_client
from modelshelp import Entry, models_toml
from tinymodel import write_tiny_gguf

from everycycle.client import SyncClient
from everycycle.engine.core.jobs import Job, JobSpec, Sampling
from everycycle.engine.core.thinking import ThinkBudget, Thinking
from everycycle.engine.worker.runner import Runner
from everycycle.protocol import Message, Role, ThinkEffort, Tokens, Usage

THINKING = ("{{ bos_token }}{% for message in messages %}"
            "{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|><think>\n' }}{% endif %}")
BUDGET = 8
EFFORTS = {"low": BUDGET, "medium": 2 * BUDGET, "high": 4 * BUDGET}


# ---------------------------------------------------------------- the counting alone


def test_thinking_counts_tokens_between_the_markers() -> None:
    t = Thinking(ThinkBudget(3, "<think>", "</think>"))
    for piece in ["<th", "ink>"]:  # (the model opens it, in two tokens)
        t.took(piece)
    assert t.inside and t.count == 0
    for piece in ["a", "b"]:
        t.took(piece)
    assert not t.due
    t.took("c")
    assert t.due and t.count == 3
    closed = Thinking(ThinkBudget(5, "<think>", "</think>", inside=True))
    for piece in ["x", "</thi", "nk>"]:
        closed.took(piece)
    assert closed.done and not closed.due  # (it closed by itself within its budget)
    plain = Thinking(ThinkBudget(5, "<think>", "</think>"))
    for piece in ["a", "plain", "answer", ",", "with", "no", "thinking", "at", "all"]:
        plain.took(piece)  # (past the first tokens, where a model opens its thinking)
    assert plain.done and plain.count == 0
    assert Thinking(ThinkBudget(0, "<think>", "</think>", inside=True)).due


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def thinking_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("think") / "thinking.gguf",
                           chat_template=THINKING)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_ends_thinking_after_its_budget(thinking_gguf: Path,
                                                   temperature: float) -> None:
    c = Collector()
    runner = Runner(thinking_gguf, context=512, parallel=1, notify=c)
    try:
        tokens = runner.tokenize("why?")
        budget = ThinkBudget(BUDGET, "<think>", "</think>", inside=True, message=" Enough.")
        job = Job(JobSpec(tokens=tokens, max_tokens=40, special=True, think=budget,
                          sampling=Sampling.of(temperature=temperature, seed=3)), tag="j")
        runner.submit(job)
        outs = c.wait("j", 120)
        ids = [i for o in outs for i in o.ids]
        ending = runner.vocab.tokenize(budget.ending, special=True)
        assert ids[BUDGET:BUDGET + len(ending)] == ending  # 8 thoughts, then the ending
        assert "</think>" not in runner.detokenize(ids[:BUDGET])
        assert job.n_thought == BUDGET
        assert len(ids) > BUDGET + len(ending)  # and an answer after it
        assert outs[-1].reason == "length"
    finally:
        runner.close()


# ---------------------------------------------------------------- each dialect


@pytest.fixture
def url(spawn_daemon: SpawnDaemon, thinking_gguf: Path, tmp_path: Path) -> Iterator[str]:
    models = models_toml(tmp_path / "models.toml", Entry(
        "thinking", thinking_gguf, context=1024, parallel=1,
        more={"reasoning_efforts": EFFORTS}), default="thinking")
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    yield fleet_http()


ASK = [{"role": "user", "content": "why?"}]


def test_openai_chat_thinking_budget_tokens_and_reasoning_effort(url: str) -> None:
    with openai_client(url) as client:
        for body in ({"thinking_budget_tokens": BUDGET}, {"reasoning_effort": "low"}):
            answer = client.chat.completions.create(
                model="thinking", messages=ASK, max_tokens=40, temperature=0,  # type: ignore[arg-type]
                extra_body=body)
            message = answer.choices[0].message
            thought = (message.model_extra or {}).get("reasoning_content") or ""
            assert thought and message.content, message
            assert answer.usage is not None
            details = answer.usage.completion_tokens_details
            assert details is not None and details.reasoning_tokens == BUDGET, answer.usage
        plain = client.chat.completions.create(model="thinking", messages=ASK, max_tokens=40,  # type: ignore[arg-type]
                                               temperature=0)
        assert plain.choices[0].message.content in (None, "")  # (no budget: all thinking)


def test_anthropic_thinking_budget_tokens(url: str) -> None:
    with anthropic_client(url) as client:
        answer = client.messages.create(
            model="thinking", max_tokens=40, messages=ASK,  # type: ignore[arg-type]
            thinking={"type": "enabled", "budget_tokens": BUDGET},
            extra_body={"temperature": 0})
    kinds = [b.type for b in answer.content]
    assert kinds == ["thinking", "text"], answer.content
    assert answer.stop_reason == "max_tokens"


def test_responses_reasoning_effort(url: str) -> None:
    with openai_client(url) as client:
        answer = client.responses.create(model="thinking", input="why?", max_output_tokens=40,
                                         reasoning={"effort": "low"}, temperature=0)
    kinds = [item.type for item in answer.output]
    assert kinds == ["reasoning", "message"], answer.output
    assert answer.usage is not None
    assert answer.usage.output_tokens_details.reasoning_tokens == BUDGET


def test_ollama_think_levels(url: str) -> None:
    with ollama_client(url) as client:
        answer = client.chat(model="thinking", messages=ASK, think="medium",
                             options={"temperature": 0, "num_predict": 60})
    assert answer.message.thinking and answer.message.content, answer.message


def test_the_socket_says_the_budget_and_counts_the_thinking(url: str) -> None:
    with SyncClient() as c:
        events: list[Any] = list(c.generate(
            "thinking", messages=(Message(Role.USER, "why?"),), max_tokens=80, temperature=0,
            think_effort=ThinkEffort.HIGH, usage=True))
    usage = next(e for e in events if isinstance(e, Usage))
    assert usage.reasoning_tokens == EFFORTS["high"]
    chunks = [e.chunk for e in events if isinstance(e, Tokens)]
    assert "".join(ch.reasoning or "" for ch in chunks) and "".join(ch.text for ch in chunks)


ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


def test_a_budget_holds_under_a_tool_call_grammar(url: str) -> None:
    """An agent's turn: tools (whose grammar holds the output) and a budget; the ending
    is forced where the grammar allows it."""
    with openai_client(url) as client:
        answer = client.chat.completions.create(
            model="thinking", messages=ASK, max_tokens=60, temperature=0,  # type: ignore[arg-type]
            tools=[ADD], extra_body={"thinking_budget_tokens": BUDGET})  # type: ignore[list-item]
    assert answer.usage is not None
    details = answer.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == BUDGET, answer.usage
    message = answer.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content"), message
