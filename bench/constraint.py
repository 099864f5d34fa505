"""The constraint engine's cost per token: mask time (median, p99) on the recorded
agents' tool grammars with SmolLM2's 49k-token vocabulary (GENERIC format, as a plain
SmolLM2 entry gets them), and a small JSON schema's in the same run. Each grammar is
walked at random (random logits, masked, argmax), masking before every token.

    .venv/bin/python bench/constraint.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from llamacheck import smollm2

from everycycle.chatfmt import constraint
from everycycle.chatfmt.callgrammar import call_grammar
from everycycle.chatfmt.tools import ToolFormat


def agent_tools(agent: str) -> list[dict[str, Any]]:
    """The tools of the agent's largest recorded request, as OpenAI function tools."""
    best: list[dict[str, Any]] = []
    for line in (ROOT / "tests" / "data" / "agents" / f"{agent}.jsonl").read_text().splitlines():
        tools = json.loads(line)["body"].get("tools") or []
        if len(tools) > len(best):
            best = tools
    out = []
    for t in best:
        if "input_schema" in t:  # Anthropic
            out.append({"name": t["name"], "parameters": t["input_schema"]})
        elif t.get("type") == "function" and "function" in t:
            out.append(t["function"])
        elif t.get("type") == "function":
            out.append({"name": t["name"], "parameters": t.get("parameters") or {}})
    return out


def walk(vocab: Any, grammar: str, steps: int = 300, seed: int = 0) -> list[float]:
    """Mask times in microseconds over a random walk through ``grammar``: each step
    masks, then takes the argmax of random logits among what the mask allows."""
    m = vocab.constraints.matcher(grammar)
    rng = np.random.default_rng(seed)
    n = vocab.constraints._n_vocab
    eos = set(vocab.constraints._eos)
    times = []
    for _ in range(steps):
        logits = rng.normal(size=n).astype(np.float32)
        started = time.perf_counter()
        masked = m.mask(logits)
        times.append((time.perf_counter() - started) * 1e6)
        masked[list(eos)] = -np.inf  # (walk on while anything else is allowed)
        if not np.isfinite(masked).any():
            break
        m.accept(int(masked.argmax()))
    return times


def main() -> None:
    vocab = smollm2()
    print(f"{'grammar':34} {'tokens':>6} {'median µs':>10} {'p99 µs':>8} {'compile ms':>10}")
    for agent in ("claude", "codex", "opencode"):
        tools = agent_tools(agent)
        if not tools:
            continue
        started = time.perf_counter()
        grammar = call_grammar(ToolFormat.GENERIC, tools, forced=False).grammar
        vocab.constraints.check(grammar)
        compiled = (time.perf_counter() - started) * 1e3
        times = walk(vocab, grammar)
        times.sort()
        print(f"{agent + f' ({len(tools)} tools)':34} {len(times):6} "
              f"{statistics.median(times):10.1f} {times[int(0.99 * (len(times) - 1))]:8.1f} "
              f"{compiled:10.1f}")
    schema = constraint.json_schema({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"]})
    times = sorted(walk(vocab, schema))
    print(f"{'a small response_format schema':34} {len(times):6} "
          f"{statistics.median(times):10.1f} {times[int(0.99 * (len(times) - 1))]:8.1f}")


if __name__ == "__main__":
    main()
