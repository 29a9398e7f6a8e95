"""Bytes of process memory a memory parameter costs at the peak of a whole run, and where that peak is.

    python benchmarks/bytes_per_parameter.py [--only NAME ...] [--steps 4] [--data DIR] [--out FILE]

Each entry trains the same 2-layer dim-256 model twice with `train.py` in a fresh process (start-up, the
model's initialisation, --steps steps, the validation, the checkpoints and the end of the run, as a user
runs it), once with a 256² memory and once with a 1024², and samples the process's anonymous resident
memory (RssAnon of /proc/PID/status: the heap, not the libraries' code) every 5 ms. The bytes a memory
parameter costs are (peak of the large run - peak of the small) / (their difference in memory parameters,
252M): what everything else costs cancels. The profile of each run (its RssAnon over time, and the lines the
run printed, timed on the same clock) says in which phase the peak falls; it is written beside the figures.
The start-up estimate (`train.py --dry-run`, train/memory_estimate.py) of each run is given beside its peak, and
its bytes a memory parameter (the same difference) beside the measured ones.
Writes dumped/bench/bytes_per_parameter_cpu.json (--out elsewhere).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import REPO, machine_info, write_result  # noqa: E402

MODEL = ["model.n_layers=2", "model.dim=256", "model.n_heads=4", "model.memory.k_dim=128", "model.memory.heads=4",
         "model.memory.knn=16", "data.batch_size=8", "data.bptt=128", "train.eval_every=1000",
         "train.eval_max_batches=20", "train.log_every=1", "train.num_threads=2", "train.save_every_minutes=0"]
SIZES = (256, 1024)  # n_keys: 256² and 1024² slots of dim 256
BF16 = "model.memory.value_dtype=bfloat16"
ENTRIES = {  # name -> overrides of the values' storage and optimizer
    "fp32_adam": ["optim.values_optimizer=adam"],  # the default
    "fp32_lazy_adam": ["optim.values_optimizer=lazy_adam"],
    "bf16_lazy_adam": ["optim.values_optimizer=lazy_adam", BF16],
    "fp32_rowwise_adagrad": ["optim.values_optimizer=rowwise_adagrad"],
    "bf16_rowwise_adagrad": ["optim.values_optimizer=rowwise_adagrad", BF16],
}


def rss_anon(pid: int) -> int | None:
    """RssAnon of process `pid` in bytes (None once it has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    except (OSError, StopIteration):
        return None


def profile_run(overrides: list[str], dump: Path, data: str) -> dict:
    """Runs train.py with `overrides`; its RssAnon every 5 ms and its output lines, both timed from its start."""
    command = [sys.executable, "train.py", "--config", "configs/default.yaml", f"data.path={data}",
               f"train.dump_path={dump}", "train.exp_name=bytes", *MODEL, *overrides, "--no-test"]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples, lines = [], []

    def read_lines():
        for line in process.stdout:
            lines.append((round(time.perf_counter() - start, 3), line.rstrip()[:160]))

    reader = threading.Thread(target=read_lines, daemon=True)
    reader.start()
    while process.poll() is None:
        value = rss_anon(process.pid)
        if value is not None:
            samples.append((round(time.perf_counter() - start, 3), value))
        time.sleep(0.005)
    reader.join()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n" + "\n".join(t for _, t in lines[-20:]))
    peak_time, peak = max(samples, key=lambda s: s[1])
    before = [text for t, text in lines if t <= peak_time]
    return {"command": command[1:], "peak_rss_anon": peak, "peak_at_s": peak_time,
            "last_line_before_peak": before[-1] if before else "(before the first line)",
            "profile": samples[::10], "lines": lines}


def dry_run_estimate(overrides: list[str], data: str) -> int:
    """The total of train.py --dry-run's estimate, in bytes."""
    out = subprocess.run([sys.executable, "train.py", "--config", "configs/default.yaml", f"data.path={data}",
                          *MODEL, *overrides, "--dry-run"], cwd=REPO, capture_output=True, text=True, check=True)
    total = re.search(r"^\s*total\s+([\d.]+) (KiB|MiB|GiB)", out.stdout, re.M)
    return int(float(total.group(1)) * 1024 ** ("KiB", "MiB", "GiB").index(total.group(2)) * 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(ENTRIES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--data", default="data/processed/sample")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for name in args.only or ENTRIES:
        runs = {}
        for n_keys in SIZES:
            overrides = [*ENTRIES[name], f"model.memory.n_keys={n_keys}", f"train.max_steps={args.steps}"]
            with tempfile.TemporaryDirectory() as dump:
                runs[n_keys] = profile_run(overrides, Path(dump), args.data)
            runs[n_keys]["estimate"] = dry_run_estimate(overrides, args.data)
            print(f"{name} {n_keys}²: peak RssAnon {runs[n_keys]['peak_rss_anon'] / 2**30:.2f} GiB at "
                  f"{runs[n_keys]['peak_at_s']} s ({runs[n_keys]['last_line_before_peak'][:90]}), estimate "
                  f"{runs[n_keys]['estimate'] / 2**30:.2f} GiB", flush=True)
        small, large = SIZES
        parameters = (large ** 2 - small ** 2) * 256
        per_parameter = (runs[large]["peak_rss_anon"] - runs[small]["peak_rss_anon"]) / parameters
        estimated = (runs[large]["estimate"] - runs[small]["estimate"]) / parameters
        rows.append({"name": name, "overrides": ENTRIES[name], "memory_parameters_difference": parameters,
                     "bytes_per_memory_parameter": round(per_parameter, 2),
                     "estimated_bytes_per_memory_parameter": round(estimated, 2),
                     "runs": {str(k): v for k, v in runs.items()}})
        print(f"{name}: {per_parameter:.2f} bytes a memory parameter at the run's peak (estimated {estimated:.2f})",
              flush=True)
    write_result({"benchmark": "bytes_per_parameter", "machine": machine_info(), "steps": args.steps,
                  "rows": rows}, args, "bytes_per_parameter")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
