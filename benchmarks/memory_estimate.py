"""The dry run's memory estimate (xlm_pkm/train/memory_estimate.py) against the memory training takes on the CPU.

    python benchmarks/memory_estimate.py [--only default engram] [--steps 3] [--data DIR] [--out FILE]

Each entry runs in a fresh process on one thread, with the process defaults train.py sets (huge pages for
large CPU tensors). It first trains two steps of a shrunk copy of its config (width 32, batch 2 × 8), so
that what any training takes once (libtorch's code pages, thread pools, allocator arenas) is in place, then
reads its resident memory, resets the kernel's peak counter (writing 5 to /proc/self/clear_refs, Linux),
builds the model and its optimizers and trains --steps steps on random tokens through the trainer's step
(train/step.py: loss_backward, optimizer_update), and reads the peak (VmHWM). measured = peak - resident
before the build: what the model, its optimizers and the steps added at their worst moment. The estimate
is that of one process on the CPU; its ratio to the measured peak is the figure of interest. The vocabulary
(hence the logits, most of the default model's activations) is --data's, by default the bundled corpus's.

On W processes: the estimates for the runs of benchmarks/sharded_values.py (one layer of dim 1024 whose FFN is
a memory, replicated or sharded values, lazy_adam or adam, W = 2 and 4), against the peak resident memory per
rank it measured, minus its resident memory before the model (read after the process group started, with no
warm-up: the first step's library pages are in it), from its JSON (--sharded-values).
Writes dumped/bench/memory_estimate_cpu.json (--out elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from xlm_pkm.launch.commands import set_process_defaults  # imports no torch

ENTRIES = {  # name -> (config, overrides)
    "default": ("configs/default.yaml", []),
    # the default model with a 512² memory: 67M value parameters (256 MiB), ~14x its dense ones, Adam on them
    "pkm_big_memory": ("configs/default.yaml", ["model.memory.n_keys=512"]),
    # the same with sparse value gradients (one row per slot read, an upper bound here) and Adam on the rows read
    "pkm_big_memory_lazy_adam": ("configs/default.yaml",
                                 ["model.memory.n_keys=512", "optim.values_optimizer=lazy_adam"]),
    "engram": ("configs/variants/engram.yaml", []),
    "default_bf16": ("configs/default.yaml", ["train.precision=bf16"]),  # autocast on the CPU
}
SHRUNK = ["model.dim=32", "model.n_heads=2", "model.memory.k_dim=16", "model.memory.n_keys=8", "model.memory.knn=4",
          "model.engram.ngram_dim=16", "model.engram.table_size=64", "data.batch_size=2", "data.bptt=8"]


def status_bytes(key: str) -> int:
    """A line of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def measure(config: str, overrides: list[str], steps: int) -> dict:
    """In this process: the estimate and the measured peak of `steps` training steps (module docstring)."""
    import torch

    from xlm_pkm.config import load_config
    from xlm_pkm.data.dictionary import Dictionary
    from xlm_pkm.runtime.precision import grad_scaler
    from xlm_pkm.train.build import build_model, build_optimizers, resolved_config
    from xlm_pkm.train.memory_estimate import estimate
    from xlm_pkm.train.step import loss_backward, optimizer_update

    torch.set_num_threads(1)
    device = torch.device("cpu")

    def config_of(extra: list[str]):
        cfg = load_config(config, [*overrides, "train.device=cpu", *extra])
        return resolved_config(cfg, len(Dictionary.load(Path(cfg.data.path) / "vocab")), "bench")

    def train(cfg) -> None:
        model = build_model(cfg, device)
        optimizers, scaler = build_optimizers(model, cfg), grad_scaler(cfg.train.precision, device)
        generator = torch.Generator().manual_seed(0)
        shape, vocab = (cfg.data.batch_size, cfg.data.bptt), cfg.model.vocab_size
        for _ in range(steps):
            x, y = (torch.randint(0, vocab, shape, generator=generator) for _ in range(2))
            optimizer_update(optimizers, scaler, loss_backward(model, x, y, cfg.train.precision, device, scaler))

    train(config_of(SHRUNK))
    cfg = config_of([])
    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    train(cfg)
    measured = status_bytes("VmHWM") - before
    est = estimate(cfg, 1, "ddp", device_type="cpu")
    return {"estimate": est.as_dict(), "estimate_lines": est.lines(), "measured_peak_bytes": measured,
            "estimate_over_measured": round(est.total / measured, 3), "resident_before_bytes": before}


