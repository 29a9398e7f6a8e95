"""Run every cell of one of the paper's tables or figures, at the paper's size or scaled down.

    python -m xlm_pkm.experiments.reproduce table2 --scale tiny [--seeds 0 1 2] [--dry-run] [--only NAME...]
        [--set key=value...]
    python -m xlm_pkm.experiments.reproduce table1 --scale paper --slurm --partition learn --gpus-per-node 8
    scripts/reproduce.sh figure6 --scale small --data data/ccnews/processed

Tables: table1 (and figure4, the same runs), table2, table3, table4, figure6, and variants (every
config of configs/variants/paper: the memory designs' study of results/variants, its dense cells
widened to the PKM cell's parameters or FLOPs). A cell is a config of configs/paper, configs/ablations
or configs/variants/paper; cells whose configs resolve to the same model and training (the
ablation model is Table 2's 512²/BatchNorm cell, Table 3's position 5, Figure 6's 4 heads × k=32
and Table 4's product keys at 512²) share one run, named after the first of them in the order
table1, table2, table3, table4, figure6. Each run is a normal run directory
`DUMP/<run>/<scale>` (train.exp_name=<run>, train.exp_id=<scale>) made by train.py, then
evaluate.py --json writes its test result to `test.json` there, and `reproduce.json` records the
cells it serves and both commands. A run with test.json is done and skipped; an interrupted one
resumes from its checkpoint.pt (same exp_id). With `--seeds S...` every run is made once per seed
(train.seed=S: the initial weights, the data order and dropout), in `DUMP/<run>/<scale>-seed<S>`, and
the report gives each cell's mean and spread over them. Locally the runs go one after another as
subprocesses; with --slurm they are one submitit job array (--cluster local or debug to try it
without SLURM), each job requeued on timeout or pre-emption and resumed.

Scales. `paper` adds no override. `small` and `tiny` divide each size of the cell's own config by
a fixed factor, so that every cell of a table shrinks alike and the table's comparisons (memory
size against memory size, layer against layer, product against flat keys, heads × k) keep their
ratios:

                                      small        tiny
    width: model.dim, memory.k_dim     ÷ 4          ÷ 8        (1024 -> 128, 1600 -> 200, 512 -> 64)
    attention heads                    ÷ 4          ÷ 8        (head dimension kept; at least 1)
    depth, Table 1 only                ÷ 2          ÷ 4        (12/16/24 -> 3/4/6 at tiny; the
                                                               6-layer ablation model keeps its 6,
                                                               Table 3 places the memory in each)
    memory layers                      l -> round(l · L'/L)    (Table 1's 18 of 24 -> 5 of 6, 9 of
                                                               12 -> 2 of 3; a cell whose memories
                                                               would collide is not run)
    memory sub-keys n_keys             ÷ 4          ÷ 8        (slots ÷ 16 / ÷ 64: Table 2's 16k..1M
                                                               -> 256..16k slots at tiny)
    memory k (knn)                     ÷ 2          ÷ 4        (32 -> 8; Figure 6's 8..64 -> 2..16;
                                                               memory heads kept)
    sequences × bptt per step          32 × 128     16 × 64    (paper: 32 × 256 per GPU)
    steps, warm-up steps               20,000, 400  400, 40
    learning rates (dense and values)  × 2          × 4        (short runs need larger steps; the
                                                               paper's 1:4 ratio of dense to value
                                                               lr is kept)
    evaluations                        every 2,000  every 100  on 100 / 20 valid batches; test: all
    precision                          as the paper fp32       (tiny runs on a CPU)
    data                               as the paper data/processed/sample (the bundled corpus)

Extra `--set key=value` overrides go to every run last (e.g. train.num_threads=1, train.device=cpu).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from xlm_pkm.config import Config, load_config, to_dict
from xlm_pkm.errors import EXIT_STOPPED, ConfigError
from xlm_pkm.experiments.report import HEADS, KEYS, KNNS
from xlm_pkm.model.transformer import resolve_memory_layers
from xlm_pkm.runs.sizes import model_size
from xlm_pkm.utils.atomic import write_text

REPO = Path(__file__).resolve().parents[2]
PAPER, ABLATIONS = "configs/paper", "configs/ablations"


class UnscalableCell(ValueError):
    """A cell that a scale cannot shrink (its memories would collide, or k would exceed n_keys)."""


@dataclass(frozen=True)
class Scale:
    name: str
    width: int = 1  # divides model.dim, memory.k_dim and the attention heads
    depth: int = 1  # divides Table 1's layers
    keys: int = 1  # divides memory.n_keys
    knn: int = 1  # divides memory.knn
    batch_size: int = 0  # 0: the config's (as every field below)
    bptt: int = 0
    max_steps: int = 0
    warmup_steps: int = 0
    lr_mult: float = 1.0
    eval_every: int = 0
    eval_max_batches: int = 0
    precision: str = ""
    data: str = ""


SCALES = {
    "paper": Scale("paper"),
    "small": Scale("small", width=4, depth=2, keys=4, knn=2, batch_size=32, bptt=128, max_steps=20_000,
                   warmup_steps=400, lr_mult=2.0, eval_every=2000, eval_max_batches=100),
    "tiny": Scale("tiny", width=8, depth=4, keys=8, knn=4, batch_size=16, bptt=64, max_steps=400,
                  warmup_steps=40, lr_mult=4.0, eval_every=100, eval_max_batches=20, precision="fp32",
                  data="data/processed/sample"),
}


@dataclass(frozen=True)
class Cell:
    """One cell of a table: its config (relative to the repository) and its coordinates in the table."""

    table: str
    name: str
    config: str
    key: tuple  # e.g. (("n_keys", 512), ("batchnorm", True))
    scale_depth: bool = False


def _table1() -> list[Cell]:
    """The paper's Table 1 cells (it has no 16x1024x3, 24x1024x{2,3} nor 24x1600x1)."""
    cells = {1024: [(12, 0), (12, 1), (12, 2), (12, 3), (16, 0), (16, 1), (16, 2), (24, 0), (24, 1)],
             1600: [(12, 0), (12, 1), (16, 0), (16, 1), (24, 0)]}
    return [Cell("table1", f"l{layers}_d{dim}_m{n}", f"{PAPER}/l{layers}_d{dim}_m{n}.yaml",
                 (("layers", layers), ("dim", dim), ("memories", n)), scale_depth=True)
            for dim, pairs in cells.items() for layers, n in pairs]


