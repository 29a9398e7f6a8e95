"""Training speed of every cell of the memory variants' study (results/variants), at the study's
scale, written to dumped/bench/variants_speed_<cpu|cuda>.json.

    .venv/bin/python benchmarks/variants_speed.py [--scale tiny] [--rounds 5] [--threads 1]

Each cell's model and optimizers are built as `python -m xlm_pkm.experiments.reproduce variants
--scale SCALE` trains them (the same configs and overrides, the dense cells widened to their match),
and one step is the trainer's (training_speed.train_step: forward, loss, backward, clipping, every
optimizer group's step) on (batch × bptt) random tokens of the scale. The cells are timed in
interleaved rounds, each for at least --min-time seconds, and the median of the rounds is kept, so
that load from elsewhere on a shared machine falls on every cell alike. --threads 1: the study's runs
use one thread each.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result
from model_setup import benchmark_parser, build_model, corpus_and_vocab, free
from timing import tokens_per_second
from training_speed import train_step

from xlm_pkm.experiments.reproduce import SCALES, model_size, plan


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--scale", default="tiny", choices=list(SCALES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the study's runs use 1)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    parser.set_defaults(rounds=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    corpus, vocab = corpus_and_vocab(args)
    runs, _ = plan("variants", SCALES[args.scale], Path("dumped/variants"))
    steps, rows = {}, {}
    for run in runs:
        names = [c.name for c in run.cells if c.table == "variants"]  # configs that resolve to one run: one timing
        cell = names[0]
        model, cfg = build_model(run.config, run.overrides, args, vocab)
        model.train()
        args.batch, args.seq = cfg.data.batch_size, cfg.data.bptt
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), device=args.device)
        steps[cell] = (train_step(model, cfg, tokens, cfg.train.precision, torch.device(args.device), False),
                       args.batch * args.seq)
        rows[cell] = {"cell": cell, "cells": names, "config": run.config, "overrides": run.overrides,
                      **{k: round(v) for k, v in model_size(cfg, cfg.data.bptt).items()}, "rounds_tokens_per_s": []}
    for step, _ in steps.values():
        for _ in range(args.warmup):
            step()
    for r in range(args.rounds):
        for cell, (step, n_tokens) in steps.items():
            tokens_per_s = tokens_per_second(step, n_tokens, args.device, args.min_time)
            rows[cell]["rounds_tokens_per_s"].append(round(tokens_per_s))
        print(f"round {r + 1}: " + ", ".join(f"{c} {rows[c]['rounds_tokens_per_s'][-1]:,}" for c in rows), flush=True)
    for row in rows.values():
        row["tokens_per_s"] = statistics.median(row["rounds_tokens_per_s"])
    steps.clear()
    free(args.device)
    write_result({
        "benchmark": "variants_speed",
        "settings": {"scale": args.scale, "threads": args.threads, "rounds": args.rounds, "min_time_s": args.min_time,
                     "warmup_steps": args.warmup, "statistic": "median of interleaved rounds", "vocab": vocab,
                     "step": "forward, loss, backward, clip, every optimizer group's step, zero grads"},
        "machine": machine_info(args.device),
        "corpus": corpus,
        "rows": list(rows.values()),
    }, args, "variants_speed")


if __name__ == "__main__":
    main()
