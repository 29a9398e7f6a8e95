"""Achieved memory bandwidth of the memory's value read, fused Triton kernels vs nn.EmbeddingBag.

    .venv/bin/python benchmarks/value_read_bandwidth.py [--device cuda] [--dtypes fp32 bf16 fp16]

For N tokens each reading L = heads·knn rows of a (slots, dim) table (the paper's 512² slots, dim
1024, 4 heads × k=32 by default), three passes are timed per implementation and dtype:
  - forward: out = Σ w · table[idx];
  - backward to the table (sparse rows: one per distinct slot; torch: the slot-sorted embedding bag of value_read.py);
  - backward to the table (dense (slots, dim) gradient; torch: EmbeddingBag's own backward).
Bytes counted are those the operation must move at least: the value rows gathered (N·L·dim) and the
output written (N·dim) for the forward; the gradient rows gathered (N·L·dim) and the distinct table
rows written (U·dim, or slots·dim when dense) for the backward; indices and weights (12 bytes a
lookup) for both. Achieved GB/s = bytes / median time, beside the device's peak (xlm_pkm.runtime.hardware),
so that "fraction_of_peak" is the issue's ≥ 70% target. Indices are uniform over the slots: rows
are read from HBM, not from cache, for tables larger than the L2. Writes
dumped/bench/value_read_bandwidth_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result  # noqa: E402
from timing import median_seconds  # noqa: E402

from xlm_pkm.model.memory.value_read import read_values, triton_usable  # noqa: E402
from xlm_pkm.runtime.hardware import peak_memory_bandwidth  # noqa: E402
from xlm_pkm.runtime.precision import DTYPES  # noqa: E402

DTYPE_OF = {"fp32": torch.float32, **DTYPES}
INDEX_BYTES = 8 + 4  # an int64 index and a float32 weight per lookup


def measure(table, indices, weights, grad_out, backend: str, repeats: int) -> dict[str, float]:
    """{pass: seconds} for the forward and both backwards of one implementation."""
    device = table.device
    table = table.requires_grad_()
    times = {"forward": median_seconds(lambda: read_values(table, indices, weights, False, backend),
                                       repeats, warmup=2, device=device)}
    for sparse in (True, False):
        out = read_values(table, indices, weights, sparse, backend)

        def backward(out=out):
            table.grad = None
            out.backward(grad_out, retain_graph=True)

        times["backward_sparse" if sparse else "backward_dense"] = median_seconds(backward, repeats, warmup=2,
                                                                                 device=device)
    table.grad = None
    return times


def bytes_moved(tokens: int, lookups: int, dim: int, slots: int, distinct: int, elem: int) -> dict[str, int]:
    gathered = tokens * lookups * dim * elem + tokens * lookups * INDEX_BYTES
    return {"forward": gathered + tokens * dim * elem,
            "backward_sparse": gathered + distinct * dim * elem,
            "backward_dense": gathered + slots * dim * elem}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16384, help="N: tokens per step (batch × bptt)")
    parser.add_argument("--n-keys", type=int, default=512, help="slots = n_keys²")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--lookups", type=int, default=128, help="L = heads × knn rows per token")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPE_OF))
    parser.add_argument("--backends", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="default: dumped/bench/value_read_bandwidth_<cpu|cuda>.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    backends = [b for b in args.backends if b == "torch" or triton_usable(device)]
    slots = args.n_keys**2
    gen = torch.Generator(device=device).manual_seed(0)
    indices = torch.randint(0, slots, (args.tokens, args.lookups), device=device, generator=gen)  # (N, L)
    weights = torch.softmax(torch.randn(args.tokens, args.lookups, device=device, generator=gen), -1)  # (N, L)
    distinct = torch.unique(indices).numel()
    peak = peak_memory_bandwidth(device)

    rows = []
    for name in args.dtypes:
        dtype = DTYPE_OF[name]
        table = torch.randn(slots, args.dim, device=device, generator=gen).to(dtype)  # (slots, dim)
        grad_out = torch.randn(args.tokens, args.dim, device=device, generator=gen).to(dtype)  # (N, dim)
        moved = bytes_moved(args.tokens, args.lookups, args.dim, slots, distinct, dtype.itemsize)
        for backend in backends:
            for op, seconds in measure(table, indices, weights, grad_out, backend, args.repeats).items():
                gbps = moved[op] / seconds / 1e9
                rows.append({"dtype": name, "backend": backend, "pass": op, "ms": round(seconds * 1e3, 4),
                             "bytes": moved[op], "GB_per_s": round(gbps, 1),
                             "fraction_of_peak": round(gbps * 1e9 / peak, 3) if peak else None})
                print(f"{name:5s} {backend:7s} {op:16s} {seconds * 1e3:9.3f} ms {gbps:8.1f} GB/s", flush=True)
        del table, grad_out

    result = {
        "benchmark": "value_read_bandwidth",
        "settings": {"tokens": args.tokens, "lookups_per_token": args.lookups, "slots": slots, "dim": args.dim,
                     "distinct_slots_read": distinct, "repeats": args.repeats, "statistic": "median",
                     "backends": {"triton": "xlm_pkm/model/memory/triton_value_read.py",
                                  "torch": "nn.EmbeddingBag (+ a slot-sorted EmbeddingBag for sparse rows)"}},
        "machine": machine_info(args.device),
        "peak_memory_bandwidth_GB_per_s": peak / 1e9 if peak else None,
        "results": rows,
    }
    write_result(result, args, "value_read_bandwidth")


if __name__ == "__main__":
    main()
