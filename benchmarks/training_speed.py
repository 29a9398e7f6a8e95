"""Training speed of the Table 1 model with 12 layers and dim 1024, without and with one memory
(512² slots, 4 heads, knn 32), written to dumped/bench/training_speed_<cpu|cuda>.json.

    .venv/bin/python benchmarks/training_speed.py [--device cuda] [--precisions bf16 fp16] [--compile]

Each --configs model is measured in each of --precisions and, when it has memories, with each kind
of memory-value gradient in --values (sparse: row-sparse gradient and LazyAdam; dense: AdamW).
One step is the trainer's for one micro-batch on (batch, seq) random tokens, through the same
functions (xlm_pkm/train/step.py): forward under autocast, float32 cross-entropy, backward of the
scaled loss, unscale and per-group clipping, the non-finite check, the step of every optimizer group
(xlm_pkm.optim.optimizers.Optimizers), scaler update, gradients dropped. Entries run one after another, one
model on the device at a time, so the peak GPU memory (torch.cuda.max_memory_allocated, from the
first step on) is the entry's own; the speed is the best of --rounds after --warmup steps.
MFU = tokens/s × model.dense_flops_per_token(seq) / the GPU's peak for the precision
(xlm_pkm.runtime.hardware; null on CPU). memory_step_share = 1 − speed(with memories) / speed(without),
per precision and kind of values; issue 6's target: one memory costs ≤ 10% of the step.
fp16 needs CUDA: the CPU default is fp32 and bf16.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result
from model_setup import (
    REPO,
    benchmark_parser,
    build_model,
    common_settings,
    corpus_and_vocab,
    free,
    model_config,
    random_tokens,
)
from timing import best_of_rounds

from xlm_pkm.model.transformer import resolve_memory_layers
from xlm_pkm.runtime.hardware import peak_flops
from xlm_pkm.runtime.precision import check_precision, grad_scaler
from xlm_pkm.train.build import build_optimizers
from xlm_pkm.train.step import loss_backward, optimizer_update

CONFIGS = [str(REPO / "configs" / "paper" / f"l12_d1024_m{m}.yaml") for m in (0, 1)]


def train_step(model, cfg, tokens: torch.Tensor, precision: str, device: torch.device, compile: bool):
    optimizers = build_optimizers(model, cfg)
    scaler = grad_scaler(precision, device)
    forward = torch.compile(model) if compile else model
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    steps = itertools.count(1)

    def step():
        optimizers.set_step(next(steps))
        optimizer_update(optimizers, scaler, loss_backward(forward, x, y, precision, device, scaler))
    return step


def measure(config: str, precision: str, values: str | None, args, vocab: int) -> dict:
    device = torch.device(args.device)
    overrides = [f"optim.values_optimizer={'lazy_adam' if values == 'sparse' else 'adam'}"] if values else []
    model, cfg = build_model(config, overrides, args, vocab)
    model.train()
    tokens = random_tokens(args, vocab)  # (B, T + 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = train_step(model, cfg, tokens, precision, device, args.compile)
    tps = best_of_rounds({"step": step}, args.batch * args.seq, device, args.min_time, args.rounds,
                         warmup=args.warmup)["step"]
    flops = model.dense_flops_per_token(args.seq)
    peak = peak_flops(device, precision)
    row = {"precision": precision, "layers": cfg.model.n_layers, "dim": cfg.model.dim,
           "memories": len(model.memories()), "values": values, "params": model.param_counts()["total"],
           "flops_per_token": flops, "tokens_per_s": round(tps), "mfu": round(tps * flops / peak, 4) if peak else None,
           "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
           if device.type == "cuda" else None}
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    del model, step
    free(args.device)
    return row


def memory_step_share(rows: list[dict]) -> list[dict]:
    """1 − speed(with memories) / speed(the memoryless model of the same precision)."""
    without = {r["precision"]: r["tokens_per_s"] for r in rows if r["memories"] == 0}
    return [{"precision": r["precision"], "memories": r["memories"], "values": r["values"],
             "share": round(1 - r["tokens_per_s"] / without[r["precision"]], 3), "target": "<= 0.10 for 1 memory"}
            for r in rows if r["memories"] and r["precision"] in without]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="model configs (with and without memories)")
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "fp16", "bf16"],
                        default=["bf16", "fp16"] if torch.cuda.is_available() else ["fp32", "bf16"])
    parser.add_argument("--values", nargs="+", choices=["sparse", "dense"], default=["sparse", "dense"],
                        help="memory-value gradients, for models with memories")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (optimizer state, compile)")
    args = parser.parse_args()
    for precision in args.precisions:
        check_precision(precision, torch.device(args.device))
    corpus, vocab = corpus_and_vocab(args)
    rows = []
    for precision in args.precisions:
        for config in args.configs:
            has_memory = bool(resolve_memory_layers(model_config(config, [], args, vocab).model))
            for values in args.values if has_memory else [None]:
                rows.append(measure(config, precision, values, args, vocab))
    write_result({
        "benchmark": "training_speed",
        "settings": {**common_settings(args, vocab), "configs": args.configs,
                     "precisions": args.precisions, "values": args.values, "warmup_steps": args.warmup,
                     "step": "autocast forward, loss, scaled backward, unscale, clip, optimizer steps, zero grads"},
        "machine": machine_info(args.device),
        "corpus": corpus,
        "rows": rows,
        "memory_step_share": memory_step_share(rows),
    }, args, "training_speed")


if __name__ == "__main__":
    main()
