"""A study file, the runs it asks for, and each cell's learning rate chosen on validation data.

A study is cells × seeds × a grid of learning-rate factors, every run trained on the same number of
tokens. Its file (YAML; relative paths are from the repository root):

    name: variants
    scale: tiny                  # optional: reproduce.py's scale applied to each cell's config first
    tokens: 1638400              # training tokens per run
    eval_every_tokens: 102400    # validation cadence
    seeds: [0, 1, 2]             # the first one also picks the learning rate
    lr_grid: [0.5, 1, 2]         # factors on every learning rate of a cell together
    lr_extend: 2                 # optional (default 0): steps the grid may grow past an end (see below)
    lr_refine: 1                 # optional (default 0): halvings of the step around the best (see below)
    diverge_ratio: 1.2           # optional (default 0: no rule): the divergence rule (see below)
    robustness: true             # optional (default false): every seed also at each cell's next lower factor
    set: [train.num_threads=1]   # optional: overrides for every run (a cell's own come after them)
    world_size: 1                # optional: processes per run (torchrun beyond 1)
    test_max_batches: 0          # optional: test batches evaluated (0: the whole split)
    dump: dumped/study/variants  # optional: run directories, checkpoints included
    results: results/variants/runs      # optional (default: beside the study file, runs/): small files
    report: results/variants/report.md  # optional (default: beside the study file, report.md)
    cells:                       # name: {config: FILE, set: [key=value, ...]}, in the report's order
      pkm: {config: configs/variants/paper/pkm.yaml}
      dense: {config: configs/variants/paper/dense_params.yaml, set: [model.ffn_dim=595]}
    comparisons:                 # the claims "a has a lower test perplexity than b", paired by seed
      - {a: pkm, b: dense, claim: "PKM beats a dense model of its parameters"}
      - {a: dense, b: pkm, metric: usage, claim: "..."}  # metric (default ppl): usage, the first memory's test usage %

A run's overrides, in order: the scale's, the study's `set`, the cell's `set`, then the budget
(train.max_steps = ⌈tokens / (data.batch_size × data.bptt × optim.accumulate × world_size)⌉,
train.eval_every from eval_every_tokens likewise, train.log_every a quarter of it), the learning
rates (each of LR_KEYS times the factor, so their ratios stay), and train.seed. Learning rates given
as a ratio (optim.engram_lr_scale to optim.lr, optim.values_lr_start_factor to optim.lr or optim.values_lr,
by optim.values_lr_decay_base) follow it.

Learning rates are chosen on validation data only: the first seed runs at every factor of the grid;
a cell's factor is the one whose run has the lowest valid perplexity (that of best.pt, the checkpoint
that the test evaluates: the minimum over the run's evaluations; ties: the smaller factor); every
other seed then runs at that factor, and only the runs at the chosen factor are evaluated on the test
split. While the best factor is at an end of the grid, the cell's grid grows one step past that end (by
the ratio of the two outermost factors there: ×2 for [0.5, 1, 2]), up to lr_extend steps; a choice still
at an end after them is flagged (the optimum may lie beyond it). Then, lr_refine times, the grid is refined
around the best factor: the geometric midpoints between it and each of its trained neighbours (√(f·g): ×2√2 and
×4√2 around ×4 on a ×2 grid) are trained, and the best over every trained factor is the new best.

The divergence rule (diverge_ratio r > 0), decided from a trained run's metrics.jsonl: the run diverged when a
valid perplexity is not finite, or its last valid perplexity is above r × its lowest (it blew up after its
best), or, for a seed other than the first, its lowest valid perplexity is above r × the first seed's lowest
at the same factor. A seed whose run at the chosen factor diverged is run again at the next lower factor of the
cell's grid (and again, while that one diverges and a lower factor is left); its last run is the one tested and
compared, and the report shows the diverged one beside it.

Robustness (robustness: true): every seed also runs at each cell's next lower factor of its grid (the
neighbour: the upper one is where runs diverge), tested once the settings are final; the report re-computes
each claim with a, then b, at its neighbour (whatever runs hold it, declared or not: "not run" otherwise).

The test split is read only once the study's settings are final (`open_cells`: every cell's factor chosen, and
every seed's run trained, re-runs of the divergence rule included): no choice can then move after a test read.

Run `<cell>`, factor f, seed s is the run directory DUMP/<cell>/lr<f>-seed<s> (train.py's exp_name and
exp_id, so that the same command resumes it) and the results folder RESULTS/<cell>/lr<f>-seed<s>:
config.yaml, metrics.jsonl and run.json (the exact commands; written last: the run is trained) once
trained, test.json once evaluated (with the test_max_batches it was read with, "max_batches"). A cell's name is
one folder name (no / or \\, not . or .., at most 255 bytes): the study file is refused otherwise, before anything
is written. A key given twice in the study file (a cell named twice) is refused too, naming both lines.

A trained run counts for the study only while its resolved config (its config.yaml) is the one the study
asks of it now: after the study file changes (tokens, `set:`, a cell's config), a run trained before is
stale (Study.changes): `plan` shows it with the settings that differ, and `run` and `report` refuse
until it is moved away (its results and run directory) to be trained again, or the file is restored. Settings
of how a run computes, not what (settings.execution: a kernel, a fused optimizer, a table layout; their defaults
change as GPUs measure them) do not count.

A test counts only while it was read with the study's test_max_batches now (StudyRun.test_read_with): after
that key changes, the test.json of a run the study tests is stale (Study.stale_tests): `plan` shows it, `run`
reads it again with the new setting, and `report` refuses until then (it would average test perplexities read on
different numbers of tokens).
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from xlm_pkm.config import Config, load_config, load_config_dict, to_dict
from xlm_pkm.errors import UserError
from xlm_pkm.experiments.reproduce import REPO, SCALES, Cell, Run, _config, scale_overrides
from xlm_pkm.runs.run_record import read_json_lines, read_yaml
from xlm_pkm.settings import execution_keys
from xlm_pkm.train.run_dir import config_changes, saved_step
from xlm_pkm.utils.path_component import check_path_component

# The absolute learning rates of OptimConfig, scaled together by a grid factor (ratios to them follow them).
LR_KEYS = ("lr", "values_lr", "warmup_init_lr")
LR_RATIOS = ("engram_lr_scale", "values_lr_start_factor")
# What a run's config.yaml holds beyond the plan's config: where the run is, and the vocabulary size read from its data
RESOLVED = (("train", "exp_id"), ("train", "exp_name"), ("train", "dump_path"), ("model", "vocab_size"))
KEYS = {"name", "scale", "tokens", "eval_every_tokens", "seeds", "lr_grid", "lr_extend", "lr_refine", "set",
        "world_size", "test_max_batches", "dump", "results", "report", "cells", "comparisons", "diverge_ratio",
        "robustness"}


class StudyError(UserError, ValueError):
    """A study file that cannot be run as written."""


METRICS = ("ppl", "usage")  # what a comparison compares: test perplexity, or the first memory's test usage %


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    claim: str
    metric: str = "ppl"  # one of METRICS: a's is claimed lower than b's


@dataclass(frozen=True)
class Choice:
    """A cell's learning-rate factor, chosen on the first seed's valid perplexity at each factor of the grid."""

    cell: str
    valid: dict[float, float]  # factor -> valid perplexity of best.pt
    factor: float
    edge: str  # "" inside the cell's grid; "lowest" or "highest": at that end of it, lr_extend spent


@dataclass(frozen=True)
class StudyRun:
    """One run of a study: where it trains (run.run_dir), where its small files go, how long it trains."""

    cell: str
    factor: float
    seed: int
    run: Run  # reproduce.Run: config, overrides, run directory, the train and evaluate arguments
    results: Path
    steps: int
    tokens_per_step: int
    world_size: int = 1

    @property
    def id(self) -> str:
        return run_id(self.factor, self.seed)

    @property
    def trained(self) -> bool:
        return (self.results / "run.json").is_file()

    @property
    def tested(self) -> bool:
        """Its test.json is in the results, read with the study's test_max_batches now (test_read_with)."""
        return self.test_read_with() == self.run.test_max_batches

    @property
    def test_stale(self) -> bool:
        """Its test.json is in the results but was read with another test_max_batches than the study's now."""
        read = self.test_read_with()
        return read is not None and read != self.run.test_max_batches

    def test_read_with(self) -> int | None:
        """The test_max_batches (0: the whole split) the test.json in the results was read with; None: no test.json.
        Its record (`max_batches`, written as the study collects it), or, in a test.json from before that record,
        the --max-batches of the test command in its run.json; without either, the study's now."""
        path = self.results / "test.json"
        if not path.is_file():
            return None
        try:
            test = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise StudyError(f"{path}: not a readable test result ({e})") from None
        if isinstance(test, dict) and isinstance(test.get("max_batches"), int):
            return test["max_batches"]
        try:
            argv = shlex.split(json.loads((self.results / "run.json").read_text())["commands"]["test"])
            return int(argv[argv.index("--max-batches") + 1]) if "--max-batches" in argv else 0
        except (OSError, ValueError, LookupError, TypeError, AttributeError):
            return self.run.test_max_batches

    @property
    def checkpoint(self) -> Path:
        """best.pt in the dump: what the test job evaluates."""
        return self.run.run_dir / "best.pt"

    @property
    def evaluable(self) -> bool:
        """best.pt is in the dump and the run there is finished (its checkpoint.pt saved at the last step): a
        re-train cut part-way leaves the best.pt of its first steps, which the test must not read."""
        last = self.run.run_dir / "checkpoint.pt"
        if not (self.checkpoint.is_file() and last.is_file()):
            return False
        try:
            return saved_step(last) >= self.steps
        except Exception:  # noqa: BLE001 - unreadable (torch raises any type): the re-train's resume says why
            return False

    @property
    def retrained(self) -> Path:
        """Where the small files of the run trained again go when its checkpoint was gone (study.retrain)."""
        return self.results / "retrained"

    def train_command(self) -> list[str]:
        """From the repository root: python train.py ... (torchrun beyond one process)."""
        launcher = ["python"] if self.world_size == 1 else ["torchrun", f"--nproc_per_node={self.world_size}"]
        return [*launcher, "train.py", *self.run.train_argv()]

    def evaluate_command(self) -> list[str]:
        return ["python", "evaluate.py", *self.run.evaluate_argv()]

    def valid_curve(self, folder: Path | None = None) -> list[float]:
        """The valid perplexity of each evaluation of the trained run, in order, from its metrics.jsonl (in
        `folder`: the results by default)."""
        metrics = (folder or self.results) / "metrics.jsonl"
        try:
            events = read_json_lines(metrics)
        except (OSError, ValueError) as e:
            raise StudyError(str(e)) from None
        ppl = [e["ppl"] for e in events if e.get("event") == "valid"]
        if not ppl:
            raise StudyError(f"{metrics}: no valid evaluation to choose a learning rate on")
        return ppl

    def valid_ppl(self, folder: Path | None = None) -> float:
        """The lowest valid perplexity of the trained run (the one of best.pt), from its metrics.jsonl."""
        return min(self.valid_curve(folder))