NO_MEMORY = Cell("baseline", "ablation_no_memory", f"{ABLATIONS}/ablation_no_memory.yaml", ())
BASELINES = (NO_MEMORY, Cell("baseline", "ablation_base", f"{PAPER}/ablation_base.yaml", ()))

TABLES: dict[str, list[Cell]] = {
    "table1": _table1(),
    "table2": [NO_MEMORY] + [Cell("table2", f"table2_keys{n}_{norm}", f"{ABLATIONS}/table2_keys{n}_{norm}.yaml",
                                  (("n_keys", n), ("batchnorm", norm == "batchnorm")))
                             for n in KEYS for norm in ("none", "batchnorm")],
    "table3": [NO_MEMORY] + [Cell("table3", f"table3_position{p}", f"{ABLATIONS}/table3_position{p}.yaml",
                                  (("position", p),)) for p in range(1, 7)],
    # The paper trains flat keys up to 384² slots only; benchmarks/inference_speed.py times them beyond.
    "table4": [Cell("table4", f"table4_keys{n}_{kind}",
                    f"{ABLATIONS}/table4_keys{n}_flat.yaml" if kind == "flat" else
                    f"{ABLATIONS}/table2_keys{n}_batchnorm.yaml", (("n_keys", n), ("key_type", kind)))
               for n in KEYS for kind in (("flat", "product") if n <= 384 else ("product",))],
    "figure6": [Cell("figure6", f"figure6_heads{h}_knn{k}", f"{ABLATIONS}/figure6_heads{h}_knn{k}.yaml",
                     (("heads", h), ("knn", k))) for h in HEADS for k in KNNS],
}
TABLES["figure4"] = TABLES["table1"]

