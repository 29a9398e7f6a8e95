"""Fixed work for timing huge pages as whole processes: whole sparse steps of the one-layer benchmark.

    THP_MEM_ALLOC_ENABLE=0 .venv/bin/python benchmarks/huge_pages.py [--n-keys 512] [--steps 20]
    THP_MEM_ALLOC_ENABLE=1 .venv/bin/python benchmarks/huge_pages.py [--n-keys 512] [--steps 20]

PyTorch reads THP_MEM_ALLOC_ENABLE once per process, so the two settings are compared across processes:
time each command as a whole (e.g. /usr/bin/time -v), in turns, A B A B, and compare the medians. The
step is memory_layer_speed.py's "whole step" of our layer (forward, backward with sparse value gradients,
LazyAdam on the values, Adam on the rest); the command prints its own median step time too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from memory_layer_speed import DIM, build, optimizers_of, train_step
from timing import median_seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-keys", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="measured steps, after 2 of warm-up")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, DIM, requires_grad=True)
    grad_out = torch.randn(args.batch, args.seq, DIM)
    memory = build("product", args.n_keys).train()
    step = train_step(memory, x, grad_out, sparse=True, optimizers=optimizers_of(memory))
    seconds = median_seconds(step, steps=args.steps, warmup=2)
    print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')} |K|={args.n_keys}^2 "
          f"whole sparse step {seconds * 1e3:.1f} ms (median of {args.steps})", flush=True)


if __name__ == "__main__":
    main()