def entry_overrides(name: str, data: str | None) -> list[str]:
    return ENTRIES[name][1] + ([f"data.path={Path(data).resolve()}"] if data else [])


def run_entry(name: str, steps: int, data: str | None) -> dict:
    args = ["--data", data] if data else []
    done = subprocess.run([sys.executable, __file__, "--entry", name, "--steps", str(steps), *args], check=True,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return {"name": name, "config": ENTRIES[name][0], "overrides": entry_overrides(name, data), "steps": steps,
            **json.loads(done.stdout.strip().splitlines()[-1])}


def against_sharded_values(path: Path) -> list[dict]:
    """Each run of benchmarks/sharded_values.py's result at `path`: its estimate per rank and measured peak."""
    from types import SimpleNamespace

    import sharded_values

    from xlm_pkm.config import load_config
    from xlm_pkm.train.memory_estimate import estimate

    result = json.loads(path.read_text())
    settings = SimpleNamespace(**result["settings"])
    rows = []
    for run in result["entries"]:
        overrides = sharded_values.overrides(settings, run["n_keys"], run["mode"] == "sharded", run["values"])
        cfg = load_config(None, [*overrides, f"data.batch_size={settings.batch}", f"data.bptt={settings.seq}"])
        est = estimate(cfg, run["world"], "ddp", device_type="cpu")
        measured = round((run["peak_gib_max"] - run["before_model_gib"]) * 2**30)
        rows.append({key: run[key] for key in ("mode", "world", "values", "n_keys")} | {
            "estimate": est.as_dict(), "measured_peak_bytes": measured,
            "estimate_over_measured": round(est.total / measured, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(ENTRIES), default=list(ENTRIES))
    parser.add_argument("--steps", type=int, default=3, help="training steps measured (Adam's state from the first)")
    parser.add_argument("--data", help="preprocessed corpus whose vocabulary the models take (default: the "
                                       "configs' data.path, the bundled corpus)")
    parser.add_argument("--sharded-values", default=str(Path(__file__).resolve().parent / "results" /
                                                        "sharded_values_cpu.json"),
                        help="benchmarks/sharded_values.py's result to compare the estimates on W processes with")
    parser.add_argument("--out", help="default: dumped/bench/memory_estimate_cpu.json")
    parser.add_argument("--entry", choices=list(ENTRIES), help=argparse.SUPPRESS)  # one entry, in this process
    args = parser.parse_args()
    set_process_defaults()  # before torch is imported, as train.py
    if args.entry:
        print(json.dumps(measure(ENTRIES[args.entry][0], entry_overrides(args.entry, args.data), args.steps)))
        return
    from machine import REPO, machine_info, write_result

    rows = []
    for name in args.only:
        row = run_entry(name, args.steps, args.data)
        rows.append(row)
        mib = 2**20
        print(f"{name:26s} estimate {row['estimate']['total'] / mib:8.1f} MiB  measured peak "
              f"{row['measured_peak_bytes'] / mib:8.1f} MiB  ratio {row['estimate_over_measured']:.3f}", flush=True)
    sharded = against_sharded_values(Path(args.sharded_values))
    for row in sharded:
        print(f"{row['mode']} values, W={row['world']}, {row['values']}, n_keys {row['n_keys']}: estimate "
              f"{row['estimate']['total'] / 2**30:.2f} GiB, measured {row['measured_peak_bytes'] / 2**30:.2f} GiB, "
              f"ratio {row['estimate_over_measured']:.3f}")
    machine = machine_info("cpu")
    machine["threads"] = 1  # each entry's process
    against = {"source": os.path.relpath(args.sharded_values, REPO), "rows": sharded}
    write_result({"benchmark": "memory_estimate", "machine": machine, "rows": rows, "sharded_values": against}, args,
                 "memory_estimate")


if __name__ == "__main__":
    main()