# The memory variants' study (results/variants): every config of configs/variants/paper is a cell, so a
# design added there joins it. Some cells are matched to the PKM cell at the run's own scale, by one size
# computed here rather than written in their config, because scaling shrinks a memory (n_keys² slots)
# faster than an FFN: the dense cells widen every FFN (model.ffn_dim) to its parameters or training FLOPs
# per token; the Engram cells size their tables (model.engram.table_size) to its total parameters.
VARIANTS = "configs/variants/paper"
ENGRAM_CELLS = ("engram", "engram_share25", "engram_share50", "engram_share75")  # the allocation curve
MATCHED = {"dense_params": ("params", "model.ffn_dim"), "dense_flops": ("flops", "model.ffn_dim"),
           **{cell: ("params", "model.engram.table_size") for cell in ENGRAM_CELLS}}  # cell -> (what, size)
VARIANT_REFERENCE = "pkm"
TABLES["variants"] = [Cell("variants", path.stem, f"{VARIANTS}/{path.name}", (("variant", path.stem),))
                      for path in sorted((REPO / VARIANTS).glob("*.yaml"))]
CANONICAL_ORDER = ("table1", "table2", "table3", "table4", "figure6", "variants")


@functools.lru_cache(maxsize=None)
def _config(path: str, overrides: tuple[str, ...] = ()) -> Config:
    """The resolved config of a repository config file (cached: plan() resolves every cell; read it,
    never change it)."""
    try:
        return load_config(REPO / path, list(overrides))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _half_up(x: float) -> int:
    return math.floor(x + 0.5)


