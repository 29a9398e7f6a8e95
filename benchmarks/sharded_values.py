"""Sharded vs replicated memory values (model.memory.shard_values): peak memory per rank and step time
on W processes, the largest memory that trains in a memory budget, and the bytes each rank sends.

    .venv/bin/python benchmarks/sharded_values.py [--worlds 2 4] [--n-keys 256 512] [--budget-gib 19] [--verify]

The model is one transformer layer of --dim (1024) whose FFN is a memory of n_keys² slots with the
paper's heads 4, knn 32, k_dim 512; --batch × --seq random tokens per rank. One step is the
trainer's: DDP forward/backward (values left out of DDP, distributed.data_parallel), the values'
gradients averaged (distributed.average_value_grads_), clipped update of every optimizer group
(train_step.optimizer_update), for each --values optimizer (lazy_adam: sparse rows; adam: dense).
Each entry runs W fresh processes (gloo on the CPU, NCCL on GPUs); a rank's peak memory is its
peak resident set (ru_maxrss, CPU) or torch.cuda.max_memory_allocated (GPU); the step time is the
median over --steps after --warmup, measured on rank 0 between barriers.

Largest n_keys: per (mode, W, optimizer), peak = a + b · slots fitted through the two --n-keys
sizes (the second lowered where the first predicts it would pass 80% of the budget); the largest
n_keys with W · peak <= --budget-gib (all ranks share this machine's memory).
--verify then trains 3 steps at that n_keys in each mode and records its measured peak.

Communication: bytes each rank sends per token (forward + backward) for the paper's memory, by
dimension (this implementation), by slot (the alternative), and for the replicated table's
gradient synchronisation per step (DDP all-reduce of a dense gradient; all-gather of sparse rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result

from xlm_pkm.config import load_config
from xlm_pkm.optim.optimizers import value_optimizer
from xlm_pkm.runtime.distributed import (
    average_value_grads_,
    data_parallel,
    free_port,
    init_distributed,
    shutdown,
    synced_values,
)
from xlm_pkm.runtime.precision import grad_scaler
from xlm_pkm.train.build import build_model, build_optimizers
from xlm_pkm.train.step import loss_backward, optimizer_update

GIB = 2**30


def overrides(args, n_keys: int, shard: bool, values: str) -> list[str]:
    return [f"model.dim={args.dim}", "model.n_layers=1", "model.n_heads=16", f"model.vocab_size={args.vocab}",
            "model.mem_layers=[1]", f"model.max_len={args.seq}", f"model.memory.n_keys={n_keys}",
            f"model.memory.shard_values={str(shard).lower()}", f"optim.values_optimizer={values}",
            f"train.device={args.device}"]


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: kilobytes


def rank_main(rank: int, world: int, port: int, entry: dict, args, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    env = init_distributed(device)
    before = peak_gib(device)
    cfg = load_config(None, overrides(args, entry["n_keys"], entry["mode"] == "sharded", entry["values"]))
    model = build_model(cfg, device)
    optimizers = build_optimizers(model, cfg)
    synced = synced_values(model, value_optimizer(cfg.optim).sparse)
    forward = data_parallel(model, synced, device) if env.is_distributed else model  # one rank: no group to join
    scaler = grad_scaler("fp32", device)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(rank))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    times = []
    for step in range(1, entry["warmup"] + entry["steps"] + 1):
        if env.is_distributed:
            dist.barrier()
        start = time.perf_counter()
        optimizers.set_step(step)
        loss = loss_backward(forward, x, y, "fp32", device, scaler)
        average_value_grads_(synced, env)
        optimizer_update(optimizers, scaler, loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    result = {"rank": rank, "peak_gib": peak_gib(device), "before_model_gib": before,
              "step_s": statistics.median(times[entry["warmup"]:]), "loss": float(loss),
              "values_per_rank": sum(p.numel() for p in model.memory_value_parameters())}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))
    del forward
    shutdown()


def measure(entry: dict, args) -> dict:
    """Runs `entry` (mode, world, n_keys, values, warmup, steps) on fresh processes."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(entry["world"], free_port(), entry, args, folder), nprocs=entry["world"])
        ranks = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(entry["world"])]
    out = {**entry, "slots": entry["n_keys"] ** 2, "peak_gib_per_rank": [round(r["peak_gib"], 3) for r in ranks],
           "peak_gib_max": round(max(r["peak_gib"] for r in ranks), 3),
           "peak_gib_all_ranks": round(sum(r["peak_gib"] for r in ranks), 3),
           "before_model_gib": round(max(r["before_model_gib"] for r in ranks), 3),
           "step_s": round(ranks[0]["step_s"], 4), "loss": ranks[0]["loss"],
           "values_per_rank": ranks[0]["values_per_rank"]}
    print(json.dumps(out), flush=True)
    return out


