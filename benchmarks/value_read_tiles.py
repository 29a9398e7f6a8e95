"""The fused value read's kernels timed over tile shapes and warps, to choose the tiles by measurement.

    python3 benchmarks/value_read_tiles.py [--dtypes fp32 bf16] [--out FILE]     # on a GPU

The settings of value_read_bandwidth.py (16,384 tokens, 128 lookups each, 512² slots of dim 1024,
uniform slots). For each dtype, each kernel of xlm_pkm/model/memory/triton_value_read.py is launched
directly with every (rows, columns, num_warps) of its grid below, and its median time over --repeats
launches is written (`chosen`: the tile and warps the package launches; always timed), with GB/s over the bytes
the kernel must move (value_read_bandwidth.bytes_moved's, per kernel). The slot sort of the
backward (slot_groups.group_by_slot) is timed on its own. Writes dumped/bench/value_read_tiles_cuda.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result  # noqa: E402
from timing import median_seconds  # noqa: E402
from value_read_bandwidth import bytes_moved  # noqa: E402

from xlm_pkm.model.memory import triton_value_read as kernels  # noqa: E402
from xlm_pkm.model.memory.slot_groups import group_by_slot  # noqa: E402
from xlm_pkm.runtime.hardware import peak_memory_bandwidth  # noqa: E402
from xlm_pkm.runtime.precision import DTYPES  # noqa: E402

DTYPE_OF = {"fp32": torch.float32, **DTYPES}
GRIDS = {  # kernel: (rows per tile, columns per tile, warps) tried
    "read": ((16, 32, 64), (256, 512, 1024), (4, 8)),
    "weights_grad": ((16, 32), (64, 128, 256), (2, 4)),
    "table_grad": ((4, 8, 16), (128, 256, 512), (2, 4)),
}


def launchers(table, indices, weights, grad_out):
    """{kernel: (launch(rows, cols, warps), the package's (rows, cols, warps), the bytes it must move)}."""
    (N, L), D = indices.shape, table.shape[1]
    elem, lookups = table.element_size(), N * L
    out = torch.empty(N, D, dtype=table.dtype, device=table.device)
    grad_w = torch.empty(N, L, dtype=weights.dtype, device=table.device)
    slots, order, row_starts = group_by_slot(indices)
    U = slots.numel()
    rows = torch.empty(U, D, dtype=table.dtype, device=table.device)
    moved = bytes_moved(N, L, D, table.shape[0], U, elem)  # the weights' gradient moves what the read does

    def read(r, c, w):
        kernels._read_kernel[(N, triton.cdiv(D, c))](table, indices, weights, out, L, D, BLOCK_L=r, BLOCK_D=c,
                                                      num_warps=w)

    def weights_grad(r, c, w):
        kernels._weights_grad_kernel[(N, triton.cdiv(L, r))](table, indices, grad_out, grad_w, L, D,
                                                              BLOCK_L=r, BLOCK_D=c, num_warps=w)

    def table_grad(r, c, w):
        kernels._table_grad_kernel[(U, triton.cdiv(D, c))](grad_out, weights, order, row_starts, rows, L, D,
                                                            BLOCK_E=r, BLOCK_D=c, num_warps=w)

    table_tile = kernels._grad_blocks(lookups / U, D, kernels.TABLE_GRAD_ROWS)
    return {"read": (read, (*kernels._blocks(L, D, elem), 4), moved["forward"]),
            "weights_grad": (weights_grad, (*kernels._grad_blocks(L, D), 4), moved["forward"]),
            "table_grad": (table_grad, (*table_tile, kernels.TABLE_GRAD_WARPS), moved["backward_sparse"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--n-keys", type=int, default=512)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--lookups", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPE_OF))
    parser.add_argument("--kernels", nargs="+", default=list(GRIDS), choices=list(GRIDS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="default: dumped/bench/value_read_tiles_<device>.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    slots = args.n_keys**2
    gen = torch.Generator(device=device).manual_seed(0)
    indices = torch.randint(0, slots, (args.tokens, args.lookups), device=device, generator=gen)  # (N, L)
    weights = torch.softmax(torch.randn(args.tokens, args.lookups, device=device, generator=gen), -1)  # (N, L)
    peak = peak_memory_bandwidth(device)
    sort_s = median_seconds(lambda: group_by_slot(indices), args.repeats, warmup=2, device=device)
    print(f"group_by_slot {sort_s * 1e3:.3f} ms", flush=True)
    rows = []
    for name in args.dtypes:
        table = torch.randn(slots, args.dim, device=device, generator=gen).to(DTYPE_OF[name])  # (slots, dim)
        grad_out = torch.randn(args.tokens, args.dim, device=device, generator=gen).to(DTYPE_OF[name])  # (N, dim)
        for kernel, (launch, chosen, moved) in launchers(table, indices, weights, grad_out).items():
            if kernel not in args.kernels:
                continue
            for r, c, w in sorted({*itertools.product(*GRIDS[kernel]), chosen}):
                if r * c > 65536:  # past the registers of a program
                    continue
                seconds = median_seconds(functools.partial(launch, r, c, w), args.repeats, warmup=2, device=device)
                gbps = moved / seconds / 1e9
                rows.append({"dtype": name, "kernel": kernel, "rows": r, "cols": c, "warps": w,
                             "chosen": (r, c, w) == chosen, "ms": round(seconds * 1e3, 4),
                             "GB_per_s": round(gbps, 1),
                             "fraction_of_peak": round(gbps * 1e9 / peak, 3) if peak else None})
                print(f"{name:5s} {kernel:13s} {r:3d} x {c:5d} w{w} {seconds * 1e3:8.3f} ms {gbps:7.0f} GB/s"
                      f"{'  (chosen)' if rows[-1]['chosen'] else ''}", flush=True)
        del table, grad_out
    result = {"benchmark": "value_read_tiles",
              "settings": {"tokens": args.tokens, "lookups_per_token": args.lookups, "slots": slots, "dim": args.dim,
                           "repeats": args.repeats, "statistic": "median", "grids": GRIDS},
              "machine": machine_info(args.device),
              "peak_memory_bandwidth_GB_per_s": peak / 1e9 if peak else None,
              "group_by_slot_ms": round(sort_s * 1e3, 4),
              "results": rows}
    write_result(result, args, "value_read_tiles")


if __name__ == "__main__":
    main()