def run_id(factor: float, seed: int) -> str:
    return f"lr{factor:g}-seed{seed}"


@dataclass(frozen=True)
class Study:
    path: Path
    name: str
    cells: dict[str, tuple[str, tuple[str, ...]]]  # name -> (config file, its overrides)
    seeds: tuple[int, ...]
    lr_grid: tuple[float, ...]
    tokens: int
    eval_every_tokens: int
    dump: Path
    results: Path
    report: Path
    scale: str = "paper"
    set: tuple[str, ...] = ()
    world_size: int = 1
    test_max_batches: int = 0
    comparisons: tuple[Comparison, ...] = field(default_factory=tuple)
    lr_extend: int = 0
    lr_refine: int = 0
    diverge_ratio: float = 0.0  # the divergence rule's r (module docstring); 0: no rule
    robustness: bool = False  # every seed also at each cell's next lower factor

    def base_overrides(self, cell: str) -> list[str]:
        """The overrides of `cell` before the budget, the learning rate and the seed."""
        config, own = self.cells[cell]
        return [*scale_overrides(Cell("study", cell, config, ()), SCALES[self.scale]), *self.set, *own]

    def base_config(self, cell: str) -> Config:
        return _config(self.cells[cell][0], tuple(self.base_overrides(cell)))

    def run(self, cell: str, factor: float, seed: int) -> StudyRun:
        cfg = self.base_config(cell)
        per_step = cfg.data.batch_size * cfg.data.bptt * cfg.optim.accumulate * self.world_size
        steps, eval_every = math.ceil(self.tokens / per_step), max(1, round(self.eval_every_tokens / per_step))
        overrides = [*self.base_overrides(cell), f"train.max_steps={steps}", f"train.eval_every={eval_every}",
                     f"train.log_every={max(1, eval_every // 4)}",
                     *(f"optim.{k}={factor * getattr(cfg.optim, k):.6g}" for k in LR_KEYS), f"train.seed={seed}"]
        name = run_id(factor, seed)
        run = Run(cell, self.cells[cell][0], overrides, self.dump / cell / name, test_max_batches=self.test_max_batches)
        return StudyRun(cell, factor, seed, run, self.results / cell / name, steps, per_step, self.world_size)

    def only(self, cells: list[str]) -> Study:
        """The study restricted to `cells` (and the comparisons between them): to run a part of it."""
        unknown = sorted(set(cells) - set(self.cells))
        if unknown:
            raise StudyError(f"{self.path}: no cell {', '.join(unknown)} (its cells: {', '.join(self.cells)})")
        return replace(self, cells={c: v for c, v in self.cells.items() if c in cells},
                       comparisons=tuple(c for c in self.comparisons if {c.a, c.b} <= set(cells)))

    def grid(self, cell: str) -> tuple[float, ...]:
        """The cell's factors: lr_grid, grown one step past an end while the first seed's best valid perplexity is
        at that end (the step: the ratio of the two outermost factors there), at most lr_extend times, then
        refined lr_refine times around the best (the midpoints to its neighbours)."""
        return self._grown(cell)[0]

    def _grown(self, cell: str) -> tuple[tuple[float, ...], dict[float, float] | None]:
        """(the cell's grid, {factor: valid perplexity} of the first seed's runs on it, None until all are
        trained), each run's metrics read once."""
        grid, valid = list(self.lr_grid), {}

        def all_read() -> bool:  # the valid perplexity of every factor of grid in `valid`; False: one untrained
            for run in (self.run(cell, f, self.seeds[0]) for f in grid if f not in valid):
                if not run.trained:
                    return False
                valid[run.factor] = run.valid_ppl()
            return True

        for step in range(self.lr_extend + 1):
            if not all_read():
                return tuple(grid), None
            best = _best(valid)
            if step == self.lr_extend or len(grid) < 2 or best not in (grid[0], grid[-1]):
                break
            if best == grid[-1]:
                grid.append(_factor(grid[-1] * grid[-1] / grid[-2]))
            else:
                grid.insert(0, _factor(grid[0] * grid[0] / grid[1]))
        for _ in range(self.lr_refine):
            best, trained = _best(valid), sorted(valid)
            i = trained.index(best)
            neighbours = trained[max(0, i - 1):i] + trained[i + 1:i + 2]
            grid = sorted({*grid, *(_factor(math.sqrt(best * g)) for g in neighbours)})
            if not all_read():
                return tuple(grid), None
        return tuple(grid), valid

    def grid_runs(self, cell: str) -> list[StudyRun]:
        """The first seed's runs at every factor of the cell's grid: the learning rate is chosen on them."""
        return [self.run(cell, f, self.seeds[0]) for f in self.grid(cell)]

    def choice(self, cell: str) -> Choice | None:
        """The cell's factor, once every run of its grid is trained (None before); reads valid metrics only."""
        grid, valid = self._grown(cell)
        if valid is None:
            return None
        best = _best(valid)
        edge = "" if len(grid) < 2 else "lowest" if best == grid[0] else "highest" if best == grid[-1] else ""
        return Choice(cell, valid, best, edge)

    def changes(self, run: StudyRun) -> list[str]:
        """'key: trained -> planned' for each setting where the trained run's config (config.yaml in its results)
        differs from the one the study asks of it now; [] when it is the plan's run."""
        path = run.results / "config.yaml"
        try:
            trained = to_dict(load_config_dict(read_yaml(path), source=str(path)))
        except (OSError, ValueError) as e:
            raise StudyError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
        base = self.base_overrides(run.cell)  # the cell's config, resolved once; then the run's own overrides
        planned = to_dict(load_config(None, run.run.overrides[len(base):], start=to_dict(self.base_config(run.cell))))
        for section, key in RESOLVED:
            if key != "vocab_size" or not planned[section][key]:  # a vocabulary size given in the plan counts
                trained[section][key] = planned[section][key]
        how = execution_keys(self.base_config(run.cell))  # how it ran (a kernel, a layout), not what it computed
        return [change for change in config_changes(trained, planned) if change.split(":")[0] not in how]

    def stale_runs(self) -> list[tuple[StudyRun, list[str]]]:
        """(run, its changes) of every trained run in the results whose config is not the one the study asks of it
        now (StudyRun.changes): the study file changed since it trained."""
        stale = []
        for cell in self.cells:
            for info in sorted((self.results / cell).glob("*/run.json")):
                found = re.fullmatch(r"lr(.+)-seed(\d+)", info.parent.name)
                if found:
                    run = self.run(cell, float(found.group(1)), int(found.group(2)))
                    changes = self.changes(run)
                    if changes:
                        stale.append((run, changes))
        return stale

    def refuse_stale(self) -> None:
        """A one-line StudyError naming the stale runs (stale_runs) and how to train them again."""
        stale = self.stale_runs()
        if stale:
            (first, changes), more = stale[0], len(stale) - 1
            differ = "; ".join(changes[:3]) + (" ..." if len(changes) > 3 else "")
            raise StudyError(
                f"{self.path}: {len(stale)} trained run(s) are not the runs this study file asks for now (it changed "
                f"since they trained): {first.cell}/{first.id} ({differ}){f' and {more} more' if more else ''}; "
                f"`study plan` lists them. To train them again, move away "
                f"their results and run directories ({first.results} and {first.run.run_dir}, or give the study "
                f"new `results` and `dump` folders); or restore the study file")

    def stale_tests(self) -> list[tuple[StudyRun, int]]:
        """(run, the test_max_batches it was read with) of each run the study tests (every seed at a cell's chosen
        factor, the robustness runs) whose test.json was read with another test_max_batches than the study's now."""
        runs = [r for cell in self.cells for r in (*self.chosen_runs(cell), *self.robustness_runs(cell))]
        return [(r, r.test_read_with()) for r in runs if r.test_stale]

    def refuse_stale_tests(self) -> None:
        """A one-line StudyError naming the stale tests (stale_tests): a report mixes no two test settings."""
        stale = self.stale_tests()
        if stale:
            (first, read), more = stale[0], len(stale) - 1
            raise StudyError(
                f"{self.path}: {len(stale)} test result(s) were read with another test_max_batches than the study's "
                f"{self.test_max_batches} now: {first.results / 'test.json'} with {read}"
                f"{f' and {more} more' if more else ''}; a report does not mix test perplexities read on different "
                f"numbers of tokens: `study run` reads them again with the study's setting (or restore "
                f"test_max_batches: {read})")

    def chosen_runs(self, cell: str) -> list[StudyRun]:
        """Every seed's run at the chosen factor ([] before the choice), or, where the divergence rule re-ran it,
        its last re-run: the runs evaluated on test and compared."""
        return [runs[-1] for runs in self.seed_runs(cell).values()]

    def seed_runs(self, cell: str) -> dict[int, list[StudyRun]]:
        """{seed: its runs from the chosen factor down} ({} before the choice): the run at the chosen factor, then,
        while the last is trained and diverged (`diverged`) and the grid has a lower factor, the run there."""
        choice = self.choice(cell)
        if choice is None:
            return {}
        lower = sorted((f for f in self.grid(cell) if f < choice.factor), reverse=True)
        out = {}
        for seed in self.seeds:
            runs = [self.run(cell, choice.factor, seed)]
            while runs[-1].trained and self.diverged(runs[-1]) and len(runs) <= len(lower):
                runs.append(self.run(cell, lower[len(runs) - 1], seed))
            out[seed] = runs
        return out

    def diverged(self, run: StudyRun) -> str:
        """Why the trained run diverged under the divergence rule (module docstring), "" if it did not (or no rule)."""
        if not self.diverge_ratio:
            return ""
        curve, r = run.valid_curve(), self.diverge_ratio
        if not all(map(math.isfinite, curve)):
            return "a valid perplexity not finite"
        if curve[-1] > r * min(curve):
            return f"last valid {curve[-1]:.1f} > {r:g} × its best {min(curve):.1f}"
        first = self.run(run.cell, run.factor, self.seeds[0])
        if run.seed != self.seeds[0] and first.trained and min(curve) > r * first.valid_ppl():
            return f"best valid {min(curve):.1f} > {r:g} × seed {self.seeds[0]}'s {first.valid_ppl():.1f}"
        return ""

    def neighbour(self, cell: str) -> float | None:
        """The factor of the cell's grid just below its choice (None: no choice yet, or the choice is the lowest)."""
        choice = self.choice(cell)
        lower = [f for f in self.grid(cell) if choice and f < choice.factor]
        return max(lower) if lower else None

    def robustness_runs(self, cell: str) -> list[StudyRun]:
        """Every seed's run at the cell's neighbour factor, when the study asks for robustness ([] otherwise)."""
        factor = self.neighbour(cell) if self.robustness else None
        return [] if factor is None else [self.run(cell, factor, s) for s in self.seeds]

    def known_runs(self, cell: str) -> list[StudyRun]:
        """Every run of the cell known now, once each: its grid, the chosen factor's seeds and their divergence
        re-runs, the robustness runs."""
        runs = [*self.grid_runs(cell), *(r for rs in self.seed_runs(cell).values() for r in rs),
                *self.robustness_runs(cell)]
        return list({r.id: r for r in runs}.values())

    def open_cells(self) -> dict[str, str]:
        """{cell: what is still open} for each cell whose settings are not final: its factor not chosen, or a
        seed's run (a divergence re-run included) not trained. Empty: the test split may be read."""
        out = {}
        for cell in self.cells:
            grid = self.grid_runs(cell)
            if self.choice(cell) is None:
                out[cell] = f"lr not chosen, {sum(r.trained for r in grid)} of {len(grid)} grid runs trained"
                continue
            untrained = [r.id for r in self.chosen_runs(cell) if not r.trained]
            if untrained:
                out[cell] = f"{', '.join(untrained)} not trained"
        return out

    def test_guard(self) -> None:
        """Refuses (one-line StudyError) a test read while a cell's settings are open (`open_cells`)."""
        still = self.open_cells()
        if still:
            raise StudyError(f"study {self.name}: no test read before every cell's settings are final; still open: "
                             + "; ".join(f"{cell} ({why})" for cell, why in still.items()))


