"""Constrained decoding's speed: ``response_format`` against llama-server, and tool calls
against our own free decoding at the same depth.

1. ``response_format: json_schema`` through ``/v1/chat/completions`` on both sides: same
   GGUF, threads, one slot, same schema (an array of at least 50 objects, so neither
   side can finish before ``-n`` tokens), greedy, streamed. Both sides must report
   ``-n`` completion tokens cut by ``length`` or no ratio is printed. Rounds alternate.
2. The recorded opencode request (its 10 tools, ``tool_choice`` auto, greedy) against
   the same prompt decoded free: the tools' system text (the generic format SmolLM2
   gets) written into the system message by hand, no tools sent, so the two prompts are
   the same tokens (checked: equal ``prompt_tokens``) and the prefix is cached on both.
   A call streams whole, so tok/s is taken over the whole request (the prefix cached,
   so nearly all of it is decoding).

    .venv/bin/python bench/structured.py [--llama-server PATH] [-n 128] [--rounds 5]
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/http.py sits beside this file: with bench/ first on sys.path it would shadow the
# standard library's http package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "tests"))

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from daemonhelp import daemon_process

from everycycle.chatfmt.tools import add_system_prompt, generic_system_prompt
from everycycle.client import SyncClient
from everycycle.models.registry import load_registry, local_file

_spec = importlib.util.spec_from_file_location("bench_load", _HERE / "load.py")
assert _spec is not None and _spec.loader is not None
_load = importlib.util.module_from_spec(_spec)
sys.modules["bench_load"] = _load
_spec.loader.exec_module(_load)
llama_server = _load.llama_server

FILMS = {"type": "array", "minItems": 50, "items": {
    "type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                     "year": {"type": "integer"},
                                     "genres": {"type": "array", "items": {"type": "string"},
                                                "maxItems": 3}},
    "required": ["title", "year", "genres"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "List famous films as JSON: title, year, genres."}]


@dataclass
class Stream:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish: str | None
    decode: float
    """tok/s from the first streamed token to the last."""
    whole: float
    """tok/s over the whole request, from sending it to its last event."""
    text: str


def stream(port: int, body: dict[str, Any]) -> Stream:
    """One streaming chat completion, read as it arrives."""
    sent = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}),
        {"content-type": "application/json"})
    answer = conn.getresponse()
    if answer.status != 200:
        raise SystemExit(f"HTTP {answer.status}: {answer.read()[:500]!r}")
    first = last = 0.0
    usage: dict[str, Any] = {}
    finish = None
    text = []
    for raw in answer:
        if not raw.startswith(b"data: {"):
            continue
        event = json.loads(raw[6:])
        usage = event.get("usage") or usage
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = (delta.get("content") or "") + json.dumps(delta.get("tool_calls") or "")
            if delta.get("content") or delta.get("tool_calls"):
                last = time.perf_counter()
                first = first or last
                text.append(piece)
            finish = choice.get("finish_reason") or finish
    conn.close()
    elapsed = time.perf_counter() - sent
    n = int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Stream(int(usage.get("prompt_tokens", 0)), cached, n, finish,
                  (n - 1) / (last - first) if n > 1 and last > first else 0.0, n / elapsed,
                  "".join(text))


def schema_rounds(ours: int, theirs: int | None, n: int, rounds: int,
                  temperature: float = 0.0) -> None:
    body = {"model": "bench", "messages": ASK, "max_tokens": n, "temperature": temperature,
            "seed": 42,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "films", "schema": FILMS}}}
    sides = {"everycycle": ours, **({"llama-server": theirs} if theirs else {})}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for port in sides.values():
        stream(port, body)  # warm: the model resident, the schema compiled once
    for _ in range(rounds):
        for name, port in sides.items():
            s = stream(port, body)
            if s.completion_tokens != n or s.finish != "length" or not s.text.startswith("["):
                raise SystemExit(f"{name} did other work than asked: {s.completion_tokens} "
                                 f"tokens, finish {s.finish}, text {s.text[:60]!r}")
            rates[name].append(s.decode)
    how = "greedy" if temperature == 0 else f"temperature {temperature:g}, seed 42"
    print(f"1. response_format json_schema, {n} tokens each, {how}, one slot, {rounds} "
          "alternating rounds (both sides cut by length at exactly n tokens)")
    for name, r in rates.items():
        print(f"   {name:<12} decode {statistics.median(r):6.1f} tok/s median, "
              f"{max(r):6.1f} best")
    if theirs:
        ratios = [a / b for a, b in zip(rates["everycycle"], rates["llama-server"], strict=True)]
        print(f"   ratio everycycle/llama-server: per round "
              f"{' '.join(f'{r:.3f}' for r in ratios)}, median {statistics.median(ratios):.3f}")


def opencode_request() -> dict[str, Any]:
    """The recorded opencode request with tools (the largest)."""
    path = _HERE.parent / "tests" / "data" / "agents" / "opencode.jsonl"
    bodies = [json.loads(line)["body"] for line in path.read_text().splitlines()]
    return max((b for b in bodies if b.get("tools")), key=lambda b: len(json.dumps(b)))


def tools_rounds(ours: int, n: int, rounds: int) -> None:
    recorded = opencode_request()
    constrained = {"model": "bench", "messages": recorded["messages"],
                   "tools": recorded["tools"], "tool_choice": "auto", "max_tokens": n,
                   "temperature": 0.0}
    free = {"model": "bench", "max_tokens": n, "temperature": 0.0,
            "messages": add_system_prompt(recorded["messages"],
                                          generic_system_prompt(recorded["tools"]))}
    rates: dict[str, list[float]] = {"constrained": [], "free": []}
    counts: dict[str, list[int]] = {"constrained": [], "free": []}
    prompts = set()
    stream(ours, constrained)  # the prompt's prefix, cached for both
    for _ in range(rounds):
        for name, body in (("constrained", constrained), ("free", free)):
            s = stream(ours, body)
            prompts.add(s.prompt_tokens)
            if s.cached_tokens < s.prompt_tokens - 64:
                raise SystemExit(f"{name}: the prefix was not cached ({s.cached_tokens} of "
                                 f"{s.prompt_tokens})")
            if s.completion_tokens < 16:
                raise SystemExit(f"{name}: {s.completion_tokens} tokens are too few to time")
            rates[name].append(s.whole)  # (a tool call streams whole: no per-token time)
            counts[name].append(s.completion_tokens)
    if len(prompts) != 1:
        raise SystemExit(f"the two prompts differ ({sorted(prompts)} tokens): not like for like")
    print(f"2. opencode's recorded request ({len(recorded['tools'])} tools, tool_choice auto, "
          f"greedy) vs the same {prompts.pop()}-token prompt decoded free, prefix cached, "
          f"up to {n} tokens, {rounds} alternating rounds")
    for name, r in rates.items():
        print(f"   {name:<12} {statistics.median(r):6.1f} tok/s median over the whole "
              f"request, {statistics.median(counts[name]):.0f} tokens")
    ratios = [a / b for a, b in zip(rates["constrained"], rates["free"], strict=True)]
    print(f"   ratio constrained/free: per round {' '.join(f'{r:.3f}' for r in ratios)}, "
          f"median {statistics.median(ratios):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=128, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--temperature", type=float, default=0.0, help="for the schema rounds "
                    "(llama-server's grammar sampler is cheap while the model's first choice "
                    "is allowed: greedy on a likely schema; sampled, it is refused oftener)")
    ap.add_argument("--schema-only", action="store_true", help="skip the tool rounds")
    args = ap.parse_args()
    reg = load_registry()
    model = (args.model or local_file(reg.get(reg.default_name()))).resolve()
    threads = os.cpu_count() or 1
    home = Path(tempfile.mkdtemp(prefix="ecs", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model}"\ncontext = 16384\nparallel = 1\n'
                      "speculative = false\n")
    print(f"model {model.name}, {threads} threads, prompt lookup off on our side (as "
          "llama-server)")
    with daemon_process("--models", str(models), "--http", "127.0.0.1:0"):
        with SyncClient() as c:
            c.load("bench")
            url = c.describe_fleet().http
        assert url is not None
        ours = int(url.rpartition(":")[2])
        with contextlib.ExitStack() as stack:
            theirs = (stack.enter_context(llama_server(args.llama_server, model, 1, threads))
                      if args.llama_server else None)
            schema_rounds(ours, theirs, args.n, args.rounds, args.temperature)
        if not args.schema_only:
            tools_rounds(ours, args.n, args.rounds)


if __name__ == "__main__":
    main()