def scale_overrides(cell: Cell, scale: Scale) -> list[str]:
    """The overrides that shrink `cell`'s config to `scale` (see the module docstring)."""
    if scale.name == "paper":
        return []
    cfg = _config(cell.config)
    m, mem, optim = cfg.model, cfg.model.memory, cfg.optim
    layers = max(1, m.n_layers // scale.depth) if cell.scale_depth else m.n_layers
    mem_layers = resolve_memory_layers(m)
    scaled_layers = sorted({min(layers, max(1, _half_up(i * layers / m.n_layers))) for i in mem_layers})
    if len(scaled_layers) != len(mem_layers):
        raise UnscalableCell(f"{cell.config}: memories at layers {mem_layers} of {m.n_layers} collide at scale "
                          f"{scale.name} ({layers} layers)")
    n_keys, knn = max(1, mem.n_keys // scale.keys), max(1, mem.knn // scale.knn)
    if mem_layers and mem.key_type == "product" and knn > n_keys:
        raise UnscalableCell(f"{cell.config}: knn {knn} > n_keys {n_keys} at scale {scale.name}")
    bptt = scale.bptt or cfg.data.bptt
    out = [f"model.dim={m.dim // scale.width}", f"model.n_heads={max(1, m.n_heads // scale.width)}",
           f"model.n_layers={layers}", f"model.mem_layers=[{','.join(map(str, scaled_layers))}]",
           f"model.max_len={bptt}",
           f"model.memory.n_keys={n_keys}", f"model.memory.k_dim={mem.k_dim // scale.width}",
           f"model.memory.knn={knn}",
           f"data.batch_size={scale.batch_size or cfg.data.batch_size}", f"data.bptt={bptt}",
           f"optim.lr={optim.lr * scale.lr_mult:g}", f"optim.values_lr={optim.values_lr * scale.lr_mult:g}",
           f"optim.warmup_steps={scale.warmup_steps or optim.warmup_steps}",
           f"train.max_steps={scale.max_steps or cfg.train.max_steps}",
           f"train.log_every={max(1, (scale.eval_every or cfg.train.eval_every) // 4)}",
           f"train.eval_every={scale.eval_every or cfg.train.eval_every}",
           f"train.eval_max_batches={scale.eval_max_batches or cfg.train.eval_max_batches}"]
    if m.engram.layers:  # Engram's tables shrink as a memory's slots, its widths as the model's
        out += [f"model.engram.table_size={max(m.engram.heads, m.engram.table_size // scale.keys ** 2)}",
                "model.engram.ngram_dim="
                f"{max(1, m.engram.ngram_dim // scale.width // m.engram.heads) * m.engram.heads}"]
    if mem.expanded.value_dim:  # UltraMem's physical value width scales with the model's
        out.append(f"model.memory.expanded.value_dim={max(1, mem.expanded.value_dim // scale.width)}")
    if mem.tucker.topm:  # UltraMem's candidate rows and columns scale with k
        out.append(f"model.memory.tucker.topm={max(knn, mem.tucker.topm // scale.knn)}")
    if optim.values_lr_decay_steps:  # the values' lr decay spans the same share of the shorter run
        steps = scale.max_steps or cfg.train.max_steps
        decay_steps = max(1, _half_up(optim.values_lr_decay_steps * steps / cfg.train.max_steps))
        out.append(f"optim.values_lr_decay_steps={decay_steps}")
    if scale.precision:
        out.append(f"train.precision={scale.precision}")
    if scale.data:
        out.append(f"data.path={scale.data}")
    return out


def matched_size(cell: Cell, overrides: list[str], scale: Scale) -> str:
    """The override `key=value` of MATCHED[cell] that gives `cell`'s model the parameters (or FLOPs per
    token) of the VARIANT_REFERENCE cell at the same scale: solved from two sizes a and 2a, as both grow
    linearly with model.ffn_dim, then the closest of the sizes around the solution (model.engram.table_size
    is linear only up to the prime sizes of its heads' tables: steps of one row per head)."""
    reference = next(c for c in TABLES["variants"] if c.name == VARIANT_REFERENCE)
    measure, key = MATCHED[cell.name]
    what = {"params": "total", "flops": "flops"}[measure]
    ref_cfg = _config(reference.config, tuple(scale_overrides(reference, scale)))
    target = model_size(ref_cfg, ref_cfg.data.bptt)[what]
    engram = _config(cell.config, tuple(overrides)).model.engram
    table = key == "model.engram.table_size"
    a = engram.table_size if table else 1

    def size(v: int) -> float:
        return model_size(_config(cell.config, (*overrides, f"{key}={v}")), ref_cfg.data.bptt)[what]

    at = [size(v) for v in (a, 2 * a)]
    guess = _half_up(a + a * (target - at[0]) / (at[1] - at[0]))
    if not table:  # model.ffn_dim: exactly linear, the solution is the match
        return f"{key}={max(1, guess)}"
    nearby = [max(engram.heads, guess + d * engram.heads) for d in range(-8, 9)]
    return f"{key}={min(nearby, key=lambda v: abs(size(v) - target))}"


def _shown(path: Path) -> str:
    """A path as the commands show it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@dataclass
class Run:
    """One training run and every table cell it fills."""

    name: str
    config: str  # relative to the repository
    overrides: list[str]
    run_dir: Path  # absolute: DUMP/<name>/<scale>
    cells: list[Cell] = field(default_factory=list)
    test_max_batches: int = 0  # 0: the whole test split

    def train_argv(self, absolute: bool = False) -> list[str]:
        config = str(REPO / self.config) if absolute else self.config
        dump = self.run_dir.parent.parent
        return ["--config", config, *self.overrides, f"train.dump_path={dump if absolute else _shown(dump)}",
                f"train.exp_name={self.run_dir.parent.name}", f"train.exp_id={self.run_dir.name}", "--no-test"]

    def evaluate_argv(self, absolute: bool = False) -> list[str]:
        precision = _config(self.config, tuple(self.overrides)).train.precision
        where = str(self.run_dir) if absolute else _shown(self.run_dir)
        limit = ["--max-batches", str(self.test_max_batches)] if self.test_max_batches else []
        return ["--checkpoint", f"{where}/best.pt", "--split", "test", "--precision", precision, *limit,
                "--json", f"{where}/test.json"]

    def commands(self) -> list[str]:
        """The two command lines, run from the repository root."""
        return [shlex.join(["python", "train.py", *self.train_argv()]),
                shlex.join(["python", "evaluate.py", *self.evaluate_argv()])]

    def done(self) -> bool:
        return (self.run_dir / "test.json").is_file()

    def state(self) -> str:
        return "done" if self.done() else "partial" if (self.run_dir / "checkpoint.pt").exists() else "new"

    def record(self, scale: str) -> None:
        """Writes reproduce.json (the cells this run fills, its commands, the commit) into the run directory."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        info = {"run": self.name, "scale": scale, "config": self.config, "commit": git_commit(),
                "cells": [{"table": c.table, "cell": c.name, "key": dict(c.key)} for c in self.cells],
                "commands": self.commands()}
        write_text(self.run_dir / "reproduce.json", json.dumps(info, indent=2) + "\n")


def git_commit() -> str:
    """HEAD of the repository (with '+dirty' when tracked files changed), or '' outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _identity(cell: Cell, overrides: list[str]) -> str:
    """A hash of everything that defines the run but its name."""
    raw = to_dict(_config(cell.config, tuple(overrides)))  # a copy
    raw["train"].pop("exp_name")
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def last_wins(overrides: list[str]) -> list[str]:
    """`overrides` without those whose key a later one sets again (--data over the scale's data.path)."""
    keys = [item.partition("=")[0] for item in overrides]
    return [item for i, item in enumerate(overrides) if keys[i] not in keys[i + 1:]]


def plan(table: str, scale: Scale, dump: Path, extra: list[str] = (), only: list[str] = (),
         test_max_batches: int = 0, seed: int | None = None) -> tuple[list[Run], list[str]]:
    """The runs of `table` at `scale` in `dump`, and one line per cell that cannot be scaled.

    Cells whose configs resolve to the same run share it; the run is named after the first of them in
    BASELINES then CANONICAL_ORDER, and lists every cell of every table it fills. A `seed` sets
    train.seed in every run and names its directory `<scale>-seed<seed>` (None: the configs' seed, `<scale>`)."""
    if table not in TABLES:
        raise ConfigError(f"unknown table {table!r}; choose from {', '.join(TABLES)}")
    unknown = sorted(set(only) - {c.name for c in TABLES[table]})
    if unknown:
        raise ConfigError(f"--only {' '.join(unknown)}: not a cell of {table} (its cells: "
                          f"{', '.join(c.name for c in TABLES[table])})")
    if seed is not None:
        extra = [*extra, f"train.seed={seed}"]
    members: dict[str, list[Cell]] = {}  # identity -> every cell with that run, first one names it
    wanted: dict[str, list[str]] = {}  # identity -> overrides, for the cells of `table` to run
    skipped = []
    for cell in dict.fromkeys([*BASELINES, *(c for t in CANONICAL_ORDER for c in TABLES[t])]):
        if cell.name in MATCHED and cell not in TABLES[table]:
            continue  # widened for the study only: never the run of another table's cell
        try:
            overrides = last_wins([*scale_overrides(cell, scale), *extra])
            if cell.name in MATCHED:
                overrides.append(matched_size(cell, overrides, scale))
        except UnscalableCell as e:
            if cell in TABLES[table]:
                skipped.append(str(e))
            continue
        identity = _identity(cell, overrides)
        members.setdefault(identity, []).append(cell)
        if cell in TABLES[table] and (not only or cell.name in only):
            wanted.setdefault(identity, (cell, overrides))
    dump, exp_id = Path(dump).resolve(), scale.name if seed is None else f"{scale.name}-seed{seed}"
    return [Run(members[i][0].name, cell.config, overrides, dump / members[i][0].name / exp_id,
                [c for c in members[i] if c.table != "baseline" or c is NO_MEMORY], test_max_batches)
            for i, (cell, overrides) in wanted.items()], skipped


def run_local(run: Run, scale: str) -> bool:
    """Trains (or resumes) then evaluates one run, as subprocesses from the repository root; False if
    one of them failed."""
    if run.done():
        print(f"{run.name}: done, skipped", flush=True)
        return True
    run.record(scale)
    for argv in (["train.py", *run.train_argv()], ["evaluate.py", *run.evaluate_argv()]):
        print(f"{run.name}: {shlex.join(['python', *argv])}", flush=True)
        if subprocess.run([sys.executable, *argv], cwd=REPO).returncode:
            print(f"{run.name}: failed; rerun to resume it", file=sys.stderr, flush=True)
            return False
    return True


class RunJob:
    """One run as a submitit job: train (resuming) then evaluate, in the job's process. Stopped by the
    time-limit warning, train.py checkpoints and requeues the job (exit 75, "stopped": not a failure);
    outside training, submitit's checkpoint() requeues it. The requeued job resumes through the same
    exp_id."""

    def __init__(self, run: Run, scale: str):
        self.run, self.scale = run, scale

    def __call__(self) -> str:
        from xlm_pkm.launch.cli import evaluate_main, train_main

        if self.run.done():
            return "done"
        self.run.record(self.scale)
        status = train_main(self.run.train_argv(absolute=True))
        if status == EXIT_STOPPED:
            return "stopped"
        if not status:
            status = evaluate_main(self.run.evaluate_argv(absolute=True))
        if status:
            raise RuntimeError(f"{self.run.name}: exited with status {status}; see the job's stderr")
        return "done"

    def checkpoint(self):
        import submitit

        return submitit.helpers.DelayedSubmission(RunJob(self.run, self.scale))


def submit(runs: list[Run], scale: str, args) -> list:
    """The runs not yet done as one submitit job array; with --cluster debug they run here, now."""
    import submitit

    todo = [r for r in runs if not r.done()]
    if not todo:
        return []
    executor = submitit.AutoExecutor(folder=args.folder, cluster=args.cluster)
    params = {"timeout_min": args.time, "nodes": 1, "tasks_per_node": 1, "cpus_per_task": args.cpus_per_task,
              "name": f"reproduce-{scale}", "slurm_array_parallelism": args.array_parallelism}
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    if args.partition:
        params["slurm_partition"] = args.partition
    executor.update_parameters(**params)
    jobs = executor.submit_array([RunJob(r, scale) for r in todo])
    for run, job in zip(todo, jobs):
        print(f"{run.name}: job {job.job_id}", flush=True)
    if executor.cluster == "debug":
        for job in jobs:
            job.result()
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.reproduce", description=__doc__.split("\n")[0])
    parser.add_argument("table", choices=list(TABLES))
    parser.add_argument("--scale", default="paper", choices=list(SCALES))
    parser.add_argument("--dump", default="dumped/reproduce", help="runs go to DUMP/<run>/<scale>")
    parser.add_argument("--data", help="processed data directory (default: the scale's, else the config's)")
    parser.add_argument("--set", nargs="+", default=[], metavar="key.sub=value", help="overrides for every run")
    parser.add_argument("--only", nargs="+", default=[], metavar="CELL", help="run only these cells")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="S",
                        help="make every run once per seed, in DUMP/<run>/<scale>-seed<S> (default: once, with the "
                             "configs' seed, in DUMP/<run>/<scale>)")
    parser.add_argument("--test-max-batches", type=int, default=0, help="evaluate on this many test batches (0: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their commands")
    slurm = parser.add_argument_group("SLURM (submitit job array)")
    slurm.add_argument("--slurm", action="store_true", help="submit a job array instead of running here")
    slurm.add_argument("--cluster", default=None, choices=["slurm", "local", "debug"], help="default: auto")
    slurm.add_argument("--partition", default="")
    slurm.add_argument("--gpus-per-node", type=int, default=1, help="one GPU per run; 0 for CPU jobs")
    slurm.add_argument("--cpus-per-task", type=int, default=10)
    slurm.add_argument("--time", type=int, default=4320, help="minutes per job (then requeued)")
    slurm.add_argument("--array-parallelism", type=int, default=64)
    slurm.add_argument("--folder", default="dumped/reproduce/slurm/%j", help="submitit's logs and pickles")
    args = parser.parse_args(argv)
    # data.path resolved: the caller's relative path
    extra = [*([f"data.path={Path(args.data).resolve()}"] if args.data else []), *args.set]
    try:
        runs, skipped = [], []
        for seed in args.seeds or [None]:
            seed_runs, skipped = plan(args.table, SCALES[args.scale], Path(args.dump), extra, args.only,
                                      args.test_max_batches, seed)
            runs += seed_runs
    except (ConfigError, ValueError) as e:
        print(f"reproduce: error: {e}", file=sys.stderr)
        return 2
    for line in skipped:
        print(f"not run: {line}")
    if args.dry_run:
        for run in runs:
            print(f"{run.name} [{run.state()}] fills {', '.join(f'{c.table}:{c.name}' for c in run.cells)}")
            for command in run.commands():
                print(f"  {command}")
        return 0
    if args.slurm:
        submit(runs, args.scale, args)
        return 0
    failed = [run.name for run in runs if not run_local(run, args.scale)]
    if failed:
        print(f"reproduce: {len(failed)} run(s) failed: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":  # through the importable module: its jobs then pickle by reference, not __main__'s
    from xlm_pkm.experiments import reproduce

    sys.exit(reproduce.main())
