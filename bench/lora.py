"""What LoRA adapters cost, in one run: the default model with a random rank-8 adapter on
its query and value projections (written here with ``gguf``: no adapter download), two
streams at a time, in-process.

Four cases, alternating, each ``--rounds`` times, every stream greedy with ``-n`` tokens
(end tokens banned, so each side generates exactly that many — checked before a ratio
is printed):

- base: no adapters loaded;
- zero: the adapter loaded, both streams at scale 0 (the base model's cells);
- same: both streams at scale 1 (one set: they share every step);
- mixed: one stream at 1, one at 0.5 (two sets: they take turns of ``LORA_TURN``
  steps, each turn reserving llama.cpp's graph again).

It prints each case's aggregate tok/s (the best round) and the ratios to base; mixed/same
is what mixed traffic costs (it is under 1: two streams that cannot share a step decode
about one at a time).

    .venv/bin/python bench/lora.py [--model GGUF] [-n 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import gguf
import numpy as np

from everycycle.engine.core.jobs import Job, JobSpec, Output, Sampling
from everycycle.engine.worker.runner import Runner
from everycycle.hardware.ggufwrite import write_lora
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol.sampling import Bias


def write_adapter(model: Path, out: Path, rank: int = 8) -> Path:
    """A random LoRA for ``model``'s attn_q and attn_v weights, shaped from its file."""
    reader = gguf.GGUFReader(str(model))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    rng = np.random.default_rng(7)

    def m(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.01).astype(np.float32)

    write_lora(gguf.GGUFWriter(str(out), arch),
               [(t.name, m(rank, int(t.shape[0])), m(int(t.shape[1]), rank))
                for t in reader.tensors
                if t.name.endswith((".attn_q.weight", ".attn_v.weight"))], float(rank))
    return out


def run(runner: Runner, scales: list[tuple[float, ...]], n: int, eog: list[int]) -> tuple[
        float, list[int]]:
    """Aggregate tok/s of one stream per entry of ``scales``, and each stream's count."""
    done = threading.Event()
    counts = [0] * len(scales)
    ended = [0]

    def notify(batch: list[tuple[Job, Output]]) -> None:
        for job, out in batch:
            counts[job.tag] += len(out.ids)
            if out.finished:
                ended[0] += 1
                if ended[0] == len(scales):
                    done.set()

    runner.loop.notify = notify
    bias = tuple(Bias(t, -100.0) for t in eog)
    jobs = [Job(JobSpec(tokens=runner.tokenize(f"Story {i}: once upon a time"), max_tokens=n,
                        lookup=False, lora=lora,
                        sampling=Sampling.of(temperature=0.0, logit_bias=bias)), tag=i)
            for i, lora in enumerate(scales)]
    started = time.perf_counter()
    with runner._cond:
        for job in jobs:
            runner.submit(job)
    done.wait()
    return sum(counts) / (time.perf_counter() - started), counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    reg = load_registry()
    model = args.model or local_file(reg.get(reg.default_name()))
    folder = Path(tempfile.mkdtemp(prefix="eclora"))
    adapter = write_adapter(model, folder / "adapter.gguf")
    plain = Runner(model, context=1024, parallel=2, notify=lambda b: None)
    tuned = Runner(model, context=1024, parallel=2, notify=lambda b: None, lora=[adapter])
    eog = [t for t in range(plain.vocab.n_vocab) if plain.vocab.is_eog(t)]
    cases = {"base": (plain, [(), ()]), "zero": (tuned, [(0.0,), (0.0,)]),
             "same": (tuned, [(1.0,), (1.0,)]), "mixed": (tuned, [(1.0,), (0.5,)])}
    best = dict.fromkeys(cases, 0.0)
    try:
        for r in range(args.rounds):
            for name, (runner, scales) in cases.items():
                rate, counts = run(runner, scales, args.n, eog)
                if counts != [args.n] * len(scales):
                    raise SystemExit(f"{name}: streams made {counts} tokens, not {args.n} "
                                     "each: not like for like")
                best[name] = max(best[name], rate)
                print(f"round {r + 1} {name:5}: {rate:7.1f} tok/s")
        switches = tuned.adapters.switches if tuned.adapters else 0
    finally:
        plain.close()
        tuned.close()
    print(f"model {model.name}, 2 streams x {args.n} tokens, best of {args.rounds}:")
    for name, rate in best.items():
        print(f"  {name:5} {rate:7.1f} tok/s  x{rate / best['base']:.2f} of base")
    print(f"  mixed/same {best['mixed'] / best['same']:.2f} (what two scale sets in flight "
          f"cost); adapter set switches: {switches}")


if __name__ == "__main__":
    main()
