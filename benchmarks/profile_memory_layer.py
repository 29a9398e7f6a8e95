"""Where one memory layer's training step spends its time: torch.profiler's operator table.

    .venv/bin/python benchmarks/profile_memory_layer.py [--n-keys 512] [--steps 5] [--device cuda] [--bf16] [--out FILE]

The settings of memory_layer_speed.py (d=512, heads 4, knn 32, k_dim 512, 4 x 256 tokens, sparse value
gradients, a random output gradient), `--steps` profiled forward + backward steps after 3 unprofiled
ones (--bf16: under bf16 autocast, as training in bf16 runs it); prints the operators by self CPU time
(on CUDA: by self device time, the kernels' own) and
writes the same table, with the settings, to --out (default dumped/bench/profile_memory_layer_<n_keys>.txt;
on CUDA ..._<n_keys>_cuda.txt).
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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true", help="forward under torch.autocast(dtype=bfloat16)")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    memory = ProductKeyMemory(512, 512, n_keys=args.n_keys, k_dim=512, heads=4, knn=32).to(device).train()
    memory.sparse_values = True
    x = torch.randn(4, 256, 512, device=device, requires_grad=True)  # (B, T, d)
    grad_out = torch.randn(4, 256, 512, device=device)  # (B, T, d)

    def step():
        for p in memory.parameters():
            p.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            out = memory(x)
        out.backward(grad_out.to(out.dtype))

    for _ in range(3):
        step()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=25, max_name_column_width=60)
    where = (f"{torch.cuda.get_device_name(device)}, value read backend {memory.read_backend}" if cuda
             else f"{torch.get_num_threads()} threads, "
                  f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    header = (f"memory layer forward + backward, |K| = {args.n_keys}^2, sparse values, 1,024 tokens, "
              f"{args.steps} steps{', bf16 autocast' if args.bf16 else ''}; torch {torch.__version__}, {where}\n")
    print(header + table)
    name = f"profile_memory_layer_{args.n_keys}{'_bf16' if args.bf16 else ''}{'_cuda' if cuda else ''}.txt"
    out = Path(args.out or ROOT / "dumped" / "bench" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + table + "\n")


if __name__ == "__main__":
    main()
