"""What one checkpoint.pt costs at the paper's size: its bytes, and the seconds to check and write it.

    python benchmarks/checkpoint_cost.py [--config configs/paper/l12_d1024_m1.yaml] [--vocab 60000]

Builds the config's model and optimizers on the CPU (vocabulary: --vocab, the paper's 60k BPE codes by
default), gives every optimizer its state (one step on zero gradients: Adam's two moments), then
writes checkpoint.pt as the trainer does (xlm_pkm.train.trainer.Trainer.save_checkpoint on one process):
the non-finite scan, then the tensors through Distributed Checkpoint into checkpoint.dcp/stepS (written,
fsynced, renamed: checkpoint/dcp_tensors.py) and the rest to checkpoint.pt (checkpoint.save_atomic). Its
bytes are both together.
Reports the median of --repeats writes (and each), so that `train.save_every_steps/minutes` can be
chosen knowing what a save costs. Writes dumped/bench/checkpoint_cost_cpu.json (--out elsewhere).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result
from model_setup import REPO, benchmark_parser, build_model

from xlm_pkm.checkpoint import dcp_tensors
from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.config import to_dict
from xlm_pkm.runtime.distributed import DistEnv
from xlm_pkm.train import build


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--config", default=str(REPO / "configs" / "paper" / "l12_d1024_m1.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    parser.set_defaults(device="cpu", vocab=60000)
    args = parser.parse_args()
    model, cfg = build_model(args.config, [], args, args.vocab)
    optimizers = build.build_optimizers(model, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizers.step(torch.amp.GradScaler("cpu", enabled=False))  # every state created
    record = {"config": to_dict(cfg), "model": model.state_dict(), "step": 1, "optimizers": optimizers.state_dict()}
    params = sum(p.numel() for p in model.parameters())
    scans, writes, sizes = [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "checkpoint.pt"
        for _ in range(args.repeats):
            start = time.perf_counter()
            assert checkpoint.first_non_finite({"model": record["model"], "optimizer": record["optimizers"]}) is None
            scanned = time.perf_counter()
            rest = dcp_tensors.save(record, path, model, optimizers.params(), DistEnv(), torch.device("cpu"))
            checkpoint.save_atomic(rest, path)
            scans.append(scanned - start)
            writes.append(time.perf_counter() - scanned)
            folder = dcp_tensors.folder_of(path)
            sizes.append(path.stat().st_size + sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()))
            path.unlink()
            shutil.rmtree(folder)
    result = {
        "benchmark": "checkpoint_cost", "config": str(Path(args.config).resolve().relative_to(REPO)),
        "vocab": args.vocab, "parameters": params, "bytes": sizes[0], "gib": round(sizes[0] / 2**30, 3),
        "scan_s_median": round(statistics.median(scans), 2), "write_s_median": round(statistics.median(writes), 2),
        "total_s_median": round(statistics.median(s + w for s, w in zip(scans, writes)), 2),
        "write_s_each": [round(w, 2) for w in writes], "scan_s_each": [round(s, 2) for s in scans],
        "write_gib_per_s": round(sizes[0] / 2**30 / statistics.median(writes), 3), "repeats": args.repeats,
        "directory": str(Path(args.dir or tempfile.gettempdir()).resolve()), "note": args.note,
        "machine": machine_info("cpu"),
    }
    print(f"{result['config']}: {params:,} parameters; checkpoint.pt {result['gib']} GiB; median of {args.repeats}: "
          f"non-finite scan {result['scan_s_median']} s + write {result['write_s_median']} s "
          f"({result['write_gib_per_s']} GiB/s)")
    write_result(result, args, "checkpoint_cost")


if __name__ == "__main__":
    main()
