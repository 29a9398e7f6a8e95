"""Speed of one memory layer beside a dense FFN and the PyPI product-key-memory, with its memory-traffic
floor; written to dumped/bench/memory_layer_speed_<cpu|cuda>.json.

    .venv/bin/python benchmarks/memory_layer_speed.py [--device cpu|cuda] [--rounds 5] [--min-time 1.0]

At d=512, heads=4, knn=32, k_dim=512, 4 x 256 tokens, for |K| = 128²..1024², all in one run and in
interleaved rounds (median kept), tokens/s of:
  - train: forward + backward, a fixed random output gradient, gradients dropped between steps as
    zero_grad() does: the FFN (d -> 4d -> d, GELU), our ProductKeyMemory with dense and with sparse value
    gradients, product-key-memory==0.3.0 (lucidrains; requirements-bench.txt);
  - train_step: the same plus the optimizer step: ours sparse with LazyAdam on the values and Adam on
    the rest, the package and the FFN with torch.optim.Adam;
  - inference: forward without gradients.
With --settings KEY=VALUE... (model.memory fields, e.g. pair_candidates=winnable) our layer is measured a second
time with them, "pkm_settings", in the same interleaved rounds; with --fused-values its step's values optimizer
is FusedLazyAdam (optim.fused_values) instead of LazyAdam.
The run also measures the machine: its copy bandwidth (a 512 MB tensor copied) and its matmul rate at
the query network's shape. The floor of our sparse training step is its bytes moved at that bandwidth
plus its matmul FLOPs at that rate (`traffic_model`), and each size reports the fraction of it reached.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result
from timing import interleaved_rounds, synchronizer

from xlm_pkm.model.memory.pkm import ProductKeyMemory
from xlm_pkm.optim.fused_rows import FusedLazyAdam
from xlm_pkm.optim.lazy_adam import LazyAdam

DIM, HEADS, KNN, K_DIM = 512, 4, 32, 512
PEER = "lucidrains_pkm_0.3.0"


def build(name: str, n_keys: int, settings: dict | None = None):
    if name == "dense_ffn":
        return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
    if name == PEER:
        from product_key_memory import PKM
        return PKM(DIM, heads=HEADS, num_keys=n_keys, topk=KNN, dim_head=K_DIM // 2)
    return ProductKeyMemory(DIM, DIM, n_keys=n_keys, k_dim=K_DIM, heads=HEADS, knn=KNN, **(settings or {}))


def optimizers_of(module, fused_values: bool = False) -> list:
    """LazyAdam (or FusedLazyAdam) on our values and Adam on the rest (the trainer's split); Adam on everything
    otherwise."""
    if isinstance(module, ProductKeyMemory):
        values = module.values.weight
        values_optimizer = (FusedLazyAdam if fused_values else LazyAdam)([values], lr=1e-3)
        return [values_optimizer, torch.optim.Adam([p for p in module.parameters() if p is not values])]
    return [torch.optim.Adam(module.parameters())]


def parse_settings(items: list[str]) -> dict:
    """KEY=VALUE strings -> the model.memory fields they set, values read as YAML (winnable, 1e-3, true)."""
    import yaml

    if any("=" not in item for item in items):
        raise SystemExit(f"--settings takes KEY=VALUE, got {items}")
    return {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in items)}


def train_step(module, x, grad_out, sparse: bool | None = None, optimizers: list | None = None):
    def step():
        if sparse is not None:  # one ProductKeyMemory measured with both kinds of value gradient
            module.sparse_values = sparse
        for p in module.parameters():
            p.grad = None
        module(x).backward(grad_out)
        for optimizer in optimizers or []:
            optimizer.step()
    return step


def inference_step(module, x):
    @torch.no_grad()
    def step():
        module(x)
    return step


def copy_bandwidth(device: str, mbytes: int = 512, reps: int = 5) -> float:
    """GB/s of a large tensor copy (bytes read + written), median of reps."""
    src = torch.randn(mbytes * 2**20 // 4, device=device)
    dst, sync, times = torch.empty_like(src), synchronizer(device), []
    for _ in range(reps + 1):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times[1:]) / 1e9


def matmul_rate(n_tokens: int, device: str, reps: int = 5) -> float:
    """GFLOP/s of the query network's matmul, (tokens, d) @ (d, heads·k_dim), median of reps."""
    a, b = torch.randn(n_tokens, DIM, device=device), torch.randn(DIM, HEADS * K_DIM, device=device)
    sync, times = synchronizer(device), []
    for _ in range(reps + 1):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    return 2 * n_tokens * DIM * HEADS * K_DIM / statistics.median(times[1:]) / 1e9


def traffic_model(n_tokens: int, n_keys: int, rows_read: int, sub_keys_read: int) -> dict:
    """What one sparse forward + backward of our layer must move and compute at least (float32), per term.

    Bytes: the value rows gathered twice (forward read; the per-lookup weight gradient), the output and
    its gradient, the sparse gradient's distinct rows written, the sub-key scores written and read by
    their top-k, the selected sub-key rows and queries read again by the search's backward. FLOPs: the
    query network (forward and both backward products) and the sub-key scores."""
    lookups, f = n_tokens * HEADS * KNN, 4
    half = K_DIM // 2
    bytes_moved = {
        "value_rows_read_twice": 2 * lookups * DIM * f,
        "output_and_its_gradient": 2 * n_tokens * DIM * f,
        "sparse_gradient_rows_written": rows_read * DIM * f,
        "sub_key_scores_written_and_read": 2 * n_tokens * 2 * HEADS * n_keys * f,
        "search_backward_rows": 2 * n_tokens * 2 * HEADS * KNN * half * f + sub_keys_read * half * f,
        "lookup_indices_and_weights": 3 * lookups * 12,
    }
    flops = {"query_network": 3 * 2 * n_tokens * DIM * HEADS * K_DIM,
             "sub_key_scores": 2 * n_tokens * 2 * HEADS * n_keys * half}
    return {"bytes": bytes_moved, "total_bytes": sum(bytes_moved.values()), "flops": flops,
            "total_flops": sum(flops.values())}


def distinct_reads(memory: ProductKeyMemory, x: torch.Tensor) -> tuple[int, int]:
    """(distinct value rows, distinct sub-keys) the batch reads."""
    with torch.no_grad():
        q = memory.normalize_queries(memory.query_net(x.view(-1, DIM)))  # (N, H, k_dim)
        _, indices = memory.search(q)  # (N, H, K)
        halves = torch.stack([indices // memory.keys.n_keys, indices % memory.keys.n_keys], 2)  # (N, H, 2, K)
        sub_keys = halves + torch.arange(2 * HEADS).view(HEADS, 2, 1) * memory.keys.n_keys
    return indices.unique().numel(), sub_keys.unique().numel()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds measured per entry and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurements per entry; median kept")
    parser.add_argument("--train-keys", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--no-peer", action="store_true", help=f"leave out {PEER} (requirements-bench.txt)")
    parser.add_argument("--settings", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model.memory fields of a second measurement of our layer (pkm_settings)")
    parser.add_argument("--fused-values", action="store_true", help="pkm_settings' step with FusedLazyAdam")
    parser.add_argument("--out", help="default: dumped/bench/memory_layer_speed_<cpu|cuda>.json")
    args = parser.parse_args()
    device, n_tokens = args.device, args.batch * args.seq
    settings = parse_settings(args.settings)
    names = ["dense_ffn", "product"] + ([] if args.no_peer else [PEER])
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, DIM, device=device, requires_grad=True)
    grad_out = torch.randn(args.batch, args.seq, DIM, device=device)
    bandwidth, rate = copy_bandwidth(device), matmul_rate(n_tokens, device)
    print(f"copy bandwidth {bandwidth:.1f} GB/s, matmul {rate:.1f} GFLOP/s", flush=True)

    rows, floors = [], []
    for n_keys in args.train_keys:
        modules = {name: build(name, n_keys).to(device).train() for name in names}
        ffn, ours = modules["dense_ffn"], modules["product"]
        steps = {("train", "dense_ffn"): train_step(ffn, x, grad_out),
                 ("train", "pkm"): train_step(ours, x, grad_out, sparse=False),
                 ("train", "pkm_sparse"): train_step(ours, x, grad_out, sparse=True),
                 ("train_step", "dense_ffn"): train_step(ffn, x, grad_out, optimizers=optimizers_of(ffn)),
                 ("train_step", "pkm_sparse"): train_step(ours, x, grad_out, True, optimizers_of(ours)),
                 ("inference", "dense_ffn"): inference_step(ffn, x),
                 ("inference", "pkm"): inference_step(ours, x)}
        if settings or args.fused_values:
            torch.manual_seed(0)
            tuned = build("product", n_keys, settings).to(device).train()
            steps |= {("train", "pkm_sparse_settings"): train_step(tuned, x, grad_out, sparse=True),
                      ("train_step", "pkm_sparse_settings"): train_step(tuned, x, grad_out, True,
                                                                        optimizers_of(tuned, args.fused_values)),
                      ("inference", "pkm_settings"): inference_step(tuned, x)}
        if PEER in modules:
            peer = modules[PEER]
            steps |= {("train", PEER): train_step(peer, x, grad_out),
                      ("train_step", PEER): train_step(peer, x, grad_out, optimizers=optimizers_of(peer)),
                      ("inference", PEER): inference_step(peer, x)}
        speeds = interleaved_rounds(steps, n_tokens, device, args.min_time, args.rounds)
        median = {key: statistics.median(s) for key, s in speeds.items()}
        for (mode, name), tps in median.items():
            rows.append({"mode": mode, "layer": name, "n_keys": n_keys, "slots": n_keys**2,
                         "tokens_per_s": round(tps), "rounds": [round(s) for s in speeds[mode, name]]})
            print(f"|K|={n_keys:4d}^2  {mode:10s} {name:22s} {tps:10.0f} tokens/s", flush=True)
        model = traffic_model(n_tokens, n_keys, *distinct_reads(ours, x))
        floor_s = model["total_bytes"] / (bandwidth * 1e9) + model["total_flops"] / (rate * 1e9)
        measured_s = n_tokens / median["train", "pkm_sparse"]
        floors.append({"n_keys": n_keys, **model, "floor_ms": round(floor_s * 1e3, 3),
                       "measured_ms": round(measured_s * 1e3, 3), "fraction_of_floor": round(floor_s / measured_s, 3)})
        print(f"|K|={n_keys:4d}^2  floor {floor_s * 1e3:.1f} ms, measured {measured_s * 1e3:.1f} ms "
              f"({floor_s / measured_s:.0%})", flush=True)
        del modules, ffn, ours, steps
        gc.collect()

    result = {
        "benchmark": "memory_layer_speed",
        "settings": {"dim": DIM, "heads": HEADS, "knn": KNN, "k_dim": K_DIM, "batch": args.batch, "seq": args.seq,
                     "pkm_settings": settings, "pkm_settings_fused_values": args.fused_values,
                     "tokens_per_step": n_tokens, "dtype": "float32", "min_time_s": args.min_time,
                     "rounds": args.rounds, "statistic": "median of interleaved rounds"},
        "machine": machine_info(device) | {"copy_bandwidth_gb_s": round(bandwidth, 2),
                                           "query_matmul_gflop_s": round(rate, 2)},
        "rows": rows,
        "ratios": ratios(rows),
        "sparse_train_floor": floors,
    }
    write_result(result, args, "memory_layer_speed")


OURS = {"train": "pkm_sparse", "train_step": "pkm_sparse", "inference": "pkm"}
SETTINGS = {"train": "pkm_sparse_settings", "train_step": "pkm_sparse_settings", "inference": "pkm_settings"}


def ratios(rows: list[dict]) -> list[dict]:
    """Per size: ours over the FFN and over the package in each mode (tokens/s), and our whole step's time
    over its time at half the n_keys (a quarter of the slots)."""
    speed = {(r["mode"], r["layer"], r["n_keys"]): r["tokens_per_s"] for r in rows}
    out = []
    for n in sorted({r["n_keys"] for r in rows}):
        row = {"n_keys": n}
        for mode, ours in OURS.items():
            for other in ("dense_ffn", PEER):
                if (mode, other, n) in speed:
                    row[f"{mode}_over_{other}"] = round(speed[mode, ours, n] / speed[mode, other, n], 3)
            tuned = speed.get((mode, SETTINGS[mode], n))
            if tuned:
                row[f"{mode}_settings_over_dense_ffn"] = round(tuned / speed[mode, "dense_ffn", n], 3)
                row[f"{mode}_settings_over_default"] = round(tuned / speed[mode, ours, n], 3)
        if ("train_step", "pkm_sparse", n // 2) in speed:
            row["train_step_time_over_half_n_keys"] = round(speed["train_step", "pkm_sparse", n // 2]
                                                            / speed["train_step", "pkm_sparse", n], 3)
        out.append(row)
    return out


if __name__ == "__main__":
    main()
