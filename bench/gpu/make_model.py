"""Write a random-weight llama GGUF for the GPU check (no weights travel to the device).

    python3 bench/gpu/make_model.py OUT.gguf [--layers 16] [--embd 2048] [--ff 5632]
                                             [--inert N]

With ``--inert N``, N more layers that write nothing to the residual stream: a target
that computes what the same command without them writes, a draft it always accepts.

Random f32 weights decode at the speed of real f32 weights; the check compares engines
on one file, so what the text says does not matter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from tinymodel import write_tiny_gguf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=5632)
    ap.add_argument("--inert", type=int, default=0)
    args = ap.parse_args()
    write_tiny_gguf(args.out, n_layer=args.layers, n_embd=args.embd, n_ff=args.ff,
                    n_head=args.embd // 64, inert_layers=args.inert)
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
