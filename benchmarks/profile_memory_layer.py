"""Where one memory layer's training step spends its time: torch.profiler's operator table.

    .venv/bin/python benchmarks/profile_memory_layer.py [--n-keys 512] [--steps 5] [--out FILE]

The settings of memory_layer_speed.py (d=512, heads 4, knn 32, k_dim 512, 4 x 256 tokens, sparse value
gradients, a random output gradient), `--steps` profiled forward + backward steps after 3 unprofiled
ones; prints the operators by self CPU time and writes the same table, with the settings, to --out
(default dumped/bench/profile_memory_layer_<n_keys>.txt).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from xlm_pkm.model.memory.pkm import ProductKeyMemory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-keys", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    memory = ProductKeyMemory(512, 512, n_keys=args.n_keys, k_dim=512, heads=4, knn=32).train()
    memory.sparse_values = True
    x, grad_out = torch.randn(4, 256, 512, requires_grad=True), torch.randn(4, 256, 512)

    def step():
        for p in memory.parameters():
            p.grad = None
        memory(x).backward(grad_out)

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    header = (f"memory layer forward + backward, |K| = {args.n_keys}^2, sparse values, 1,024 tokens, "
              f"{args.steps} steps; torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}\n")
    print(header + table)
    out = Path(args.out or ROOT / "dumped" / "bench" / f"profile_memory_layer_{args.n_keys}.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + table + "\n")


if __name__ == "__main__":
    main()
