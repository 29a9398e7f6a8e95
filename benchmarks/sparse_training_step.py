"""Training step time and peak memory with sparse vs dense memory-value updates.

    .venv/bin/python benchmarks/sparse_training_step.py [--sizes 128 256 512 1024] [--steps 5]

1. The 6-layer ablation model (dim 512, 8 heads, one memory at layer 5: 4 heads, k=32, k_dim 512)
   for |K| = 128²..1024²: one step = forward, backward and the optimizer step of every group
   (xlm_pkm.optim.optimizers.Optimizers), sparse (row-sparse gradient + LazyAdam) vs dense (AdamW).
2. One memory layer + its optimizer step at 512², beside product-key-memory==0.3.0 with
   torch.optim.Adam (LayerNorm queries for both: the package's BatchNorm path does not run on
   (batch, time, dim) inputs); ours steps its values with LazyAdam, the rest with Adam.
Each entry runs in its own process, so its peak resident memory (ru_maxrss) is its own; the step
time is the median of --steps steps after --warmup steps (the first steps allocate Adam's state).
Writes dumped/bench/sparse_training_step_cpu.json (--out elsewhere).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result  # noqa: E402
from timing import median_seconds  # noqa: E402

from xlm_pkm.config import Config  # noqa: E402
from xlm_pkm.model.memory.pkm import MemoryConfig, ProductKeyMemory  # noqa: E402
from xlm_pkm.model.transformer import ModelConfig  # noqa: E402
from xlm_pkm.optim.lazy_adam import LazyAdam  # noqa: E402
from xlm_pkm.optim.optimizers import OptimConfig  # noqa: E402
from xlm_pkm.runtime.precision import grad_scaler  # noqa: E402
from xlm_pkm.train.build import build_model, build_optimizers  # noqa: E402
from xlm_pkm.train.step import loss_backward, optimizer_update  # noqa: E402

DIM = 512


def model_step(n_keys: int, sparse: bool, batch: int, bptt: int, vocab: int):
    """One step of the trainer's own functions (xlm_pkm/train/step.py) on the 6-layer ablation model."""
    memory = MemoryConfig(n_keys=n_keys, k_dim=512, heads=4, knn=32)
    cfg = Config(model=ModelConfig(vocab_size=vocab, dim=DIM, n_layers=6, n_heads=8, max_len=bptt, mem_layers=[5],
                                   memory=memory),
                 optim=OptimConfig(warmup_steps=1, values_optimizer="lazy_adam" if sparse else "adam"))
    cpu = torch.device("cpu")
    model = build_model(cfg, cpu)
    optimizers = build_optimizers(model, cfg)
    scaler = grad_scaler("fp32", cpu)
    tokens = torch.randint(0, vocab, (batch, bptt + 1), generator=torch.Generator().manual_seed(0))  # fixed inputs

    def step():
        optimizers.set_step(1)
        optimizer_update(optimizers, scaler, loss_backward(model, tokens[:, :-1], tokens[:, 1:], "fp32", cpu, scaler))
    return step


def layer_step(name: str, n_keys: int, batch: int, bptt: int):
    if name == "lucidrains_pkm_0.3.0":
        from product_key_memory import PKM
        layer = PKM(DIM, heads=4, num_keys=n_keys, topk=32, dim_head=256)
        optimizers = [torch.optim.Adam(layer.parameters(), lr=1e-3)]
    else:
        layer = ProductKeyMemory(DIM, DIM, n_keys=n_keys, k_dim=512, heads=4, knn=32, query_norm="layernorm")
        layer.sparse_values = True
        values = [layer.values.weight]
        others = [p for p in layer.parameters() if p is not layer.values.weight]
        optimizers = [LazyAdam(values, lr=1e-3), torch.optim.Adam(others, lr=2.5e-4)]
    x = torch.randn(batch, bptt, DIM)

    def step():
        layer(x).sum().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def worker(args) -> None:
    """One entry, in this process: prints {"step_s", "peak_rss_gib"} as JSON."""
    torch.manual_seed(0)
    if args.worker == "model":
        step = model_step(args.n_keys, args.sparse, args.batch, args.bptt, args.vocab)
    else:
        step = layer_step(args.worker, args.n_keys, args.batch, args.bptt)
    seconds = median_seconds(step, args.steps, args.warmup)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"step_s": round(seconds, 4), "peak_rss_gib": round(peak_gib, 3)}))


def run_entry(args, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
           str(args.batch), "--bptt", str(args.bptt), "--vocab", str(args.vocab), *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024], help="n_keys (|K| = n²)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--bptt", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", help="default: dumped/bench/sparse_training_step_cpu.json")
    parser.add_argument("--worker", choices=["model", "ours_sparse", "lucidrains_pkm_0.3.0"], help=argparse.SUPPRESS)
    parser.add_argument("--n-keys", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sparse", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    model_rows = []
    for n_keys in args.sizes:
        for sparse in (True, False):
            row = {"n_keys": n_keys, "slots": n_keys**2, "values": "sparse" if sparse else "dense",
                   **run_entry(args, "--worker", "model", "--n-keys", str(n_keys), *(["--sparse"] if sparse else []))}
            model_rows.append(row)
            print(f"model |K|={n_keys:4d}^2 {row['values']:6s} step {row['step_s']:.3f} s, "
                  f"peak RSS {row['peak_rss_gib']:.2f} GiB", flush=True)
    layer_rows = []
    for name in ("ours_sparse", "lucidrains_pkm_0.3.0"):
        row = {"layer": name, "n_keys": 512, **run_entry(args, "--worker", name, "--n-keys", "512")}
        layer_rows.append(row)
        print(f"layer |K|=512^2 {name:22s} step {row['step_s']:.3f} s, peak RSS {row['peak_rss_gib']:.2f} GiB",
              flush=True)
    step_of = {(r["n_keys"], r["values"]): r["step_s"] for r in model_rows}
    result = {
        "benchmark": "sparse_training_step",
        "settings": {"model": "6 layers, dim 512, 8 heads, memory at layer 5 (4 heads, knn 32, k_dim 512)",
                     "batch": args.batch, "bptt": args.bptt, "vocab": args.vocab, "steps": args.steps,
                     "warmup": args.warmup, "statistic": "median step time", "dtype": "float32"},
        "machine": machine_info("cpu"),
        "model_step": model_rows,
        "layer_step_512": layer_rows,
    }
    if (args.sizes[0], "sparse") in step_of and (args.sizes[-1], "sparse") in step_of:
        result["sparse_largest_over_smallest"] = round(
            step_of[(args.sizes[-1], "sparse")] / step_of[(args.sizes[0], "sparse")], 3)
    write_result(result, args, "sparse_training_step")


if __name__ == "__main__":
    main()
