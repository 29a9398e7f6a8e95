"""Achieved memory bandwidth of the memory's value read, fused Triton kernels vs nn.EmbeddingBag.

    .venv/bin/python benchmarks/value_read_bandwidth.py [--device cuda] [--dtypes fp32 bf16 fp16]

For N tokens each reading L = heads·knn rows of a (slots, dim) table (the paper's 512² slots, dim
1024, 4 heads × k=32 by default), three passes are timed per implementation and dtype:
  - forward: out = Σ w · table[idx];
  - backward, both gradients (the table's and the weights', as in training), the table's as sparse rows (one per
    distinct slot; torch: the slot-sorted embedding bag of value_read.py);
  - the same with a dense (slots, dim) table gradient (torch: EmbeddingBag's own backward).
The Triton backward runs with each --read-backward (two_pass: a kernel per gradient; one_pass: one kernel
reading each row once).
Bytes counted are those each pass must move at least: for the forward the value rows gathered (N·L·dim: rows
are read again by later lookups, which a table larger than the L2 cannot keep) and the output written (N·dim);
for a backward each row once: the output gradient read (N·dim, the L2 serves its later reads), each distinct
table row read for the weights' gradient (U·dim), the table's gradient written (U·dim sparse, slots·dim dense),
the weights' gradient written (4 bytes a lookup); indices and weights read (12 bytes a lookup) in every pass.
Achieved GB/s = bytes / median time, beside the device's peak (xlm_pkm.runtime.hardware): "fraction_of_peak"
is the share of that floor reached. Indices are uniform over the slots. Writes
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


def measure(table, indices, weights, grad_out, backend: str, read_backward: str, repeats: int) -> dict[str, float]:
    """{pass: seconds} for the forward and both backwards of one implementation."""
    device = table.device
    table, weights = table.requires_grad_(), weights.requires_grad_()
    with torch.no_grad():
        times = {"forward": median_seconds(lambda: read_values(table, indices, weights, False, backend),
                                           repeats, warmup=2, device=device)}
    for sparse in (True, False):
        out = read_values(table, indices, weights, sparse, backend, read_backward)

        def backward(out=out):
            table.grad = weights.grad = None
            out.backward(grad_out, retain_graph=True)

        try:
            times["backward_sparse" if sparse else "backward_dense"] = median_seconds(backward, repeats, warmup=2,
                                                                                     device=device)
        except NotImplementedError as e:  # torch's EmbeddingBag: no half-precision weights' gradient on CUDA
            print(f"{backend} {table.dtype} backward: {e}", flush=True)
    table.grad = weights.grad = None
    return times


def bytes_moved(tokens: int, lookups: int, dim: int, slots: int, distinct: int, elem: int) -> dict[str, int]:
    """Each pass's floor (the module docstring)."""
    per_lookup = tokens * lookups * INDEX_BYTES
    backward = per_lookup + tokens * dim * elem + distinct * dim * elem + tokens * lookups * 4
    return {"forward": per_lookup + tokens * lookups * dim * elem + tokens * dim * elem,
            "backward_sparse": backward + distinct * dim * elem,
            "backward_dense": backward + slots * dim * elem}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16384, help="N: tokens per step (batch × bptt)")
    parser.add_argument("--n-keys", type=int, default=512, help="slots = n_keys²")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--lookups", type=int, default=128, help="L = heads × knn rows per token")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPE_OF))
    parser.add_argument("--backends", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    parser.add_argument("--read-backward", nargs="+", default=["two_pass", "one_pass"],
                        choices=["two_pass", "one_pass"], help="the Triton backwards timed")
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
        for backend, read_backward in [(b, r) for b in backends for r in (args.read_backward if b == "triton"
                                                                           else ["two_pass"])]:
            for op, seconds in measure(table, indices, weights, grad_out, backend, read_backward,
                                       args.repeats).items():
                gbps = moved[op] / seconds / 1e9
                rows.append({"dtype": name, "backend": backend, "read_backward": read_backward, "pass": op,
                             "ms": round(seconds * 1e3, 4), "bytes": moved[op], "GB_per_s": round(gbps, 1),
                             "fraction_of_peak": round(gbps * 1e9 / peak, 3) if peak else None})
                print(f"{name:5s} {backend:7s} {read_backward:8s} {op:16s} {seconds * 1e3:9.3f} ms {gbps:8.1f} GB/s",
                      flush=True)
        del table, grad_out

    result = {
        "benchmark": "value_read_bandwidth",
        "settings": {"tokens": args.tokens, "lookups_per_token": args.lookups, "slots": slots, "dim": args.dim,
                     "distinct_slots_read": distinct, "repeats": args.repeats, "statistic": "median",
                     "bytes": "each pass's floor: the module docstring (backwards: every row once, both gradients)",
                     "backends": {"triton": "xlm_pkm/model/memory/triton_value_read.py",
                                  "torch": "nn.EmbeddingBag (+ a slot-sorted EmbeddingBag for sparse rows)"}},
        "machine": machine_info(args.device),
        "peak_memory_bandwidth_GB_per_s": peak / 1e9 if peak else None,
        "results": rows,
    }
    write_result(result, args, "value_read_bandwidth")


if __name__ == "__main__":
    main()
