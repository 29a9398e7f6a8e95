"""FBGEMM's table-batched embeddings (TBE) beside our value read and row-wise Adagrad, on the same lookups, on the
CPU; written to dumped/bench/fbgemm_tbe_cpu.json.

    .venv/bin/python benchmarks/fbgemm_tbe.py [--n-keys 128 512] [--rounds 5] [--min-time 1.0] [--threads N]

Issue 81, item 5: TBE (fbgemm-gpu-cpu==1.8.0, requirements-bench.txt; SplitTableBatchedEmbeddingBagsCodegen with
EmbeddingLocation.HOST and ComputeDevice.CPU) does what the memory's value table does with
optim.values_optimizer=rowwise_adagrad: a weighted-sum read of selected rows (PoolingMode.SUM with
per_sample_weights) and OptimType.EXACT_ROWWISE_ADAGRAD fused into its backward (G[r] += mean(g_r²);
p[r] -= lr · g_r / (sqrt(G[r]) + eps)), with 16-bit rows rounded stochastically on the GPU.

The lookups, the same for both sides: N = batch x seq tokens, each reading heads x knn slots of an (n_keys², dim)
table, uniform at random, with softmax weights over each head's knn (a leaf that requires its gradient, as the
layer's scores do); a fixed random output gradient. Ours is the layer's read, value_read.read_values (torch
backend, sparse=True: one gradient row per distinct slot) with RowwiseAdagrad (optim.fused_values=false, the
default) or FusedRowwiseAdagrad (true) on it; TBE reads one bag per token of heads·knn entries (the layer's sum
over heads), bounds checks off. Per table size and row type, in interleaved rounds (median kept), tokens/s of:
  - forward: the read without gradients;
  - read_backward (ours only): forward + backward, the sparse gradient built, no update;
  - train_step: forward + backward + the update (TBE's update is its backward).
Row types: float32 on both sides; 16-bit: our bfloat16 table (model.memory.value_dtype=bfloat16, its gradient
float32, updates rounded stochastically) beside TBE's fp16 (SparseType.FP16, stochastic_rounding=True, which its
CPU update does not honour: it rounds to nearest): its CPU forward has no BF16 kernel (the JSON records the error).
The committed figures (benchmarks/results/fbgemm_tbe_cpu.json) ran with THP_MEM_ALLOC_ENABLE=1 (as train.py and
run_all.sh run) and --threads 1, the cores being shared.
Before timing, `check` runs one float32 step of each side from the same table and records the largest
differences of the output, the weights' gradient, the updated rows and the row accumulators
(tests/test_fbgemm_tbe.py holds the same check on a small table).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result
from timing import interleaved_rounds

from xlm_pkm.model.memory.value_read import read_values
from xlm_pkm.optim.fused_rows import FusedRowwiseAdagrad
from xlm_pkm.optim.rowwise_adagrad import RowwiseAdagrad

FBGEMM = "fbgemm-gpu-cpu==1.8.0"
LR, EPS = 0.01, 1e-8


def fbgemm():
    """FBGEMM's TBE classes, imported when used (a benchmark-only dependency); SystemExit in one line without it."""
    try:
        import fbgemm_gpu  # noqa: F401  (loads its operators into torch.ops.fbgemm)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as error:  # ImportError, or an OSError where its build does not match the installed torch
        raise SystemExit(f"benchmarks/fbgemm_tbe.py needs {FBGEMM} (pip install --no-deps -r requirements-bench.txt): "
                         f"{type(error).__name__}: {error}".splitlines()[0]) from None
    return argparse.Namespace(TBE=SplitTableBatchedEmbeddingBagsCodegen, EmbeddingLocation=EmbeddingLocation,
                              ComputeDevice=ComputeDevice, PoolingMode=PoolingMode, BoundsCheckMode=BoundsCheckMode,
                              OptimType=EmbOptimType, SparseType=SparseType)


def tbe_table(table: torch.Tensor, precision: str, lr: float = LR, eps: float = EPS):
    """A one-table TBE on the CPU holding `table`'s rows (rounded to its precision, "fp32" | "fp16" | "bf16"),
    with exact row-wise Adagrad fused into its backward and weighted-sum bags."""
    fb = fbgemm()
    rows, dim = table.shape
    tbe = fb.TBE([(rows, dim, fb.EmbeddingLocation.HOST, fb.ComputeDevice.CPU)],
                 weights_precision=getattr(fb.SparseType, precision.upper()),
                 optimizer=fb.OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps,
                 pooling_mode=fb.PoolingMode.SUM, stochastic_rounding=True,
                 bounds_check_mode=fb.BoundsCheckMode.NONE)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(table)  # a view of its flat weights_host
    return tbe


