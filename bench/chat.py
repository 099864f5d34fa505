"""Time to first token of a conversation's turns through the daemon: turn 5 vs turn 1.

Starts its own daemon on the default chat model (or --model), then runs R fresh
conversations of T turns each (greedy, N tokens an answer), sending the whole
conversation every turn as `everycycle chat` does. Prints, per turn, the median time
to first token, the prompt's length in tokens and how many of them came from the
slot's cache (from the daemon's audit log), and the ratio of the last turn to the first.

    .venv/bin/python bench/chat.py [--rounds 5] [--turns 5] [-n 48] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemonhelp import daemon_process

from everycycle import paths
from everycycle.client import connect
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Message, Role, Tokens

QUESTIONS = [
    "I am planning a small vegetable garden. What should I grow first?",
    "How much sun do those need?",
    "And how often should I water them?",
    "What about pests? Keep it short.",
    "Summarize the plan in three bullet points.",
    "Anything else I should know?",
]


async def conversation(round_no: int, turns: int, n: int) -> list[float]:
    """One conversation; the time to first token of each turn."""
    history: list[Message] = [Message(Role.SYSTEM, f"You are a helpful gardener #{round_no}.")]
    ttfts: list[float] = []
    async with connect() as client:
        for t in range(turns):
            history.append(Message(Role.USER, QUESTIONS[t % len(QUESTIONS)]))
            start = time.perf_counter()
            first: float | None = None
            text = []
            async for ev in client.generate("bench", messages=tuple(history), max_tokens=n,
                                            temperature=0.0):
                if isinstance(ev, Tokens):
                    if first is None and ev.chunk.ids:
                        first = time.perf_counter() - start
                    text.append(ev.chunk.text)
            ttfts.append(first or 0.0)
            history.append(Message(Role.ASSISTANT, "".join(text)))
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("-n", type=int, default=48, help="tokens per answer")
    ap.add_argument("--model", type=Path)
    args = ap.parse_args()
    reg = load_registry()
    model = args.model or local_file(reg.get(reg.default_name()))
    home = Path(tempfile.mkdtemp(prefix="ecc", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model}"\ncontext = 4096\nparallel = 1\n')
    per_turn: list[list[float]] = [[] for _ in range(args.turns)]
    with daemon_process("--models", str(models)):
        for r in range(args.rounds):
            for t, ttft in enumerate(anyio.run(conversation, r, args.turns, args.n)):
                per_turn[t].append(ttft)
    records = [json.loads(x) for x in paths.audit_file().read_text().splitlines()
               if '"request_id"' in x]
    print(f"model {model.name}, {args.rounds} conversations x {args.turns} turns, "
          f"{args.n} tokens an answer, greedy, through the daemon")
    for t in range(args.turns):
        recs = records[t::args.turns]
        prompt = statistics.median(r["prompt_tokens"] for r in recs)
        cached = statistics.median(r["cached_tokens"] for r in recs)
        print(f"turn {t + 1}: TTFT p50 {statistics.median(per_turn[t]) * 1000:6.1f} ms  "
              f"prompt {prompt:5.0f} tokens, {cached:5.0f} from the cache, "
              f"{prompt - cached:4.0f} prefilled")
    first, last = statistics.median(per_turn[0]), statistics.median(per_turn[-1])
    print(f"turn {args.turns} / turn 1 TTFT: {last / first:.2f}")


if __name__ == "__main__":
    main()
