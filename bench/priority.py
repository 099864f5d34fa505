"""Priority lanes: interactive requests beside a queue of background work, in one run.

One daemon, SmolLM2 (the default model) with 4 slots. The phases, one after another:

1. background alone: 32 background requests (~200-token prompts, 256 tokens each,
   sampled with fixed seeds, end tokens banned) sent at once: their throughput alone;
2. mixed: 32 more background requests (the same work: same lengths and seeds, another
   prompt prefix so no cache helps) sent at once, then an interactive request (a
   one-line question, up to 32 tokens, greedy) every 2 s until they finish;
3. idle: as many interactive requests, every 2 s, on an otherwise idle daemon: the
   time to first token each gets alone (the same number of samples, so the p95s are
   alike), and the time each takes whole (the interactive work);
4. background alone again;

and phases 2-4 again for each further ``--rounds``. This machine's speed drifts by as
much as the quantity measured (the two alone phases around one mixed phase have
differed by 10-20%), so each mixed phase is set against the mean of the alone phases just
before and after it, and the rounds are summed.

It prints the interactive time to first token, mixed vs idle (median and p95 over all
rounds, target <= 1.2x), that every background request finished, the background
throughput alone and mixed and the time the interactive work took (target: the
background loses no more than that), and how far each queued request's estimated start
(``Accepted.eta_ms``) was from its actual start (target: median error <= 25% of the
wait).

    .venv/bin/python bench/priority.py [--model GGUF] [--background 32] [--every 2]
        [--rounds 2] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "tests"))

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import anyio
from daemonhelp import daemon_process

from everycycle.client import connect
from everycycle.hardware.gguf import read_metadata
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Accepted, Error, Priority, Tokens
from everycycle.protocol.sampling import Bias

TOPICS = ("a lighthouse keeper", "a city under the sea", "the first winter on Mars",
          "a clockmaker's apprentice", "a library that never closes", "a river pilot",
          "an orchard in the mountains", "a night train across the desert")
FILLER = ("Use plain words, give every character a name and a reason, describe the "
          "places with care, keep the events in order, and end each part with a "
          "question the next part answers. ")


@dataclass
class Timed:
    """One request as the client saw it (seconds from the phase's start)."""

    sent: float
    eta: float | None = None
    """The first estimate it was told, while queued (seconds)."""
    queued_at: float | None = None
    started: float | None = None
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    reason: str = ""
    positions: list[int] = field(default_factory=list)
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(when, how many tokens) for each chunk of tokens that came."""


NO_END: tuple[Bias, ...] = ()
"""Biases that ban the model's end tokens: every background request generates its
``max_tokens`` exactly, so both phases do the same work (set from the GGUF)."""


async def request(client: object, model: str, prompt: str, n: int, t0: float, *,
                  background: bool, seed: int, temperature: float) -> Timed:
    timed = Timed(time.perf_counter() - t0)
    async for event in client.generate(  # type: ignore[attr-defined]
            model, prompt, max_tokens=n, temperature=temperature, seed=seed,
            priority=Priority.BACKGROUND if background else None,
            logit_bias=NO_END if background else None):
        now = time.perf_counter() - t0
        if isinstance(event, Accepted):
            timed.positions.append(event.queue_position)
            if event.queue_position and timed.queued_at is None:
                timed.queued_at = now
                timed.eta = None if event.eta_ms is None else event.eta_ms / 1000
            elif not event.queue_position and timed.started is None:
                timed.started = now
        elif isinstance(event, Tokens):
            if event.chunk.ids and timed.first_token is None:
                timed.first_token = now
            timed.tokens += len(event.chunk.ids)
            timed.chunks.append((now, len(event.chunk.ids)))
            if event.finished:
                timed.ended, timed.reason = now, "finished"
        elif isinstance(event, Error):
            timed.ended, timed.reason = now, f"{event.kind.value}: {event.message}"
    return timed


def background_prompt(phase: str, i: int) -> str:
    return (f"[{phase}-{i:02d}] Write a long story about {TOPICS[i % len(TOPICS)]}. "
            + FILLER * 3)


async def phase(model: str, *, background: int, every: float, interactive: int | None,
                name: str, n_bg: int, n_it: int) -> tuple[list[Timed], list[Timed], float]:
    """Send ``background`` requests at once and an interactive one every ``every`` s
    (``interactive`` of them, or until the background ones end); (background,
    interactive, the background's makespan)."""
    bg: list[Timed] = []
    it: list[Timed] = []
    t0 = time.perf_counter()
    async with connect() as bulk, connect() as person, anyio.create_task_group() as tg:
        async def one_bg(i: int) -> None:
            bg.append(await request(bulk, model, background_prompt(name, i), n_bg, t0,
                                    background=True, seed=1000 + i, temperature=0.8))

        async def one_it(i: int) -> None:
            it.append(await request(person, model, f"({name}-{i:02d}) What is the capital of "
                                    "France, in one sentence?", n_it, t0,
                                    background=False, seed=i, temperature=0.0))

        for i in range(background):
            tg.start_soon(one_bg, i)
        i = 0
        while True:
            await anyio.sleep(every)  # (the background work queued first, then a question)
            if (interactive is None and len(bg) == background) or (
                    interactive is not None and i == interactive):
                break
            tg.start_soon(one_it, i)
            i += 1
    makespan = max((b.ended or 0) for b in bg) if bg else 0.0
    return bg, it, makespan


def tail(background: list[Timed]) -> float:
    """How long a phase's end ran with fewer jobs than slots: from the end of the fourth
    last background request to the end of the last. Jobs start one after another (a
    step reads one background prompt), so this varies from phase to phase (0.3 to 6 s
    here), alone or mixed alike: part of the noise rounds average out."""
    ends = sorted(t.ended or 0 for t in background)
    return ends[-1] - ends[-4] if len(ends) >= 4 else 0.0


def before_tail(background: list[Timed]) -> tuple[float, int]:
    """(when the fourth last background request ended, the tokens all had received by
    then): the phase while every slot had background work, without its tail."""
    ends = sorted(t.ended or 0 for t in background)
    end = ends[-min(4, len(ends))]  # (fewer than four requests: the first end)
    return end, sum(n for t in background for when, n in t.chunks if when <= end)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def eta_errors(requests: list[Timed]) -> list[float]:
    """|estimate - actual| / actual for each request that queued and started."""
    out = []
    for r in requests:
        if r.eta is None or r.queued_at is None or r.started is None:
            continue
        actual = r.started - r.queued_at
        if actual > 0.2:
            out.append(abs(r.eta - actual) / actual)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--background", type=int, default=32)
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--idle", type=int, default=0, help="interactive requests when idle "
                    "(default: as many as beside the background work)")
    ap.add_argument("--preempt", choices=("on", "off"), default="on",
                    help="off: background steps never stop for interactive jobs (an A/B)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="mixed, idle and alone phases after the first alone one")
    ap.add_argument("--quick", action="store_true",
                    help="idle and mixed phases only (no throughput comparison)")
    args = ap.parse_args()
    os.environ["EVERYCYCLE_PREEMPT"] = "1" if args.preempt == "on" else "0"
    reg = load_registry()
    model = (args.model or local_file(reg.get(reg.default_name()))).resolve()
    home = Path(tempfile.mkdtemp(prefix="ecp", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model}"\ncontext = 8192\nparallel = 4\n'
                      "kv_cache_disk = 0\n")
    n_bg, n_it = 256, 32
    meta = read_metadata(model, ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.padding_token_id"))
    global NO_END
    NO_END = tuple(Bias(int(v), -100.0) for k, v in meta.items()
                   if k.startswith("tokenizer.ggml.") and k.endswith("_token_id"))
    print(f"model {model.name}, 4 slots, {os.cpu_count()} threads, preempt {args.preempt}; "
          f"{args.background} "
          f"background requests of up to {n_bg} tokens; interactive: {n_it} tokens every "
          f"{args.every:g} s", flush=True)
    with daemon_process("--models", str(models)):
        async def run() -> None:
            async with connect() as c:
                await c.load("bench")
                async for _ in c.generate("bench", "warm up", max_tokens=8):
                    pass
            named = iter(range(100))  # (phases' names: prompts alike in length, none cached)

            async def go(background: int, interactive: int | None
                         ) -> tuple[list[Timed], list[Timed], float]:
                return await phase("bench", background=background, every=args.every,
                                   interactive=interactive, name=f"p{next(named)}",
                                   n_bg=n_bg, n_it=n_it)

            if args.quick:
                _, mixed_it, _ = await go(args.background, None)
                idle = (await go(0, args.idle or len(mixed_it)))[1]
                latency(idle, mixed_it)
                return
            alone = [await go(args.background, 0)]
            rounds = []
            for r in range(args.rounds):
                mixed = await go(args.background, None)
                # (as many as the mixed phase had: percentiles of samples of one size)
                idle = (await go(0, args.idle or len(mixed[1])))[1]
                alone.append(await go(args.background, 0))
                rounds.append(Round(alone[r], mixed[0], mixed[1], mixed[2], idle, alone[r + 1]))
                print(f"round {r + 1}: background alone {alone[r][2]:.1f} s, mixed "
                      f"{mixed[2]:.1f} s, alone {alone[r + 1][2]:.1f} s (tails, fewer jobs "
                      f"than slots: {tail(alone[r][0]):.1f}, {tail(mixed[0]):.1f}, "
                      f"{tail(alone[r + 1][0]):.1f} s)", flush=True)
            report(rounds, args.background)

        anyio.run(run)


@dataclass
class Round:
    """A mixed phase, its idle one, and the background-alone phases around it."""

    before: tuple[list[Timed], list[Timed], float]
    mixed_bg: list[Timed]
    mixed_it: list[Timed]
    t_mixed: float
    idle: list[Timed]
    after: tuple[list[Timed], list[Timed], float]

    def lost(self) -> tuple[float, float]:
        """(the time the background lost beside interactive work, against the mean
        throughput of the alone phases around it; the interactive work's time on an idle
        daemon)."""
        tok_alone = sum(r.tokens for r in self.before[0] + self.after[0]) / 2
        thr_alone = tok_alone / ((self.before[2] + self.after[2]) / 2)
        lost = self.t_mixed - sum(r.tokens for r in self.mixed_bg) / thr_alone
        work = statistics.mean((r.ended or 0) - r.sent for r in self.idle) * len(self.mixed_it)
        return lost, work

    def lost_before_tail(self) -> tuple[float, float]:
        """``lost`` up to the fourth last background request's end, in every phase (the
        tail, a second or two that varies by itself, left out: a steadier comparison,
        not the total the target names)."""
        (t_before, n_before), (t_after, n_after) = (before_tail(p[0]) for p in (self.before,
                                                                               self.after))
        t_mixed, n_mixed = before_tail(self.mixed_bg)
        lost = t_mixed - n_mixed / ((n_before + n_after) / (t_before + t_after))
        per = statistics.mean((r.ended or 0) - r.sent for r in self.idle)
        return lost, per * sum(1 for r in self.mixed_it if r.sent < t_mixed)


def latency(idle: list[Timed], mixed_it: list[Timed]) -> None:
    """The interactive requests' time to first token, idle and mixed, and where the
    slowest mixed ones spent it."""
    ttft_idle = [r.first_token - r.sent for r in idle if r.first_token is not None]
    ttft_mixed = [r.first_token - r.sent for r in mixed_it if r.first_token is not None]
    print(f"interactive time to first token: idle median {statistics.median(ttft_idle):.3f} s"
          f", p95 {pct(ttft_idle, 0.95):.3f} s ({len(ttft_idle)} requests); beside the "
          f"background work median {statistics.median(ttft_mixed):.3f} s, p95 "
          f"{pct(ttft_mixed, 0.95):.3f} s ({len(ttft_mixed)} requests)")
    print(f"  ratio mixed/idle: median "
          f"{statistics.median(ttft_mixed) / statistics.median(ttft_idle):.2f}, p95 "
          f"{pct(ttft_mixed, 0.95) / pct(ttft_idle, 0.95):.2f} (target <= 1.2)")
    slow = sorted(mixed_it, key=lambda r: (r.first_token or 0) - r.sent)[-5:]
    print("  slowest beside background work (sent→slot, slot→first token): " + ", ".join(
        f"{(r.started or r.sent) - r.sent:.3f}+{(r.first_token or 0) - (r.started or r.sent):.3f}"
        for r in slow))


def report(rounds: list[Round], expected: int) -> None:
    alone = [rounds[0].before] + [r.after for r in rounds]
    for what, group in (("idle interactive", [t for r in rounds for t in r.idle]),
                        ("background alone", [t for p in alone for t in p[0]]),
                        ("background mixed", [t for r in rounds for t in r.mixed_bg]),
                        ("interactive mixed", [t for r in rounds for t in r.mixed_it])):
        bad = [t.reason for t in group if t.reason != "finished"]
        if bad:
            raise SystemExit(f"{what}: {len(bad)} did not finish ({bad[0]}): no ratio")
    background = [p[0] for p in alone] + [r.mixed_bg for r in rounds]
    if any(len(group) != expected for group in background):
        raise SystemExit("not every background request came back: no ratio")
    tokens = {t.tokens for group in background for t in group}
    if len(tokens) != 1:
        raise SystemExit(f"background requests generated {sorted(tokens)} tokens: not the "
                         "same work, no ratio")
    idle_it, mixed_it = [t for r in rounds for t in r.idle], [t for r in rounds for t in r.mixed_it]
    answers = [statistics.mean(t.tokens for t in group) for group in (idle_it, mixed_it)]
    if abs(answers[0] - answers[1]) > 0.1 * answers[0]:
        raise SystemExit(f"interactive answers averaged {answers[0]:.1f} tokens idle and "
                         f"{answers[1]:.1f} mixed: not the same work, no ratio")
    latency(idle_it, mixed_it)
    print(f"background: every request finished ({len(background)} phases of {expected}, "
          f"{tokens.pop()} tokens each); interactive answers {answers[0]:.1f} tokens on "
          f"average idle, {answers[1]:.1f} mixed")
    total_lost = total_work = 0.0
    for i, r in enumerate(rounds, 1):
        lost, work = r.lost()
        total_lost, total_work = total_lost + lost, total_work + work
        print(f"  round {i}: alone {r.before[2]:.1f} and {r.after[2]:.1f} s, mixed "
              f"{r.t_mixed:.1f} s: the background lost {lost:.1f} s beside "
              f"{len(r.mixed_it)} interactive requests that took {work:.1f} s on an idle daemon")
    print(f"  in all: the background lost {total_lost:.1f} s to interactive work that took "
          f"{total_work:.1f} s (target: lost <= that; ratio {total_lost / total_work:.2f})")
    steady = [r.lost_before_tail() for r in rounds]
    print("  while every slot had background work (each phase up to its fourth last end): "
          "lost " + ", ".join(f"{lost:.1f}/{work:.1f}" for lost, work in steady)
          + f" s; in all ratio {sum(x[0] for x in steady) / sum(x[1] for x in steady):.2f}")
    for what, group in (("background alone", [t for p in alone for t in p[0]]),
                        ("background mixed", [t for r in rounds for t in r.mixed_bg])):
        errors = eta_errors(group)
        if errors:
            print(f"estimated start, {what}: median error {statistics.median(errors):.0%} "
                  f"of the wait, p90 {pct(errors, 0.9):.0%} ({len(errors)} queued requests; "
                  "target median <= 25%)")
    first = eta_errors(alone[0][0])
    if first:
        print(f"  (the first batch on a fresh daemon: median error "
              f"{statistics.median(first):.0%})")


if __name__ == "__main__":
    main()