def tbe_read(tbe, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """indices, weights (N, L) -> (N, dim): one bag per token of its L lookups."""
    N, L = indices.shape
    offsets = torch.arange(0, N * L + 1, L, dtype=torch.int64)  # (N + 1,)
    return tbe(indices.reshape(-1), offsets, per_sample_weights=weights.reshape(-1))


def our_table(table: torch.Tensor, dtype: torch.dtype) -> torch.nn.Parameter:
    """table as the `table` store keeps it: a float32 parameter, or a bfloat16 one whose gradient is float32
    (model.memory.value_dtype=bfloat16, value_stores.TableValues)."""
    p = torch.nn.Parameter(table.detach().to(dtype, copy=True))  # never the caller's storage
    if dtype != torch.float32:
        p.grad_dtype = torch.float32
    return p


def lookups(n_tokens: int, heads: int, knn: int, n_slots: int, seed: int = 0):
    """indices (N, heads·knn) uniform in [0, n_slots), weights (N, heads·knn) a softmax over each head's knn,
    a leaf requiring its gradient."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, n_slots, (n_tokens, heads * knn), generator=g)
    weights = torch.randn(n_tokens, heads, knn, generator=g).softmax(-1).reshape(n_tokens, -1)
    return indices, weights.requires_grad_()


def ours_step(table, indices, weights, grad_out, optimizer=None, backward=True):
    def step():
        if not backward:
            with torch.no_grad():
                read_values(table, indices, weights, sparse=True)
            return
        table.grad = weights.grad = None
        read_values(table, indices, weights, sparse=True).backward(grad_out)
        if optimizer is not None:
            optimizer.step()
    return step


def tbe_step(tbe, indices, weights, grad_out, backward=True):
    def step():
        if not backward:
            with torch.no_grad():
                tbe_read(tbe, indices, weights)
            return
        weights.grad = None
        tbe_read(tbe, indices, weights).backward(grad_out)  # the rows are updated here
    return step


def check(table: torch.Tensor, indices, weights, grad_out) -> dict:
    """One float32 step of each side from the same table: the largest absolute differences."""
    ours, w_ours = our_table(table, torch.float32), weights.detach().clone().requires_grad_()
    optimizer = RowwiseAdagrad([ours], lr=LR, eps=EPS)
    out_ours = read_values(ours, indices, w_ours, sparse=True)
    out_ours.backward(grad_out)
    optimizer.step()
    tbe, w_tbe = tbe_table(table, "fp32"), weights.detach().clone().requires_grad_()
    out_tbe = tbe_read(tbe, indices, w_tbe)
    out_tbe.backward(grad_out)
    rows = indices.unique()
    result = {
        "output": (out_tbe - out_ours).abs().max().item(),
        "weights_grad": (w_tbe.grad - w_ours.grad).abs().max().item(),
        "table_after_one_update": (tbe.split_embedding_weights()[0] - ours.detach()).abs().max().item(),
        "largest_row_change": (ours.detach()[rows] - table[rows]).abs().max().item(),
        "row_accumulators": (tbe.split_optimizer_states()[0][0] - optimizer.state[ours]["row_sum"]).abs().max().item(),
        "output_scale": out_ours.abs().max().item(),
    }
    del tbe, ours, optimizer
    gc.collect()
    return {key: float(f"{value:.3g}") for key, value in result.items()}


def bf16_forward_error(table: torch.Tensor, indices, weights) -> str | None:
    """TBE's BF16 rows on the CPU: None if its forward runs, else its error (one line)."""
    try:
        tbe = tbe_table(table[:16], "bf16")
        with torch.no_grad():
            tbe_read(tbe, indices[:2] % 16, weights[:2])
    except Exception as error:  # its CPU forward dispatches on the row type and has no BFloat16 case
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


ENTRIES = [  # (mode, side, row type)
    ("forward", "ours", "float32"), ("forward", "tbe", "float32"),
    ("forward", "ours", "bfloat16"), ("forward", "tbe", "fp16"),
    ("read_backward", "ours", "float32"), ("read_backward", "ours", "bfloat16"),
    ("train_step", "ours", "float32"), ("train_step", "ours_fused", "float32"), ("train_step", "tbe", "float32"),
    ("train_step", "ours", "bfloat16"), ("train_step", "ours_fused", "bfloat16"), ("train_step", "tbe", "fp16"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-keys", type=int, nargs="+", default=[128, 512], help="table of n_keys² rows")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--knn", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds measured per entry and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurements per entry; median kept")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads, which TBE's CPU kernels use too "
                        "(default: torch's); 1 keeps timings steady on a machine whose cores others share")
    parser.add_argument("--out", help="default: dumped/bench/fbgemm_tbe_cpu.json")
    args = parser.parse_args()
    args.device = "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    n_tokens = args.batch * args.seq
    fbgemm()  # fails here, in one line, without it
    load_before = os.getloadavg()[0]

    rows, checks, bf16_error = [], [], None
    for n_keys in args.n_keys:
        n_slots = n_keys**2
        torch.manual_seed(0)
        table = torch.randn(n_slots, args.dim) / args.dim**0.5  # the table store's N(0, 1/dim)
        indices, weights = lookups(n_tokens, args.heads, args.knn, n_slots)
        grad_out = torch.randn(n_tokens, args.dim, generator=torch.Generator().manual_seed(1))
        checks.append({"n_keys": n_keys, "distinct_rows_read": indices.unique().numel(),
                       **check(table, indices, weights, grad_out)})
        print(f"|K|={n_keys}^2 check (tbe - ours, max abs): {checks[-1]}", flush=True)
        bf16_error = bf16_error or bf16_forward_error(table, indices, weights)

        ours = {name: our_table(table, dtype) for name, dtype in (("float32", torch.float32),
                                                                  ("bfloat16", torch.bfloat16))}
        tbes = {"float32": tbe_table(table, "fp32"), "fp16": tbe_table(table, "fp16")}
        del table
        optimizers = {(side, dtype): (FusedRowwiseAdagrad if side == "ours_fused" else RowwiseAdagrad)(
            [ours[dtype]], lr=LR, eps=EPS) for _, side, dtype in ENTRIES if side.startswith("ours")}
        steps = {}
        for mode, side, dtype in ENTRIES:
            if side == "tbe":
                steps[mode, side, dtype] = tbe_step(tbes[dtype], indices, weights, grad_out, mode != "forward")
            else:
                optimizer = optimizers[side, dtype] if mode == "train_step" else None
                steps[mode, side, dtype] = ours_step(ours[dtype], indices, weights, grad_out, optimizer,
                                                     mode != "forward")
        speeds = interleaved_rounds(steps, n_tokens, "cpu", args.min_time, args.rounds)
        for (mode, side, dtype), s in speeds.items():
            tps = statistics.median(s)
            rows.append({"mode": mode, "side": side, "rows": dtype, "n_keys": n_keys, "slots": n_slots,
                         "tokens_per_s": round(tps), "ms_per_step": round(n_tokens / tps * 1e3, 2),
                         "rounds": [round(x) for x in s]})
            print(f"|K|={n_keys:4d}^2  {mode:13s} {side:10s} {dtype:8s} {tps:10.0f} tokens/s "
                  f"{n_tokens / tps * 1e3:8.2f} ms", flush=True)
        del ours, tbes, optimizers, steps
        gc.collect()

    result = {
        "benchmark": "fbgemm_tbe",
        "settings": {"dim": args.dim, "heads": args.heads, "knn": args.knn, "batch": args.batch, "seq": args.seq,
                     "tokens_per_step": n_tokens, "lookups_per_step": n_tokens * args.heads * args.knn,
                     "lookups": "uniform at random; softmax weights over each head's knn, their gradient computed",
                     "optimizer": f"exact row-wise Adagrad, lr {LR}, eps {EPS}",
                     "ours": "value_read.read_values (torch backend, sparse=True) + RowwiseAdagrad (ours) or "
                             "FusedRowwiseAdagrad (ours_fused); bfloat16 rows rounded stochastically",
                     "tbe": f"{FBGEMM} SplitTableBatchedEmbeddingBagsCodegen, HOST/CPU, one bag per token, "
                            "PoolingMode.SUM + per_sample_weights, EXACT_ROWWISE_ADAGRAD, stochastic_rounding=True, "
                            "bounds checks off",
                     "min_time_s": args.min_time, "rounds": args.rounds,
                     "statistic": "median of interleaved rounds"},
        "machine": machine_info("cpu") | {"load_average_1min_before": round(load_before, 2)},
        "tbe_bf16_rows_on_cpu": bf16_error or "supported",
        "check": checks,
        "rows": rows,
        "ratios": ratios(rows),
    }
    write_result(result, args, "fbgemm_tbe")


def ratios(rows: list[dict]) -> list[dict]:
    """Per size, mode and row type: TBE's tokens/s over ours (over ours_fused too, for the train step)."""
    speed = {(r["mode"], r["side"], r["rows"], r["n_keys"]): r["tokens_per_s"] for r in rows}
    out = []
    for n in sorted({r["n_keys"] for r in rows}):
        for mode in ("forward", "train_step"):
            for pair, (ours, theirs) in {"float32": ("float32", "float32"), "16bit": ("bfloat16", "fp16")}.items():
                row = {"n_keys": n, "mode": mode, "rows": pair}
                for side in ("ours", "ours_fused"):
                    if (mode, side, ours, n) in speed:
                        row[f"tbe_over_{side}"] = round(speed[mode, "tbe", theirs, n] / speed[mode, side, ours, n], 3)
                out.append(row)
    return out


if __name__ == "__main__":
    main()