def _factor(x: float) -> float:
    """A computed factor as its run id writes it (6 significant digits), so that the same factor reached two ways
    is one run."""
    return float(f"{x:g}")


def _best(valid: dict[float, float]) -> float:
    """The factor of the lowest valid perplexity (ties: the smaller factor)."""
    return min(valid, key=lambda f: (valid[f], f))


def _path(raw, default: Path) -> Path:
    return default if raw is None else (REPO / str(raw)).resolve()


def _given_twice(loader: yaml.SafeLoader, node: yaml.Node, where: str = "") -> tuple[str, str, int, int] | None:
    """(where, key, first line, second line) of the first key given twice in a mapping of the YAML tree `node`
    (PyYAML keeps the last one without a word), None if none is."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if found := _given_twice(loader, item, f"{where}[{i}]"):
                return found
    if not isinstance(node, yaml.MappingNode):
        return None
    seen: dict[str, yaml.Node] = {}
    for key_node, value in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue  # `<<: *base` may give its keys again
        key = str(loader.construct_object(key_node))  # as load_study names it: `1` and '1' are one cell
        if key in seen:
            return where, key, seen[key].start_mark.line + 1, key_node.start_mark.line + 1
        seen[key] = key_node
        if found := _given_twice(loader, value, f"{where}.{key}" if where else key):
            return found
    return None


def _read_study_file(path: Path):
    """The YAML of a study file, refusing a key given twice (one line naming it and both its lines)."""
    try:
        loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
        try:
            node = loader.get_single_node()
            twice = node and _given_twice(loader, node)
            raw = None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise StudyError(f"{path}: not a readable study file ({' '.join(str(e).split())})") from None
    if twice:
        where, key, first, second = twice
        what = f"cell {key!r}" if where == "cells" else f"key {f'{where}.' if where else ''}{key}"
        raise StudyError(f"{path}: {what} is given twice (lines {first} and {second}); YAML would keep the last "
                         f"one only: give it once")
    return raw


def load_study(path: Path) -> Study:
    """The study of a YAML file (see the module docstring); a one-line StudyError names the key at fault."""
    path = Path(path)
    raw = _read_study_file(path)
    if not isinstance(raw, dict):
        raise StudyError(f"{path}: a study file is a mapping of keys (name, tokens, seeds, lr_grid, cells...)")
    unknown = sorted(set(raw) - KEYS)
    missing = sorted({"name", "tokens", "eval_every_tokens", "seeds", "lr_grid", "cells"} - set(raw))
    if unknown or missing:
        raise StudyError(f"{path}: " + "; ".join(
            ([f"unknown key(s) {', '.join(unknown)}"] if unknown else []) +
            ([f"missing key(s) {', '.join(missing)}"] if missing else [])) + f" (keys: {', '.join(sorted(KEYS))})")

    def check(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise StudyError(f"{path}: {key}: {what}, not {raw.get(key)!r}")

    check(isinstance(raw["tokens"], int) and raw["tokens"] > 0, "tokens", "a positive number of tokens")
    check(isinstance(raw["eval_every_tokens"], int) and raw["eval_every_tokens"] > 0, "eval_every_tokens",
          "a positive number of tokens")
    seeds, grid = raw["seeds"], raw["lr_grid"]
    check(isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds)
          and len(set(seeds)) == len(seeds), "seeds", "a list of distinct integers")
    check(isinstance(grid, list) and grid and all(isinstance(f, (int, float)) and f > 0 for f in grid)
          and len(set(grid)) == len(grid), "lr_grid", "a list of distinct positive factors")
    check(isinstance(raw.get("lr_extend", 0), int) and raw.get("lr_extend", 0) >= 0, "lr_extend",
          "a number of steps the grid may grow past an end (0: none)")
    check(isinstance(raw.get("lr_refine", 0), int) and raw.get("lr_refine", 0) >= 0, "lr_refine",
          "a number of refinements around the best factor (0: none)")
    check(isinstance(raw.get("diverge_ratio", 0), (int, float)) and (raw.get("diverge_ratio", 0) == 0
                                                                     or raw.get("diverge_ratio", 0) > 1),
          "diverge_ratio", "a ratio above 1 (0: no divergence rule)")
    check(isinstance(raw.get("robustness", False), bool), "robustness", "true or false")
    check(raw.get("scale", "paper") in SCALES, "scale", f"one of {', '.join(SCALES)}")
    check(isinstance(raw.get("set", []), list), "set", "a list of key=value overrides")
    check(isinstance(raw.get("world_size", 1), int) and raw.get("world_size", 1) >= 1, "world_size",
          "a positive number of processes")
    check(isinstance(raw.get("test_max_batches", 0), int) and raw.get("test_max_batches", 0) >= 0, "test_max_batches",
          "a number of batches (0: the whole test split)")
    check(isinstance(raw["cells"], dict) and raw["cells"], "cells", "a mapping name: {config: FILE, set: [...]}")
    if raw.get("dump") is None:  # the name is the dump's folder
        check(check_path_component(str(raw["name"]), "name") is None, "name",
              "one folder name (no / or \\, not . or ..): the default dump is dumped/study/<name>")
    cells = {}
    for name, cell in raw["cells"].items():
        problem = check_path_component(str(name), "cell name")
        if problem:  # the cell's folder in `dump` and `results`: a path there would write outside them
            raise StudyError(f"{path}: cells: {problem}; a cell's name is its folder in the study's dump and "
                             f"results")
        if not isinstance(cell, dict) or "config" not in cell or set(cell) - {"config", "set"} \
                or not isinstance(cell.get("set", []), list):
            raise StudyError(f"{path}: cells.{name}: {{config: FILE, set: [key=value, ...]}}, not {cell!r}")
        if not (REPO / cell["config"]).is_file():
            raise StudyError(f"{path}: cells.{name}.config: no such file {cell['config']} (from the repository root)")
        cells[str(name)] = (str(cell["config"]), tuple(map(str, cell.get("set", []))))
    comparisons = []
    for i, c in enumerate(raw.get("comparisons") or []):
        if not isinstance(c, dict) or set(c) - {"a", "b", "claim", "metric"} or not {"a", "b"} <= set(c) \
                or not {c["a"], c["b"]} <= set(cells) or c.get("metric", "ppl") not in METRICS:
            raise StudyError(f"{path}: comparisons[{i}]: {{a: CELL, b: CELL, claim: TEXT, metric: "
                             f"{' | '.join(METRICS)}}} with cells of `cells`, not {c!r}")
        comparisons.append(Comparison(str(c["a"]), str(c["b"]), str(c.get("claim", f"{c['a']} < {c['b']}")),
                                      c.get("metric", "ppl")))
    here = path.resolve().parent
    return Study(path, str(raw["name"]), cells, tuple(seeds), tuple(sorted(float(f) for f in grid)), raw["tokens"],
                 raw["eval_every_tokens"], _path(raw.get("dump"), REPO / "dumped" / "study" / str(raw["name"])),
                 _path(raw.get("results"), here / "runs"), _path(raw.get("report"), here / "report.md"),
                 str(raw.get("scale", "paper")), tuple(map(str, raw.get("set", []))), raw.get("world_size", 1),
                 raw.get("test_max_batches", 0), tuple(comparisons), raw.get("lr_extend", 0), raw.get("lr_refine", 0),
                 float(raw.get("diverge_ratio", 0)), raw.get("robustness", False))