def safe_n_keys(small: dict, n_keys: int, budget_gib: float) -> int:
    """n_keys, or less if the ranks' peak there, extrapolated from `small` (from its memory before the
    model, proportionally to the slots), would pass 80% of the budget (all ranks share this machine)."""
    before = small["before_model_gib"]
    per_slot = (small["peak_gib_max"] - before) / small["slots"]
    fits = math.isqrt(int((0.8 * budget_gib / small["world"] - before) / per_slot))
    return min(n_keys, fits)


def largest_n_keys(small: dict, large: dict, budget_gib: float) -> int:
    """The largest n_keys with world · (a + b · slots) <= budget, from two measured sizes."""
    per_slot = (large["peak_gib_max"] - small["peak_gib_max"]) / (large["slots"] - small["slots"])
    base = small["peak_gib_max"] - per_slot * small["slots"]
    return int(math.isqrt(int((budget_gib / small["world"] - base) / per_slot)))


def communication(heads=4, knn=32, dim=1024, worlds=(2, 4, 8, 32), tokens_per_rank=32 * 256,
                  n_keys=1024, value_bytes=4) -> list[dict]:
    """Bytes each rank sends per token of its batch, forward + backward, for one memory.

    by dimension: the all-gather of the lookups (int32 index + float32 weight: 8 B each, sent to the
    W-1 other ranks, counted as received by each), the all-to-all of the output and of its gradient
    ((W-1)/W · dim values each), the reduce-scatter of the weights' partial gradients ((W-1) · L
    floats). by slot: each lookup to the owner of its slot, and back a partial output row of dim
    values per distinct owner the token reads from (expected W(1 - (1 - 1/W)^L)), minus its own, twice
    (forward, backward). Replicated, per step over the tokens of a rank's step: a ring all-reduce of
    the dense gradient sends 2(W-1)/W of the table; the sparse all-gather sends the rank's distinct
    rows (with the expected number of distinct slots of tokens · L uniform reads) to every other rank."""
    lookups, slots, rows = heads * knn, n_keys**2, []
    for w in worlds:
        by_dim = (w - 1) * lookups * 8 + 2 * (w - 1) / w * dim * value_bytes + (w - 1) * lookups * 4
        owners = w * (1 - (1 - 1 / w) ** lookups)
        by_slot = lookups * (8 + 4) * (w - 1) / w + 2 * owners * (w - 1) / w * dim * value_bytes
        distinct = slots * (1 - math.exp(-tokens_per_rank * lookups / slots))
        rows.append({"world": w, "by_dimension_bytes_per_token": round(by_dim),
                     "by_slot_bytes_per_token": round(by_slot),
                     "replicated_dense_allreduce_bytes_per_token": round(2 * (w - 1) / w * slots * dim * value_bytes
                                                                         / tokens_per_rank),
                     "replicated_sparse_allgather_bytes_per_token": round((w - 1) * distinct * (dim * value_bytes + 8)
                                                                          / tokens_per_rank)})
    return [{"heads": heads, "knn": knn, "dim": dim, "n_keys": n_keys, "tokens_per_rank_step": tokens_per_rank,
             "value_bytes": value_bytes, "rows": rows}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--n-keys", type=int, nargs=2, default=[256, 512], help="two sizes: speed and the fit")
    parser.add_argument("--values", nargs="+", default=["lazy_adam", "adam"])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-gib", type=float, default=19.0, help="memory all ranks may use together")
    parser.add_argument("--verify", action="store_true", help="train at the largest n_keys of each mode")
    parser.add_argument("--out", help="default: dumped/bench/sharded_values_<cpu|cuda>.json")
    args = parser.parse_args()
    entries, largest = [], []
    for world in args.worlds:
        for values in args.values:
            for mode in ("replicated", "sharded"):
                entry = {"mode": mode, "world": world, "values": values, "warmup": args.warmup, "steps": args.steps}
                small = measure({**entry, "n_keys": args.n_keys[0]}, args)
                large = measure({**entry, "n_keys": safe_n_keys(small, args.n_keys[1], args.budget_gib)}, args)
                entries += [small, large]
                found = {"mode": mode, "world": world, "values": values, "budget_gib": args.budget_gib,
                         "n_keys": largest_n_keys(small, large, args.budget_gib)}
                if args.verify:
                    found["verified"] = measure({"mode": mode, "world": world, "n_keys": found["n_keys"],
                                                 "values": values, "warmup": 1, "steps": 2}, args)
                largest.append(found)
                print(json.dumps(found), flush=True)
    result = {"benchmark": "sharded_values", "machine": machine_info(args.device), "command": " ".join(sys.argv),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "entries": entries,
              "largest_n_keys": largest, "communication": communication()}
    write_result(result, args, "sharded_values")


if __name__ == "__main__":
    main()
