"""Before and after in one run: a bench command on an older commit and on this tree,
alternating, and the ratio of their aggregate rates.

Checks out REV into a temporary git worktree, then runs the same bench (``bench/load.py``,
``bench/http.py``: anything that prints ``everycycle  N tok/s aggregate``) once per
round on each side, the older side first in odd rounds and second in even ones, with
``PYTHONPATH`` pointing at that side's tree (so the same virtualenv runs both). Prints
each round's rates, the medians, and after/before per round and of the medians.

    .venv/bin/python bench/ab.py --base 005164a --rounds 5 -- \\
        bench/load.py --model tiny.gguf -k 8 -n 1024 --rounds 1 --no-lookup
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATE = re.compile(r"^everycycle\s+([0-9.]+) tok/s aggregate", re.MULTILINE)


def rate(tree: Path, bench: list[str]) -> float:
    """The bench's aggregate tok/s, run from ``tree`` (its everycycle on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, *bench], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=1800, check=False)
    found = RATE.search(out.stdout)
    if out.returncode != 0 or found is None:
        sys.exit(f"bench/ab.py: {' '.join(bench)} in {tree} failed ({out.returncode}):\n"
                 f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("bench", nargs=argparse.REMAINDER,
                    help="-- then the bench and its arguments (paths as from the repo root)")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("give the bench command after --")
    bench = [str(Path(b).resolve()) if Path(b).exists() and not b.startswith("bench/")
             else b for b in bench]
    with tempfile.TemporaryDirectory(prefix="everycycle-ab") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(base), args.base], check=True)
        try:
            before: list[float] = []
            after: list[float] = []
            for i in range(args.rounds):
                sides = [(base, before), (ROOT, after)]
                for tree, rates in sides if i % 2 == 0 else sides[::-1]:
                    rates.append(rate(tree, bench))
                print(f"round {i + 1}: before {before[-1]:8.1f}  after {after[-1]:8.1f} "
                      f"tok/s  ratio {after[-1] / before[-1]:.3f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base)], check=False)
    b, a = statistics.median(before), statistics.median(after)
    ratios = sorted(x / y for x, y in zip(after, before, strict=True))
    print(f"{args.base} → this tree: median {b:.1f} → {a:.1f} tok/s, ratio of medians "
          f"{a / b:.3f}; per-round ratios {' '.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
