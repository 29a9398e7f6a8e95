"""The largest product-key memory this machine trains with the table in RAM: a whole train.py run, its peak.

    python benchmarks/largest_memory.py [--n-keys 2896] [--dim 1024] [--steps 20] [--set KEY=VALUE ...] [--out FILE]

Trains a 2-layer model of width --dim whose memory has --n-keys² slots (2,896² × 1,024 = 8.6B value parameters:
16 GiB in bfloat16) with bfloat16 rows and row-wise Adagrad (issue 81: two bytes a parameter), for --steps steps,
then its validation (20 batches) and its checkpoints, as a user runs it (train.py, one process). Reports the
value parameters, whether every logged loss is finite, the peak anonymous resident memory (RssAnon, sampled every
5 ms: bytes_per_parameter.py's profile_run) and its bytes a value parameter, the run's wall time, and the size of
its checkpoint.pt (with its tensors' folder) and best.pt. The run directory is removed afterwards (--keep keeps it).
Writes dumped/bench/largest_memory_cpu.json (--out elsewhere).
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bytes_per_parameter import profile_run  # noqa: E402
from machine import machine_info, write_result  # noqa: E402

TWO_BYTES = ["model.memory.value_dtype=bfloat16", "optim.values_optimizer=rowwise_adagrad"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-keys", type=int, default=2896)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", nargs="*", default=TWO_BYTES, metavar="KEY=VALUE",
                        help="the values' storage and optimizer (default: bfloat16 rows, rowwise_adagrad)")
    parser.add_argument("--data", default="data/processed/sample")
    parser.add_argument("--dir", help="where the run directory goes (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--out")
    args = parser.parse_args()
    overrides = [f"model.dim={args.dim}", f"model.memory.n_keys={args.n_keys}", f"train.max_steps={args.steps}",
                 "model.memory.k_dim=256", "model.n_heads=8", "data.batch_size=4", *args.set]
    dump = Path(tempfile.mkdtemp(dir=args.dir, prefix="largest_memory."))
    start = time.perf_counter()
    try:
        run = profile_run(overrides, dump, args.data)
        run_dir = next(dump.glob("bytes/*"))
        sizes = {"checkpoint.pt": sum(f.stat().st_size for f in [run_dir / "checkpoint.pt",
                                                                  *run_dir.glob("checkpoint.dcp/**/*")]
                                      if f.is_file()),
                 "best.pt": sum(f.stat().st_size for f in run_dir.glob("best.pt*") if f.is_file())}
    finally:
        if not args.keep:
            shutil.rmtree(dump, ignore_errors=True)
    wall = time.perf_counter() - start
    losses = [float(m.group(1)) for _, line in run["lines"] for m in [re.search(r" train step \d+/\d+ .* loss=(\S+)",
                                                                                 line)] if m]
    values = args.n_keys ** 2 * args.dim
    result = {"benchmark": "largest_memory", "n_keys": args.n_keys, "dim": args.dim, "steps": args.steps,
              "overrides": overrides, "value_parameters": values, "losses": losses,
              "finite": bool(losses) and all(map(math.isfinite, losses)),
              "peak_rss_anon": run["peak_rss_anon"], "peak_rss_anon_gib": round(run["peak_rss_anon"] / 2**30, 2),
              "peak_bytes_per_value_parameter": round(run["peak_rss_anon"] / values, 3),
              "peak_at_s": run["peak_at_s"], "last_line_before_peak": run["last_line_before_peak"],
              "checkpoint_bytes": sizes, "wall_s": round(wall, 1), "command": run["command"],
              "profile": run["profile"][::10], "machine": machine_info()}
    print(f"{values / 1e9:.2f}B value parameters, {len(losses)} losses logged, finite: {result['finite']}; peak "
          f"RssAnon {result['peak_rss_anon_gib']} GiB ({result['peak_bytes_per_value_parameter']} bytes a value "
          f"parameter); {wall:.0f} s; checkpoint.pt {sizes['checkpoint.pt'] / 2**30:.1f} GiB, best.pt "
          f"{sizes['best.pt'] / 2**30:.1f} GiB")
    write_result(result, args, "largest_memory")


if __name__ == "__main__":
    main()
