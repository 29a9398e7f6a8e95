"""The dry run's memory estimate (xlm_pkm/train/memory_estimate.py) against the memory training takes on the CPU.

    python benchmarks/memory_estimate.py [--only default engram] [--steps 3] [--data DIR] [--live-memory] [--out FILE]

Each entry runs in a fresh process on one thread, with the process defaults train.py sets (huge pages for
large CPU tensors). It first trains two steps of a shrunk copy of its config (width 32, batch 2 × 8), so
that what any training takes once (libtorch's code pages, thread pools, allocator arenas) is in place, gives
back to the system what the warm-up freed (malloc_trim), then reads its resident memory, resets the kernel's
peak counter (writing 5 to /proc/self/clear_refs, Linux),
builds the model and its optimizers and trains --steps steps on random tokens through the trainer's step
(train/step.py: loss_backward, optimizer_update), and reads the peak (VmHWM). measured = peak - resident
before the build: what the model, its optimizers and the steps added at their worst moment. The estimate
is that of one process on the CPU; its ratio to the measured peak is the figure of interest. The vocabulary
(hence the logits, most of the default model's activations) is --data's, by default the bundled corpus's.

An entry of W processes (`default_fsdp_2`...) runs under torchrun, each rank as above in its mode (train.parallel:
the model built and sharded as the trainer does, the values' gradients averaged, ddp's all-reduce), warmed up the
same way; its measured peak is each rank's, and the row gives the largest and every rank's. The peak resident
memory over the process's own before the model (its libraries, the warm-up's pages) is what the model added: the
honest figure to set against the estimate, which counts the run's tensors only. --live-memory measures those
tensors alone: malloc then gives back every block it frees (mallopt), where glibc's default heap keeps them for
reuse (and FSDP's buffers of many sizes fragment it: docs/training.md, "How much memory per rank").

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

WIDE = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "data.batch_size=4", "data.bptt=64"]
ENTRIES = {  # name -> (config, overrides[, processes])
    "default": ("configs/default.yaml", []),
    # the default model with a 512² memory: 67M value parameters (256 MiB), ~14x its dense ones, Adam on them
    "pkm_big_memory": ("configs/default.yaml", ["model.memory.n_keys=512"]),
    # the same with sparse value gradients (one row per slot read, an upper bound here) and Adam on the rows read
    "pkm_big_memory_lazy_adam": ("configs/default.yaml",
                                 ["model.memory.n_keys=512", "optim.values_optimizer=lazy_adam"]),
    "engram": ("configs/variants/engram.yaml", []),
    "default_bf16": ("configs/default.yaml", ["train.precision=bf16"]),  # autocast on the CPU
    # on 2 processes, fsdp and ddp: the default, and a wider model (8 x 512: 26M dense parameters) on short batches,
    # whose weights, gradients and Adam moments outweigh its activations
    "default_fsdp_2": ("configs/default.yaml", ["train.parallel=fsdp"], 2),
    "default_ddp_2": ("configs/default.yaml", [], 2),
    "wide_fsdp_2": ("configs/default.yaml", [*WIDE, "train.parallel=fsdp"], 2),
    "wide_ddp_2": ("configs/default.yaml", WIDE, 2),
    # FSDP's mixed precision (the units gathered in bf16), and every unit kept gathered from forward to backward
    "wide_fsdp_bf16_2": ("configs/default.yaml", [*WIDE, "train.parallel=fsdp", "train.precision=bf16"], 2),
    "wide_fsdp_kept_2": ("configs/default.yaml", [*WIDE, "train.parallel=fsdp",
                                                  "train.fsdp_reshard_after_forward=false"], 2),
}
SHRUNK = ["model.dim=32", "model.n_heads=2", "model.memory.k_dim=16", "model.memory.n_keys=8", "model.memory.knn=4",
          "model.engram.ngram_dim=16", "model.engram.table_size=64", "data.batch_size=2", "data.bptt=8"]


def status_bytes(key: str) -> int:
    """A line of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def live_memory_only() -> None:
    """glibc's malloc from now on maps each block of 64 KiB or more on its own and unmaps it when freed (its
    thresholds fixed), so that the resident memory is what the tensors hold, not also freed blocks kept for reuse
    (--live-memory; the counterpart of CUDA's max_memory_allocated, against its max_memory_reserved)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD


def measure(config: str, overrides: list[str], steps: int, live: bool = False) -> dict | None:
    """In this process (a rank of torchrun's, or the only one): the estimate and the measured peak of `steps`
    training steps (module docstring); on rank 0 every rank's, None on the others. `live`: live_memory_only."""
    import ctypes
    import functools
    import gc

    import torch

    from xlm_pkm.config import load_config
    from xlm_pkm.data.dictionary import Dictionary
    from xlm_pkm.optim.optimizers import value_optimizer
    from xlm_pkm.runtime.distributed import average_value_grads_, data_parallel, gather_objects, init_distributed
    from xlm_pkm.runtime.distributed import synced_values as values_synced
    from xlm_pkm.runtime.precision import grad_scaler
    from xlm_pkm.train.build import build_model, build_optimizers, resolved_config
    from xlm_pkm.train.memory_estimate import estimate
    from xlm_pkm.train.step import loss_backward, optimizer_update

    torch.set_num_threads(1)
    device = torch.device("cpu")
    env = init_distributed(device)

    def config_of(extra: list[str]):
        cfg = load_config(config, [*overrides, "train.device=cpu", *extra])
        return resolved_config(cfg, len(Dictionary.load(Path(cfg.data.path) / "vocab")), "bench", env.world_size)

    def train(cfg) -> int:
        """Trains `steps` steps as the trainer does on this process group; returns the peak (VmHWM) once built."""
        fsdp = cfg.train.parallel == "fsdp" and env.is_distributed
        shard = None
        if fsdp:
            from xlm_pkm.runtime.fsdp import fully_shard_model

            shard = functools.partial(fully_shard_model, env=env, device=device, precision=cfg.train.precision,
                                      reshard_after_forward=cfg.train.fsdp_reshard_after_forward)
        model = build_model(cfg, device, world_size=env.world_size, shard=shard)
        built = status_bytes("VmHWM")
        synced = values_synced(model, value_optimizer(cfg.optim).sparse, fsdp)
        outside = {id(p) for p in synced}
        forward = model
        trains_in_ddp = any(p.requires_grad and id(p) not in outside for p in model.parameters())
        if env.is_distributed and not fsdp and trains_in_ddp:
            forward = data_parallel(model, synced, device)
        optimizers, scaler = build_optimizers(model, cfg), grad_scaler(cfg.train.precision, device)
        generator = torch.Generator().manual_seed(env.rank)
        shape, vocab = (cfg.data.batch_size, cfg.data.bptt), cfg.model.vocab_size
        precision = "fp32" if fsdp else cfg.train.precision  # FSDP's own mixed precision
        for _ in range(steps):
            x, y = (torch.randint(0, vocab, shape, generator=generator) for _ in range(2))
            loss = loss_backward(forward, x, y, precision, device, scaler)
            average_value_grads_(synced, env)
            optimizer_update(optimizers, scaler, loss)
        return built

    if live:
        live_memory_only()
    train(config_of(SHRUNK))
    cfg = config_of([])
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the warm-up freed, given back
    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    built = train(cfg) - before
    measured = status_bytes("VmHWM") - before
    ranks = gather_objects({"measured_peak_bytes": measured, "built_peak_bytes": built,
                            "resident_before_bytes": before}, env)
    if not env.is_main:
        return None
    est = estimate(cfg, env.world_size, cfg.train.parallel, device_type="cpu")
    peak = max(r["measured_peak_bytes"] for r in ranks)
    return {"estimate": est.as_dict(), "estimate_lines": est.lines(), "measured_peak_bytes": peak,
            "estimate_over_measured": round(est.total / peak, 3), "resident_before_bytes": before,
            "world_size": env.world_size, "parallel": cfg.train.parallel, "live_memory": live, "ranks": ranks}


def entry_overrides(name: str, data: str | None) -> list[str]:
    return ENTRIES[name][1] + ([f"data.path={Path(data).resolve()}"] if data else [])


def processes(name: str) -> int:
    return ENTRIES[name][2] if len(ENTRIES[name]) > 2 else 1


def run_entry(name: str, steps: int, data: str | None, live: bool = False) -> dict:
    args = (["--data", data] if data else []) + (["--live-memory"] if live else [])
    world = processes(name)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
    done = subprocess.run([sys.executable, *launcher, __file__, "--entry", name, "--steps", str(steps), *args],
                          check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
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
    parser.add_argument("--live-memory", action="store_true",
                        help="malloc gives back what is freed (mallopt): the peak of what the tensors hold")
    parser.add_argument("--entry", choices=list(ENTRIES), help=argparse.SUPPRESS)  # one entry, in this process
    args = parser.parse_args()
    set_process_defaults()  # before torch is imported, as train.py
    if args.entry:
        row = measure(ENTRIES[args.entry][0], entry_overrides(args.entry, args.data), args.steps, args.live_memory)
        if row is not None:  # rank 0
            print(json.dumps(row), flush=True)
        return
    from machine import REPO, machine_info, write_result

    rows = []
    for name in args.only:
        row = run_entry(name, args.steps, args.data, args.live_memory)
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
