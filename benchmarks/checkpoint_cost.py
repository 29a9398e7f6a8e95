"""What one checkpoint.pt costs at the paper's size: its bytes, and the seconds to check and write it.

    python benchmarks/checkpoint_cost.py [--config configs/paper/l12_d1024_m1.yaml] [--vocab 60000]

Builds the config's model and optimizers on the CPU (vocabulary: --vocab, the paper's 60k BPE codes by
default), gives every optimizer its state (one step on zero gradients: Adam's two moments), then
writes checkpoint.pt as the trainer does (xlm_pkm.train.trainer.Trainer.save_checkpoint on one process):
the non-finite scan, then the tensors through Distributed Checkpoint into checkpoint.dcp/stepS (written,
fsynced, renamed: checkpoint/dcp_tensors.py) and the rest to checkpoint.pt (checkpoint.save_atomic). Its
bytes are both together.
Reports the median of --repeats writes (and each), so that `train.save_every_steps/minutes` can be
chosen knowing what a save costs, for each entry: today's float32 rows with Adam, and bfloat16 rows with row-wise
Adagrad (issue 81), their writes interleaved. Writes dumped/bench/checkpoint_cost_cpu.json (--out elsewhere).
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
from xlm_pkm.model.memory.value_stores import is_memory_value
from xlm_pkm.optim.optimizers import VALUE_OPTIMIZERS
from xlm_pkm.runtime.distributed import DistEnv
from xlm_pkm.train import build

ENTRIES = {  # name -> overrides: the values' storage and optimizer (issue 81: two bytes a memory parameter)
    "fp32_adam": [],  # the default: float32 rows, Adam's two moments on every row
    "bf16_rowwise_adagrad": ["model.memory.value_dtype=bfloat16", "optim.values_optimizer=rowwise_adagrad"],
}


def with_state(cfg, model):
    """The optimizers of `model`, every state created by one step on zero gradients (a sparse one of one row for a
    table whose optimizer takes sparse rows)."""
    optimizers = build.build_optimizers(model, cfg)
    sparse = VALUE_OPTIMIZERS[cfg.optim.values_optimizer].sparse
    for p in model.parameters():
        if sparse and is_memory_value(p):
            p.grad = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, p.shape[1]), p.shape)
        else:
            p.grad = torch.zeros_like(p)
    optimizers.step(torch.amp.GradScaler("cpu", enabled=False))
    return optimizers


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--config", default=str(REPO / "configs" / "paper" / "l12_d1024_m1.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(ENTRIES), help="default: every entry, writes interleaved")
    parser.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    parser.set_defaults(device="cpu", vocab=60000)
    args = parser.parse_args()
    names = args.only or list(ENTRIES)
    built = {}
    for name in names:
        model, cfg = build_model(args.config, ENTRIES[name], args, args.vocab)
        optimizers = with_state(cfg, model)
        built[name] = (model, optimizers, {"config": to_dict(cfg), "model": model.state_dict(), "step": 1,
                                           "optimizers": optimizers.state_dict()})
    scans, writes, sizes = ({n: [] for n in names} for _ in range(3))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for _ in range(args.repeats):
            for name in names:  # interleaved: both see the same disk and load
                model, optimizers, record = built[name]
                path = Path(tmp) / name / "checkpoint.pt"
                path.parent.mkdir(exist_ok=True)
                start = time.perf_counter()
                assert checkpoint.first_non_finite({"model": record["model"], "optimizer": record["optimizers"]}) \
                    is None
                scanned = time.perf_counter()
                rest = dcp_tensors.save(record, path, model, optimizers.params(), DistEnv(), torch.device("cpu"))
                checkpoint.save_atomic(rest, path)
                scans[name].append(scanned - start)
                writes[name].append(time.perf_counter() - scanned)
                folder = dcp_tensors.folder_of(path)
                files = [path, *(f for f in folder.rglob("*") if f.is_file())]
                sizes[name].append(sum(f.stat().st_size for f in files))
                path.unlink()
                shutil.rmtree(folder)
    rows = []
    for name in names:
        params = sum(p.numel() for p in built[name][0].parameters())
        row = {"name": name, "overrides": ENTRIES[name], "parameters": params, "bytes": sizes[name][0],
               "gib": round(sizes[name][0] / 2**30, 3), "scan_s_median": round(statistics.median(scans[name]), 2),
               "write_s_median": round(statistics.median(writes[name]), 2),
               "total_s_median": round(statistics.median(s + w for s, w in zip(scans[name], writes[name])), 2),
               "write_s_each": [round(w, 2) for w in writes[name]], "scan_s_each": [round(s, 2) for s in scans[name]],
               "write_gib_per_s": round(sizes[name][0] / 2**30 / statistics.median(writes[name]), 3)}
        rows.append(row)
        print(f"{name}: {params:,} parameters; checkpoint.pt {row['gib']} GiB; median of {args.repeats}: non-finite "
              f"scan {row['scan_s_median']} s + write {row['write_s_median']} s ({row['write_gib_per_s']} GiB/s)")
    if len(rows) > 1:
        print(f"{rows[1]['name']} / {rows[0]['name']}: bytes {rows[1]['bytes'] / rows[0]['bytes']:.3f}, "
              f"scan + write {rows[1]['total_s_median'] / rows[0]['total_s_median']:.3f}")
    result = {"benchmark": "checkpoint_cost", "config": str(Path(args.config).resolve().relative_to(REPO)),
              "vocab": args.vocab, "rows": rows, "repeats": args.repeats,
              "directory": str(Path(args.dir or tempfile.gettempdir()).resolve()), "note": args.note,
              "machine": machine_info("cpu")}
    write_result(result, args, "checkpoint_cost")


if __name__ == "__main__":
    main()
