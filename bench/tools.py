"""Real MCP servers' tool lists (tests/data/mcp): served in all four dialects, what the
grammar relaxes, what a union of four servers costs to compile, and what a list the
daemon has seen adds to a turn's first token.

1. Served: each server's list, and the union, through OpenAI chat, Responses, Anthropic
   and Ollama (their own clients, a forced call where the dialect has one), on a tiny
   random-weight model with SmolLM2's tokenizer and a Qwen2.5 (Hermes) template: the
   HTTP status of each, the calls made (sampled, seeded) and those whose arguments broke
   the relaxed parts of their tool's schema (``everycycle_tool_calls{outcome="invalid"}``).
2. Compile: the union's grammar, cold (``call_grammar``: the daemon's own check) and in
   the engine for the model's vocabulary, against a repeat (kept: ``CallGrammars``).
3. First token (streamed: the first chunk with a token), like for like: the same
   conversation's next turn with the union's tools (the list seen on the turn before: a
   hit), with the same tools' JSON as a system message and no ``tools`` field (a prompt
   as long: what the tools field itself adds), and with neither. Every side reuses its
   whole cached prefix and prefills the same new user turn (checked: the same number of
   uncached prompt tokens on every side, and one token sampled) before a difference
   is printed. Each side's turns run in a block of ``--rounds`` (its conversation stays
   in the slot), the blocks twice over; medians.

    .venv/bin/python bench/tools.py [--rounds 15] [--skip-served]
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "tests"))

import argparse
import json
import os
import statistics
import tempfile
import time
import urllib.request
from typing import Any

import openai
from daemonhelp import daemon_process
from templatehelp import SMOLLM2, fixture_source
from test_mcp_tools import SERVERS, UNION, mcp_tools, openai_tools, serve_everywhere
from tinyagent import write_tiny_bpe_gguf

from everycycle.chatfmt.callgrammar import call_grammar
from everycycle.chatfmt.tools import ToolFormat
from everycycle.client import SyncClient


def invalid_count(url: str) -> float:
    """``everycycle_tool_calls{outcome="invalid"}``, summed over models."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("everycycle_tool_calls_total{") and 'outcome="invalid"' in line)


def served(url: str) -> None:
    print("1. served (HTTP 200 in all four dialects; calls made / arguments invalid)")
    print(f"{'server':<28} {'tools':>5} {'KB':>6} {'relaxed':>7} {'calls':>5} {'invalid':>7}")
    for name, servers in [*[(s, (s,)) for s in SERVERS], ("union: " + "+".join(UNION), UNION)]:
        tools = mcp_tools(*servers)
        relaxed = call_grammar(ToolFormat.HERMES, openai_tools(tools), forced=True).relaxed
        before = invalid_count(url)
        try:
            calls = serve_everywhere(url, tools)
            made, status = len(calls.made), ""
        except Exception as exc:  # noqa: BLE001 - a refusal is what this counts
            made, status = 0, f"  FAILED: {str(exc)[:200]}"
        print(f"{name[:28]:<28} {len(tools):>5} {len(json.dumps(tools)) / 1024:>6.0f} "
              f"{len(relaxed):>7} {made:>5} {invalid_count(url) - before:>7.0f}{status}")


def compile_costs(tools: list[dict[str, Any]]) -> None:
    chat = openai_tools(tools)
    started = time.perf_counter()
    grammar = call_grammar(ToolFormat.HERMES, chat, forced=False).grammar
    cold = time.perf_counter() - started
    print(f"\n2. compile: the union ({len(tools)} tools, {len(json.dumps(chat)) / 1024:.0f} KB; "
          f"grammar {len(grammar) / 1024:.0f} KB): {cold * 1000:.0f} ms cold (rules, no "
          "vocabulary); the engine's compile for the vocabulary is in the first turn below")


WORDS = [chr(c) for c in (*range(65, 91), *range(97, 123))]
"""Questions by a letter each (one token each, as the bench checks)."""


def first_token(url: str, tools: list[dict[str, Any]], rounds: int) -> None:
    chat = openai_tools(tools)
    listed = "Tools:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in chat)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Hello."},
                                     {"role": "assistant", "content": "Hello! How can I help?"}]
    sides = {  # (system message, tools)
        "tools": ([], {"tools": chat}),
        "none": ([], {}),
        "text": ([{"role": "system", "content": listed}], {}),
    }
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       timeout=600) as oc:
        def turn(side: str, i: int) -> tuple[float, int, int, int]:
            system, extra = sides[side]
            # (a question never asked before on its side: no saved prompt holds more)
            ask = f"Question {WORDS[i]}?"
            messages = [*system, *history, {"role": "user", "content": ask}]
            started = time.perf_counter()
            took = None
            usage = None
            for chunk in oc.chat.completions.create(
                    model="agent", messages=messages, max_tokens=1, temperature=0,  # type: ignore[arg-type]
                    stream=True, stream_options={"include_usage": True}, **extra):
                if took is None and chunk.choices and (chunk.choices[0].delta.content
                                                       or chunk.choices[0].finish_reason):
                    took = time.perf_counter() - started  # the first token
                usage = chunk.usage or usage
            assert took is not None and usage is not None
            assert usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            return took, usage.prompt_tokens, cached, usage.completion_tokens

        started = time.perf_counter()
        turn("tools", 0)  # the list's first turn: its prefix, and its grammar for the vocabulary
        first = time.perf_counter() - started
        turn("none", 0)
        turn("text", 0)
        times: dict[str, list[float]] = {side: [] for side in sides}
        fresh: dict[str, set[int]] = {side: set() for side in sides}
        prompts: dict[str, int] = {}
        # In blocks, a side's turns one after another (its conversation stays in the one
        # slot; alternating sides would measure the prompt cache's swaps instead),
        # after a turn that brings it back; the blocks twice over, against drift.
        for block in range(2):
            for side in sides:
                turn(side, 0)
                for i in range(1, rounds + 1):
                    took, prompt, cached, generated = turn(side, i + block * rounds)
                    if generated > 1:  # (0: its one sampled token was the end)
                        sys.exit(f"a turn generated {generated} tokens, not 1: no ratio")
                    times[side].append(took)
                    fresh[side].add(prompt - cached)
                    prompts[side] = prompt
    if len({frozenset(f) for f in fresh.values()}) != 1:
        sys.exit(f"the sides prefilled different numbers of new tokens ({fresh}): no "
                 "difference printed")
    hit, none, text = (statistics.median(times[s]) for s in ("tools", "none", "text"))
    new = next(iter(fresh["tools"]))
    print(f"\n3. first token (streamed), the union's list seen the turn before (hit); every "
          f"side prefills {new} new tokens after a cached prefix ({rounds} rounds, medians):")
    print(f"   first turn with the list (prefill + engine compile): {first * 1000:.0f} ms")
    print(f"   hit, tools field ({prompts['tools']} prompt tokens): {hit * 1000:.1f} ms")
    print(f"   the same tools as system text, no tools field ({prompts['text']} tokens): "
          f"{text * 1000:.1f} ms: the tools field adds {(hit - text) * 1000:+.1f} ms")
    print(f"   no tools at all ({prompts['none']} tokens): {none * 1000:.1f} ms: the long "
          f"prompt and its tools add {(hit - none) * 1000:+.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="turns a block (at most 25)")
    parser.add_argument("--skip-served", action="store_true")
    args = parser.parse_args()
    args.rounds = min(args.rounds, (len(WORDS) - 1) // 2)
    home = Path(tempfile.mkdtemp(prefix="ect", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    model = write_tiny_bpe_gguf(home / "bpe-hermes.gguf", SMOLLM2,
                                chat_template=fixture_source("qwen2.5-instruct"), n_ctx=131072)
    models = home / "models.toml"
    models.write_text(f'default = "agent"\n[models.agent]\npath = "{model}"\n'
                      "context = 65536\nparallel = 1\n")
    with daemon_process("--models", str(models), "--http", "127.0.0.1:0"):
        with SyncClient() as c:
            url = c.describe_fleet().http
        assert url is not None
        if not args.skip_served:
            served(url)
        union = mcp_tools(*UNION)
        compile_costs(union)
        first_token(url, union, args.rounds)


if __name__ == "__main__":
    main()
