"""Speed of one memory layer, written to dumped/bench/memory_layer_speed_<cpu|cuda>.json.

    .venv/bin/python benchmarks/memory_layer_speed.py [--device cpu|cuda] [--min-time 1.0]

Training (forward + backward) tokens/s at d=512, heads=4, knn=32, k_dim=512 for |K| = 128²..1024²:
our ProductKeyMemory (dense and sparse value gradients), the PyPI package product-key-memory==0.3.0
(lucidrains; LayerNorm queries, as its BatchNorm path does not run on (batch, time, dim) inputs),
and a dense FFN (d -> 4d -> d, GELU) of the same d, all measured in the same run. Inference speed of
product vs flat keys (Table 4 / Figure 7) is measured on whole models by inference_speed.py.
Gradients are dropped (set to None) between steps, as an optimizer with zero_grad() would. Each figure
is the best of --rounds interleaved measurements (the machine may be shared).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result
from timing import best_of_rounds

from xlm_pkm.model.memory.pkm import ProductKeyMemory

DIM, HEADS, KNN, K_DIM = 512, 4, 32, 512


def train_step(module, x, sparse: bool | None = None):
    def step():
        if sparse is not None:  # one ProductKeyMemory measured with both kinds of value gradient
            module.sparse_values = sparse
        for p in module.parameters():
            p.grad = None
        module(x).float().sum().backward()
    return step


def build(name: str, n_keys: int):
    if name == "dense_ffn":
        return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
    if name == "lucidrains_pkm_0.3.0":
        from product_key_memory import PKM
        return PKM(DIM, heads=HEADS, num_keys=n_keys, topk=KNN, dim_head=K_DIM // 2)
    return ProductKeyMemory(DIM, DIM, n_keys=n_keys, k_dim=K_DIM, heads=HEADS, knn=KNN, key_type=name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds measured per entry")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved measurements per entry; best kept")
    parser.add_argument("--train-keys", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--out", help="default: dumped/bench/memory_layer_speed_<cpu|cuda>.json")
    args = parser.parse_args()
    device, n_tokens = args.device, args.batch * args.seq
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, DIM, device=device, requires_grad=True)

    train = []
    for n_keys in args.train_keys:
        ffn, ours, theirs = (build(name, n_keys).to(device).train() for name in ("dense_ffn", "product",
                                                                                 "lucidrains_pkm_0.3.0"))
        steps = {"dense_ffn": train_step(ffn, x), "pkm": train_step(ours, x, sparse=False),
                 "pkm_sparse": train_step(ours, x, sparse=True), "lucidrains_pkm_0.3.0": train_step(theirs, x)}
        for name, tps in best_of_rounds(steps, n_tokens, device, args.min_time, args.rounds).items():
            train.append({"slots": n_keys**2, "n_keys": n_keys, "layer": name, "tokens_per_s": round(tps)})
            print(f"train  |K|={n_keys:4d}^2  {name:22s} {tps:10.0f} tokens/s", flush=True)
        del ffn, ours, theirs, steps
        gc.collect()

    result = {
        "benchmark": "memory_layer_speed",
        "settings": {"dim": DIM, "heads": HEADS, "knn": KNN, "k_dim": K_DIM, "batch": args.batch, "seq": args.seq,
                     "tokens_per_step": n_tokens, "dtype": "float32", "min_time_s": args.min_time,
                     "rounds": args.rounds, "statistic": "best of rounds"},
        "machine": machine_info(device),
        "train_forward_backward": train,
    }
    write_result(result, args, "memory_layer_speed")


if __name__ == "__main__":
    main()
