"""A reproduction report from run directories: the paper's tables beside ours, figures, what the memory stores.

    python -m xlm_pkm.experiments.report results/tiny/runs --out results/tiny \\
        [--bench benchmarks/results/inference_speed_cpu.json] [--introspect RUN_DIR]

Reads, per run directory: config.yaml, metrics.jsonl (train/valid/test events), the test result
(test.json from evaluate.py --json, else the last "test" event) and reproduce.json (the table cells
the run fills, written by xlm_pkm.experiments.reproduce). Runs of one cell with other seeds (reproduce --seeds)
make one cell: its mean ± the standard deviation over seeds. Each direction of the paper is a set of
comparisons of two cells paired by seed (same seed: same data order): the per-seed differences, their
mean, 95% t interval and signs, Holm's correction over all the report's comparisons, and the verdict
"holds" / "reversed" / "inconclusive" of the adjusted interval (xlm_pkm.experiments.paired).

Speeds come only from inference_speed benchmark JSON (--bench: every model timed in one process,
interleaved), never from the runs' own words/s, which measure whatever else shared the machine.

Writes OUT/report.md and OUT/*.png: learning_curves.png (valid perplexity vs step and vs wall
time), figure4.png (our perplexity vs the benchmark's inference speed of the paper-size model),
table2.png (usage, KL and perplexity vs memory size, with and without BatchNorm), figure6.png
(heads × k grids of perplexity and usage), figure7.png (the benchmark's inference speed vs memory
size, product vs flat keys). Each figure is written only when some run (or benchmark) feeds it.
Tables list ours then the paper's number in parentheses; "·" is a cell not run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from xlm_pkm.config import load_config
from xlm_pkm.experiments.paired import ALPHA, HOLDS, INCONCLUSIVE, REVERSED, Holm, Paired, holm, paired
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.runs.table import Measure  # one number over seeds, as `runs compare` shows it
from xlm_pkm.utils.atomic import write_text

# The paper's numbers (Lample et al. 2019). Table 2 and Table 4 by n_keys (|K| = n_keys²):
# perplexity, usage %, KL; Table 4 adds inference speed in words/s; None: not reported.
PAPER = {
    "table1": {(12, 1024, 0): 17.7, (12, 1024, 1): 15.6, (12, 1024, 2): 14.8, (12, 1024, 3): 14.5,
               (16, 1024, 0): 16.7, (16, 1024, 1): 14.9, (16, 1024, 2): 14.1, (24, 1024, 0): 16.0,
               (24, 1024, 1): 14.6, (12, 1600, 0): 15.0, (12, 1600, 1): 13.7, (16, 1600, 0): 14.4,
               (16, 1600, 1): 13.2, (24, 1600, 0): 14.0},
    "table2": {(128, False): (22.8, 100, 0.56), (128, True): (23.0, 100, 0.56),
               (256, False): (21.7, 99.0, 0.69), (256, True): (21.9, 100.0, 0.58),
               (384, False): (20.9, 83.8, 0.94), (384, True): (20.7, 99.6, 0.65),
               (512, False): (20.5, 64.4, 1.20), (512, True): (19.8, 97.9, 0.68),
               (768, False): (20.0, 38.0, 1.70), (768, True): (18.7, 90.3, 0.83),
               (1024, False): (19.8, 25.8, 2.06), (1024, True): (18.0, 80.3, 0.95)},
    "table3": {1: (21.5, 100.0, 2.23), 2: (20.7, 100.0, 0.95), 3: (20.4, 98.3, 0.74),
               4: (20.1, 97.1, 0.71), 5: (19.8, 97.9, 0.68), 6: (20.3, 96.9, 1.08)},
    "table4": {(128, "flat"): (23.2, 19.6, 2.04, 35.0e3), (128, "product"): (23.0, 100, 0.56, 35.8e3),
               (256, "flat"): (22.6, 13.6, 2.48, 28.5e3), (256, "product"): (21.9, 100.0, 0.58, 36.7e3),
               (384, "flat"): (22.1, 10.1, 2.77, 13.9e3), (384, "product"): (20.7, 99.6, 0.65, 36.4e3),
               (512, "flat"): (None, None, None, 7.7e3), (512, "product"): (19.8, 97.9, 0.68, 36.3e3),
               (768, "flat"): (None, None, None, 4.7e3), (768, "product"): (18.7, 90.3, 0.83, 36.2e3),
               (1024, "flat"): (None, None, None, 1.2e3), (1024, "product"): (18.0, 80.3, 0.95, 35.7e3)},
    "baseline": 23.0,  # §4.5: the 6-layer model without memory
    # Figure 6 gives no numbers in the text beyond: h × k = 64 -> usage about 70%, perplexity about 20.5.
}
# The paper's grids: n_keys of Tables 2 and 4, memory heads and k of Figure 6
# (xlm_pkm.experiments.reproduce runs these cells).
KEYS = (128, 256, 384, 512, 768, 1024)
HEADS, KNNS = (1, 2, 4, 8), (8, 16, 32, 64)


@dataclass
class RunData:
    """What the report reads from one run directory."""

    path: Path
    config: dict
    events: list[dict]
    test: dict | None
    cells: list[dict] = field(default_factory=list)  # [{"table", "cell", "key"}]
    scale: str | None = None  # the reproduction scale it ran at (reproduce.json); None: not from reproduce

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}"

    def valid(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "valid"]

    def memory(self) -> dict | None:
        """The test statistics of the run's first memory (None without memory or test result)."""
        return self.test["memories"][0] if self.test and self.test.get("memories") else None

    def key(self, table: str) -> tuple | None:
        for cell in self.cells:
            if cell["table"] == table:
                return tuple(cell["key"].values())
        return None

    def slots(self) -> int | None:
        return self.config["model"]["memory"]["n_keys"] ** 2 if self.memory() else None


def load_run(path: Path) -> RunData:
    """One run directory; a missing or unreadable config.yaml / metrics.jsonl is a one-line ValueError."""
    path = Path(path)
    try:
        config = yaml.safe_load((path / "config.yaml").read_text())
        events = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable run directory ({e})".replace("\n", " ")) from None
    test = json.loads((path / "test.json").read_text()) if (path / "test.json").is_file() else None
    if test is None:
        tests = [e for e in events if e["event"] == "test"]
        test = tests[-1] if tests else None
    info = json.loads((path / "reproduce.json").read_text()) if (path / "reproduce.json").is_file() else {}
    return RunData(path, config, events, test, info.get("cells", []), info.get("scale"))


def find_runs(paths: list[Path]) -> list[RunData]:
    """Every run directory given, or found below a given directory (a config.yaml and metrics.jsonl)."""
    dirs = []
    for p in map(Path, paths):
        if (p / "config.yaml").is_file():
            dirs.append(p)
        elif p.is_dir():
            dirs += sorted(c.parent for c in p.rglob("config.yaml") if (c.parent / "metrics.jsonl").is_file())
        else:
            raise ValueError(f"{p}: not a run directory (no config.yaml) nor a directory holding runs")
    return [load_run(d) for d in dict.fromkeys(dirs)]


class CellRuns(list):
    """The runs (one per seed) that fill one cell, each with a test result."""

    def measure(self, metric: str) -> Measure | None:
        """'ppl', or the first memory's 'usage' or 'kl', over the runs; None when a run lacks it."""
        values = [run.test["ppl"] if metric == "ppl" else (run.memory() or {}).get(metric) for run in self]
        return Measure(tuple(values)) if values and None not in values else None

    def by_seed(self, metric: str) -> dict[int, float]:
        """{seed: its run's 'ppl', or first memory's 'usage' or 'kl'}, for the runs that have it."""
        values = {run.config["train"]["seed"]: run.test["ppl"] if metric == "ppl" else (run.memory() or {}).get(metric)
                  for run in self}
        return {seed: value for seed, value in values.items() if value is not None}

    @property
    def config(self) -> dict:
        return self[0].config

    def slots(self) -> int | None:
        return self[0].slots()


def by_cell(runs: list[RunData], table: str) -> dict[tuple, CellRuns]:
    """{cell key: its runs} for the runs that fill a cell of `table` and have a test result."""
    cells: dict[tuple, CellRuns] = {}
    for run in runs:
        if run.key(table) is not None and run.test:
            cells.setdefault(run.key(table), CellRuns()).append(run)
    return cells


def baseline_runs(runs: list[RunData]) -> CellRuns | None:
    """The runs without memory (§4.5's baseline) that have a test result."""
    return by_cell(runs, "baseline").get(())


def _words_per_s(row: dict) -> float | None:
    """A benchmark row's speed: words/s, else tokens/s."""
    return row.get("words_per_s") or row.get("tokens_per_s")


def bench_speeds(benches: list[dict]) -> dict[tuple, float]:
    """Words/s of inference_speed benchmark rows: {("table4", n_keys, key_type) | ("table1", layers, dim,
    memories): words/s}, at the paper's sizes (the benchmark times paper-size models)."""
    speeds = {}
    for bench in benches:
        for row in bench.get("table4", {}).get("rows", []):
            speeds["table4", row["n_keys"], row["key_type"]] = _words_per_s(row)
        for row in bench.get("figure4", {}).get("rows", []):
            speeds["table1", row["layers"], row["dim"], row["memories"]] = _words_per_s(row)
    return speeds


# ---- formatting ------------------------------------------------------------------------------

def _num(value, digits: int = 1) -> str:
    if isinstance(value, Measure):
        return value.text(digits)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "·"
    return f"{value:,.{digits}f}"


def _pair(ours, paper, digits: int = 1) -> str:
    """'ours (paper)'; '·' for a missing side."""
    return f"{_num(ours, digits)} ({_num(paper, digits) if paper is not None else '-'})"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _slots_label(n_slots: int) -> str:
    return f"{n_slots / 1e6:.1f}M" if n_slots >= 1e6 else f"{round(n_slots / 1e3)}k" if n_slots >= 1e3 else str(n_slots)


# A cell's test statistics, in the paper's tables' order: (CellRuns.measure's metric, row label, digits)
STATS = (("ppl", "Perplexity", 1), ("usage", "Usage (%)", 1), ("kl", "KL", 2))


def _stats(cell: CellRuns | None) -> tuple:
    """(ppl, usage %, KL) Measures of a cell's test results; Nones when absent."""
    return tuple(cell.measure(metric) if cell else None for metric, _, _ in STATS)


def _stats_rows(cells: dict[tuple, CellRuns], columns: list[tuple[tuple, tuple]]) -> list[list[str]]:
    """A row per STATS, a column per (cell key, the paper's numbers): ours (paper's)."""
    return [[label, *(_pair(_stats(cells.get(key))[i], paper[i], digits) for key, paper in columns)]
            for i, (_, label, digits) in enumerate(STATS)]


def table1_md(runs: list[RunData]) -> str:
    cells = by_cell(runs, "table1")
    ours = {}  # paper's (layers) and (dim) -> ours, where a run says
    for (layers, dim, _), run in cells.items():
        ours[("layers", layers)], ours[("dim", dim)] = run.config["model"]["n_layers"], run.config["model"]["dim"]

    def label(kind: str, value: int) -> str:
        theirs = ours.get((kind, value))
        return f"{value}" + (f" (ours {theirs})" if theirs is not None and theirs != value else "")

    columns = [(1024, n) for n in range(4)] + [(1600, n) for n in range(2)]  # (dim, memories)
    header = ["", *(f"dim {label('dim', dim)}, N={n}" for dim, n in columns)]
    rows = []
    for layers in (12, 16, 24):
        row = [f"{label('layers', layers)} layers"]
        for dim, n in columns:
            paper = PAPER["table1"].get((layers, dim, n))
            run = cells.get((layers, dim, n))
            row.append(_pair(run.measure("ppl") if run else None, paper) if paper or run else "-")
        rows.append(row)
    return _md_table(header, rows)


def _sizes_md(runs: list[RunData], table: str, variants: dict, speeds: dict[tuple, float] | None = None) -> str:
    """Tables 2 and 4: a column per paper size (ours, where a run says) and variant {key: label}, a row
    per STATS; ours (paper's). With `speeds` (Table 4), a last row of the benchmark's words/s at the
    paper's size beside the paper's."""
    cells = by_cell(runs, table)
    sizes = []
    for n in KEYS:
        ours = next((run.slots() for k, run in cells.items() if k[0] == n and run.slots()), None)
        sizes.append(_slots_label(n * n) + (f" (ours {_slots_label(ours)})" if ours else ""))
    header = ["", *(f"{s} {label}" for s in sizes for label in variants.values())]
    rows = _stats_rows(cells, [((n, v), PAPER[table][n, v]) for n in KEYS for v in variants])
    if speeds is not None:
        rows.append(["Speed (words/s, benchmark at the paper's size)",
                     *(_pair(speeds.get((table, n, v)), PAPER[table][n, v][3], 0) for n in KEYS for v in variants)])
    return _md_table(header, rows)


def table2_md(runs: list[RunData]) -> str:
    return _sizes_md(runs, "table2", {False: "no BN", True: "BN"})


def table3_md(runs: list[RunData]) -> str:
    rows = _stats_rows(by_cell(runs, "table3"), [((p,), PAPER["table3"][p]) for p in range(1, 7)])
    return _md_table(["Position", *map(str, range(1, 7))], rows)


def table4_md(runs: list[RunData], speeds: dict[tuple, float]) -> str:
    return _sizes_md(runs, "table4", {"flat": "flat", "product": "product"}, speeds)


def figure6_md(runs: list[RunData]) -> str:
    cells = by_cell(runs, "figure6")
    ours = {k: r.config["model"]["memory"]["knn"] for (_, k), r in cells.items()}
    header = ["", *(f"k={k}" + (f" (ours {ours[k]})" if ours.get(k, k) != k else "") for k in KNNS)]
    out = []
    for i, (_, metric, digits) in enumerate(STATS[:2]):  # perplexity and usage
        rows = [[f"{h} heads", *(_num(_stats(cells.get((h, k)))[i], digits) for k in KNNS)] for h in HEADS]
        out.append(f"{metric}:\n\n" + _md_table(header, rows))
    return "\n\n".join(out)


def runs_md(runs: list[RunData]) -> str:
    rows = []
    for run in runs:
        m, valid = run.config["model"], run.valid()
        mem = run.memory()
        wall = run.events[-1]["time"] - run.events[0]["time"] if len(run.events) > 1 else None
        rows.append([run.name, ", ".join(c["cell"] for c in run.cells) or "-", str(run.config["train"]["seed"]),
                     f"{m['n_layers']}×{m['dim']}", str(m["mem_layers"] or "-") if mem or not m["mem_layers"] else "?",
                     _slots_label(run.slots()) if mem else "-", str(valid[-1]["step"] if valid else 0),
                     _num(valid[-1]["ppl"] if valid else None), _num(run.test["ppl"] if run.test else None),
                     _num(mem["usage"] if mem else None), _num(mem["kl"] if mem else None, 2),
                     _num(wall / 60 if wall else None)])
    return _md_table(["run", "cells", "seed", "layers×dim", "memory layers", "slots", "steps", "valid ppl",
                      "test ppl", "usage %", "KL", "wall min"], rows)


# ---- the paper's directions, checked on whatever was run, seed by seed ----------------------------

@dataclass(frozen=True)
class Comparison:
    """The claim that `a` is below `b` in one metric, seed by seed ({seed: value} each): a lower perplexity
    of the cell the paper favours, or, named the other way round, a lower usage of the one it says uses less."""

    part: str  # which part of the direction it reads: "perplexity", "usage", ...
    what: str  # a − b in words
    a: dict[int, float]
    b: dict[int, float]
    digits: int = 1
    unit: str = ""

    def pair(self) -> Paired:
        return paired(self.a, self.b)


def _compare(part: str, what: str, a: CellRuns, b: CellRuns, metric: str) -> Comparison:
    """A Comparison of two cells' test `metric` (CellRuns.by_seed), with the metric's digits and unit."""
    digits = next(d for m, _, d in STATS if m == metric)
    return Comparison(part, what, a.by_seed(metric), b.by_seed(metric), digits, "%" if metric == "usage" else "")


@dataclass(frozen=True)
class Timing:
    """A speed claim, `fast` faster than `slow`, from the benchmark's one timing of each (words/s; None: no row)."""

    what: str
    fast: float | None
    slow: float | None

    def verdict(self) -> str:
        if self.fast is None or self.slow is None:
            return "not measured"
        return "faster" if self.fast > self.slow else "not faster"

    def text(self) -> str:
        if self.fast is None or self.slow is None:
            return f"speed, {self.what}: no benchmark row"
        return f"speed, {self.what}: benchmark {self.fast:,.0f} vs {self.slow:,.0f} words/s (one timing each, no " \
               f"interval): **{self.verdict()}**"


@dataclass(frozen=True)
class Reading:
    """A direction read from the cells run: its paired comparisons and its speed timings."""

    comparisons: list[Comparison]
    timings: list[Timing] = field(default_factory=list)


@dataclass(frozen=True)
class Judged:
    """A comparison with its paired differences and its Holm correction over the report's comparisons."""

    comparison: Comparison
    pair: Paired
    holm: Holm

    def verdict(self) -> str:
        return self.holm.verdict

    def short(self) -> str:
        """'mean +6.4, Holm-adjusted [+0.9, +12.0], signs +++'."""
        d, (lo, hi) = self.comparison.digits, self.holm.interval
        return f"mean {self.pair.mean:+.{d}f}, Holm-adjusted [{lo:+.{d}f}, {hi:+.{d}f}], signs {self.pair.signs()}"

    def text(self) -> str:
        """'what: a vs b; per seed …; mean, 95% interval, Holm-adjusted interval (p): verdict'."""
        c, d, pair = self.comparison, self.comparison.digits, self.pair
        a, b = (Measure(tuple(side[s] for s in pair.seeds)) for side in (c.a, c.b))
        seeds = ", ".join(f"{s}: {x:+.{d}f}" for s, x in zip(pair.seeds, pair.diffs))
        head = f"{c.what}: {a.text(d)}{c.unit} vs {b.text(d)}{c.unit}; per seed {seeds or '·'} ({pair.signs() or '·'})"
        if pair.n < 2:
            return f"{head}; fewer than 2 paired seeds, no interval: **{self.verdict()}**"
        (lo, hi), (alo, ahi) = pair.interval(), self.holm.interval
        return (f"{head}; mean {pair.mean:+.{d}f}, 95% [{lo:+.{d}f}, {hi:+.{d}f}], Holm-adjusted [{alo:+.{d}f}, "
                f"{ahi:+.{d}f}] at {100 * self.holm.level:.2f}% (p {self.holm.p:.2g}): **{self.verdict()}**")


def _tally(words: list[str]) -> str:
    """One word when all agree, else 'mixed (2 holds, 1 inconclusive)'."""
    if len(set(words)) == 1:
        return words[0]
    return "mixed (" + ", ".join(f"{words.count(w)} {w}" for w in dict.fromkeys(words)) + ")"


@dataclass(frozen=True)
class Direction:
    """A direction of the paper as read here (judged: None when its cells were not run), and a note on it."""

    claim: str
    judged: list[Judged] | None
    timings: list[Timing] = field(default_factory=list)
    note: str = ""

    def verdict(self) -> str:
        """Each part's verdicts tallied (_tally), the parts named when they differ ('not run': no cells)."""
        if self.judged is None:
            return "not run"
        parts: dict[str, list[str]] = {}
        for j in self.judged:
            parts.setdefault(j.comparison.part, []).append(j.verdict())
        for t in self.timings:
            parts.setdefault("speed", []).append(t.verdict())
        tallied = {part: _tally(words) for part, words in parts.items()}
        return next(iter(tallied.values())) if len(set(tallied.values())) == 1 else \
            "; ".join(f"{part}: {word}" for part, word in tallied.items())


@dataclass(frozen=True)
class Cells:
    """What the checks read: each table's cells run ({cell key: its runs}, by_cell), the runs without memory,
    and the benchmark's words/s of the cells' paper-size models (bench_speeds; never the runs' own)."""

    table1: dict[tuple, CellRuns]
    table2: dict[tuple, CellRuns]
    table3: dict[tuple, CellRuns]
    table4: dict[tuple, CellRuns]
    figure6: dict[tuple, CellRuns]
    baseline: CellRuns | None
    speeds: dict[tuple, float]


@dataclass(frozen=True)
class Check:
    """A direction of the paper: the claim as the report words it, how to read it from the cells run (None: they
    were not), and optionally a note on what was read (from the cells and the judged comparisons)."""

    claim: str
    read: Callable[[Cells], Reading | None]
    note: Callable[[Cells, list[Judged]], str] | None = None


def _slots(cell: CellRuns) -> str:
    return f"{_slots_label(cell.slots())} slots"


def _memory_vs_none(cells: Cells) -> Reading | None:
    """The ablation model (Table 2's 512²/BatchNorm cell, else Table 3's position 5) vs the baseline: perplexity."""
    memory, base = cells.table2.get((512, True)) or cells.table3.get((5,)), cells.baseline
    if not (memory and base):
        return None
    return Reading([_compare("perplexity", "ppl with − without memory", memory, base, "ppl")])


def _shallow_vs_deep(cells: Cells) -> Reading | None:
    """Per width run, Table 1's 12 layers + 1 memory vs 24 layers without: perplexity and speed."""
    t1, speeds = cells.table1, cells.speeds
    dims = [dim for dim in (1024, 1600) if (12, dim, 1) in t1 and (24, dim, 0) in t1]
    return Reading([_compare("perplexity", f"ppl 12 layers + 1 memory − 24 layers, dim {dim}", t1[12, dim, 1],
                             t1[24, dim, 0], "ppl") for dim in dims],
                   [Timing(f"12 layers + 1 memory vs 24 layers, dim {dim}", speeds.get(("table1", 12, dim, 1)),
                           speeds.get(("table1", 24, dim, 0))) for dim in dims]) if dims else None


def _batchnorm_usage(cells: Cells) -> Reading | None:
    """Table 2's sizes run with and without BatchNorm: usage at each, and BN's usage gain at the smallest vs the
    largest (per seed)."""
    t2 = cells.table2
    sizes = [n for n in KEYS if (n, True) in t2 and (n, False) in t2]
    if not sizes:
        return None
    out = [_compare("usage", f"usage without − with BN, {_slots(t2[n, True])}", t2[n, False], t2[n, True], "usage")
           for n in sizes]
    if len(sizes) > 1:
        gain = {}  # {size: {seed: usage with − without BN}}
        for n in (sizes[0], sizes[-1]):
            pair = paired(t2[n, True].by_seed("usage"), t2[n, False].by_seed("usage"))
            gain[n] = dict(zip(pair.seeds, pair.diffs))
        out.append(Comparison("more so as it grows", f"BN's usage gain at {_slots(t2[sizes[0], True])} − at "
                              f"{_slots(t2[sizes[-1], True])}", gain[sizes[0]], gain[sizes[-1]], 1, " points"))
    return Reading(out)


def _product_vs_flat(cells: Cells) -> Reading | None:
    """Per size of Table 4 run with both key types: perplexity and usage; the benchmark's speed at the paper's size."""
    t4 = cells.table4
    sizes = [n for n in KEYS if (n, "flat") in t4 and (n, "product") in t4]
    out = []
    for n in sizes:
        product, flat, where = t4[n, "product"], t4[n, "flat"], _slots(t4[n, "product"])
        out += [_compare("perplexity", f"ppl product − flat keys, {where}", product, flat, "ppl"),
                _compare("usage", f"usage flat − product keys, {where}", flat, product, "usage")]
    return Reading(out, [Timing(f"product vs flat keys at {_slots_label(n * n)} slots (the paper's size)",
                                cells.speeds.get(("table4", n, "product")), cells.speeds.get(("table4", n, "flat")))
                         for n in sizes]) if sizes else None


def memory_parameters(config: dict) -> tuple[int, int]:
    """(keys, values) parameters of the first memory of a run's config.yaml, its model built on the meta device."""
    cfg = load_config(start=config)
    with torch.device("meta"):
        model = TransformerLM(replace(cfg.model, vocab_size=1000))
    memory = model.memories()[0][1]
    return (sum(p.numel() for p in memory.keys.parameters()), sum(p.numel() for p in memory.values.parameters()))


def _flat_keys_note(cells: Cells, judged: list[Judged]) -> str:
    """Table 4 read: flat keys' usage against the paper's collapse (absent where flat keys use as much on average),
    each key type's key parameters, and, where the perplexity is reversed, the likely cause."""
    t4 = cells.table4
    sizes = [n for n in KEYS if (n, "flat") in t4 and (n, "product") in t4]
    usage = ", ".join(f"{t4[n, 'flat'].measure('usage').text()}% at {_slots(t4[n, 'flat'])} (the paper's at "
                      f"{_slots_label(n * n)}: {PAPER['table4'][n, 'flat'][1]}%)" for n in sizes)
    as_much = all(t4[n, "flat"].measure("usage").mean >= t4[n, "product"].measure("usage").mean for n in sizes)
    collapse = ": as much as the product keys', the paper's collapse of flat-key usage does not appear" if as_much \
        else ""
    params = {(n, kind): memory_parameters(t4[n, kind].config) for n in sizes for kind in ("flat", "product")}
    budget = "; ".join(f"{_slots(t4[n, 'flat'])}: flat keys {params[n, 'flat'][0]:,}, product keys "
                       f"{params[n, 'product'][0]:,}, values {params[n, 'product'][1]:,} in both" for n in sizes)
    big, run = sizes[-1], t4[sizes[-1], "flat"].config
    tokens = run["train"]["max_steps"] * run["data"]["batch_size"] * run["data"]["bptt"]
    ppl = [j for j in judged if j.comparison.part == "perplexity"]  # product − flat, one per size
    found = "; ".join(f"{_slots(t4[n, 'flat'])} {j.verdict()}, {j.short()}" for n, j in zip(sizes, ppl))
    cause = (f" Flat keys have the lower perplexity here, against the paper (product − flat keys, {found}). A likely "
             f"cause: flat keys are heads × slots × k_dim parameters (product keys: heads × 2 × √slots × k_dim/2), "
             f"at {_slots(t4[big, 'flat'])} {params[big, 'flat'][0]:,} against {params[big, 'product'][0]:,}, a large "
             f"key budget the product keys do not have; and the model is tiny ({run['model']['n_layers']} layers × "
             f"{run['model']['dim']}) and trained briefly ({tokens:,} tokens)."
             if any(j.verdict() == REVERSED for j in ppl) else "")
    return f"Flat keys' usage: {usage}{collapse}. Key parameters per memory: {budget}.{cause}"


def _best_upper(t3: dict[tuple, CellRuns]) -> tuple[int, CellRuns] | None:
    """(position, runs) of the lower mean perplexity of Table 3's positions 4 and 5, of those run."""
    upper = [(p, t3[(p,)]) for p in (4, 5) if (p,) in t3]
    return min(upper, key=lambda item: item[1].measure("ppl").mean) if upper else None


def _upper_vs_first(cells: Cells) -> Reading | None:
    """Table 3: the better of positions 4 and 5 vs position 1: perplexity."""
    t3 = cells.table3
    best = _best_upper(t3)
    if best is None or (1,) not in t3:
        return None
    return Reading([_compare("perplexity", f"ppl layer {best[0]} (the better of 4/5) − layer 1", best[1], t3[(1,)],
                             "ppl")])


def _upper_is_best(cells: Cells) -> Reading | None:
    """Table 3: the better of positions 4 and 5 vs the best of the other positions run: perplexity."""
    t3 = cells.table3
    best = _best_upper(t3)
    others = {p: t3[(p,)] for p in (1, 2, 3, 6) if (p,) in t3}
    if best is None or not others:
        return None
    rival, runs = min(others.items(), key=lambda item: item[1].measure("ppl").mean)
    return Reading([_compare("perplexity", f"ppl layer {best[0]} (the better of 4/5) − layer {rival} (the best of "
                             f"the others run: {', '.join(map(str, others))})", best[1], runs, "ppl")])


def _hk(cell: CellRuns) -> str:
    mem = cell.config["model"]["memory"]
    return f"(h={mem['heads']}, k={mem['knn']})"


def _heads_and_k_usage(cells: Cells) -> Reading | None:
    """Every pair of Figure 6's cells run where heads or k (one of them) grows: usage."""
    f6 = cells.figure6
    steps = sorted((a, b) for a in f6 for b in f6
                   if a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0]) + (a[1] < b[1]) == 1)  # one of them grows
    return Reading([_compare("usage", f"usage {_hk(f6[a])} − {_hk(f6[b])}", f6[a], f6[b], "usage")
                    for a, b in steps]) if steps else None


# The paper's directions, in the report's order: a new direction is one entry here.
CHECKS = [
    Check("A memory beats the same model without it at equal steps (§4.5: 23.0 -> 19.8)", _memory_vs_none),
    Check("A shallower model with a memory beats a deeper one without, and is faster (Table 1: 12 layers + 1 "
          "memory vs 24 layers)", _shallow_vs_deep),
    Check("BatchNorm raises usage, the more so as the memory grows (Table 2)", _batchnorm_usage),
    Check("Product keys give a lower perplexity than flat keys, use more of the memory, and run faster (Table 4: at "
          "147k slots 20.7 vs 22.1, usage 99.6% vs 10.1%)", _product_vs_flat, _flat_keys_note),
    Check("A memory in an upper-middle layer (4 or 5 of 6) beats one at layer 1 (Table 3)", _upper_vs_first),
    Check("The best position is layer 4 or 5 of 6 (Table 3: 5 best, 4 next)", _upper_is_best),
    Check("More memory heads and a larger k raise usage (Figure 6)", _heads_and_k_usage),
]


def directions(runs: list[RunData], speeds: dict[tuple, float] | None = None) -> list[Direction]:
    """Each of CHECKS read from the runs: its comparisons paired by seed, Holm's correction over all of them
    (paired.holm), verdicts 'holds', 'reversed', 'inconclusive'; speeds only from `speeds` (bench_speeds)."""
    cells = Cells(*(by_cell(runs, table) for table in ("table1", "table2", "table3", "table4", "figure6")),
                  baseline_runs(runs), speeds or {})
    readings = [(check, check.read(cells)) for check in CHECKS]
    comparisons = [c for _, r in readings if r for c in r.comparisons]
    pairs = [c.pair() for c in comparisons]
    judged = iter([Judged(c, p, h) for c, p, h in zip(comparisons, pairs, holm(pairs))])
    out = []
    for check, reading in readings:
        if reading is None:
            out.append(Direction(check.claim, None))
            continue
        mine = [next(judged) for _ in reading.comparisons]
        out.append(Direction(check.claim, mine, reading.timings, check.note(cells, mine) if check.note else ""))
    return out


def directions_md(found: list[Direction]) -> str:
    """The tally of every paired comparison's verdict, the reversed and inconclusive ones named, then each
    direction with its verdict, each comparison and timing, and its note."""
    judged = [j for d in found if d.judged for j in d.judged]
    counts = {w: sum(j.verdict() == w for j in judged) for w in (HOLDS, REVERSED, INCONCLUSIVE)}
    summary = [f"Of the {len(judged)} paired comparisons (Holm over all of them): "
               + ", ".join(f"{n} {'hold' if w == HOLDS and n != 1 else w}" for w, n in counts.items()) + "."]
    reversed_ = [j for j in judged if j.verdict() == REVERSED]
    if reversed_:
        summary.append(f"**{REVERSED.capitalize()}**: " + "; ".join(f"{j.comparison.what} ({j.short()})"
                                                                    for j in reversed_) + ".")
    inconclusive = [j.comparison.what for j in judged if j.verdict() == INCONCLUSIVE]
    if inconclusive:
        summary.append(f"**{INCONCLUSIVE.capitalize()}** (each with its intervals below): " + "; ".join(inconclusive)
                       + ".")
    items = []
    for d in found:
        items.append(f"- **{d.claim}**: {d.verdict()}")
        items += [f"    - {item.text()}" for item in (*(d.judged or ()), *d.timings)]
        items += [f"    - {d.note}"] if d.note else []
    return "\n\n".join(summary) + "\n\n" + "\n".join(items)


# ---- figures ---------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_learning_curves(runs: list[RunData], path: Path) -> Path | None:
    curves = [(run, run.valid()) for run in runs if run.valid()]
    if not curves:
        return None
    plt = _pyplot()
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {}  # one color per run name, its seeds alike; labelled once
    for run, valid in curves:
        start, name = run.events[0]["time"], run.path.parent.name
        steps, times, ppl = ([e["step"] for e in valid], [(e["time"] - start) / 60 for e in valid],
                             [e["ppl"] for e in valid])
        line, = by_step.plot(steps, ppl, marker=".", color=colors.get(name), label=None if name in colors else name)
        colors[name] = line.get_color()
        by_time.plot(times, ppl, marker=".", color=line.get_color())
    by_step.set(xlabel="step", ylabel="valid perplexity", yscale="log", title="valid perplexity vs step")
    by_time.set(xlabel="wall time (min, from the run's first event)", title="valid perplexity vs wall time")
    by_step.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_figure4(runs: list[RunData], speeds: dict[tuple, float], path: Path) -> Path | None:
    """Our test perplexity (mean ± sd over seeds) of each Table 1 cell against the benchmark's inference
    speed of that cell's paper-size model."""
    points = [(key, cell) for key, cell in by_cell(runs, "table1").items() if ("table1", *key) in speeds]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for with_memory, marker in ((False, "o"), (True, "s")):
        group = [(speeds["table1", *key], cell.measure("ppl"), key) for key, cell in points
                 if (key[2] > 0) == with_memory]
        if group:
            ax.errorbar([g[0] for g in group], [g[1].mean for g in group], yerr=[g[1].sd for g in group],
                        fmt=marker, capsize=3, label="with memory" if with_memory else "without memory")
        for speed, ppl, (layers, dim, n) in group:
            ax.annotate(f"{layers}L d{dim} N={n}", (speed, ppl.mean), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set(xlabel="inference speed of the paper-size model (words/s, benchmark)",
           ylabel="test perplexity (ours, reduced scale)", title="Figure 4: perplexity vs inference speed")
    ax.legend()
    return _save(fig, path)


def plot_table2(runs: list[RunData], path: Path) -> Path | None:
    cells = by_cell(runs, "table2")
    if not any(c.slots() for c in cells.values()):
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for bn, marker in ((False, "o"), (True, "s")):
        group = sorted((c.slots(), _stats(c)) for (n, b), c in cells.items() if b == bn and c.slots())
        if not group:
            continue
        slots = [s for s, _ in group]
        for ax, i in zip(axes, (1, 2, 0)):  # usage, KL, perplexity: mean ± sd over seeds
            ax.errorbar(slots, [g[i].mean for _, g in group], yerr=[g[i].sd for _, g in group], marker=marker,
                        capsize=3, label="BatchNorm" if bn else "no BatchNorm")
    for ax, label in zip(axes, ("memory usage (%)", "KL to uniform (nats)", "test perplexity")):
        ax.set(xscale="log", xlabel="memory slots", ylabel=label)
        ax.legend()
    fig.suptitle("Table 2: usage, KL and perplexity vs memory size")
    return _save(fig, path)


def plot_figure6(runs: list[RunData], path: Path) -> Path | None:
    cells = by_cell(runs, "figure6")
    if not cells:
        return None
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (i, title) in zip(axes, ((0, "test perplexity"), (1, "memory usage (%)"))):
        grid = np.array([[getattr(_stats(cells.get((h, k)))[i], "mean", np.nan) for k in KNNS] for h in HEADS],
                        dtype=float)
        image = ax.imshow(grid, cmap="viridis_r" if i == 0 else "viridis")
        for (row, col), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(col, row, f"{value:.1f}", ha="center", va="center", color="w", fontsize=8)
        knn = {k: r.config["model"]["memory"]["knn"] for (h, k), r in cells.items()}
        ax.set(xticks=range(len(KNNS)), xticklabels=[f"{k}" + (f" ({knn[k]})" if k in knn and knn[k] != k else "")
                                                      for k in KNNS],
               yticks=range(len(HEADS)), yticklabels=HEADS, xlabel="k, paper's (ours)", ylabel="memory heads",
               title=title)
        fig.colorbar(image, ax=ax)
    fig.suptitle("Figure 6: heads × k")
    return _save(fig, path)


def plot_figure7(benches: list[dict], path: Path) -> Path | None:
    """Speed vs memory size per key type, from the benchmark's rows (one line per benchmark file and key type)."""
    series = {}
    for bench in benches:
        for row in bench.get("table4", {}).get("rows", []):
            series.setdefault((f"benchmark, {bench['settings'].get('dtype', '')}", row["key_type"]), []).append(
                (row["slots"], _words_per_s(row)))
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (source, kind), points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if kind == "product" else "x",
                label=f"{kind} keys ({source})")
    ax.set(xscale="log", yscale="log", xlabel="memory slots", ylabel="inference speed (words/s)",
           title="Figure 7: speed vs memory size")
    ax.legend(fontsize=8)
    return _save(fig, path)


# ---- the report ------------------------------------------------------------------------------

def introspection_md(run: RunData, found: list[dict]) -> str:
    lines = [f"Run `{run.name}`: for each memory, its most used slots on the first {found[0]['tokens']:,} test "
             "tokens (summed read weight), and the contexts that read each most strongly (⟦token⟧ is the "
             "position reading it, → the next token).", ""]
    for memory in found:
        lines.append(f"Memory at layer {memory['layer']}:")
        lines.append("")
        for slot in memory["slots"]:
            lines.append(f"- slot {slot['slot']} (weight {slot['weight']:.1f}):")
            for read in slot["reads"]:
                context = (read["context"] + " ⟦" + read["token"] + "⟧ → " + read["next"]).replace("|", "\\|")
                lines.append(f"    - {read['weight']:.2f}: `{context}`")
        lines.append("")
    return "\n".join(lines)


def default_introspection_run(runs: list[RunData]) -> RunData | None:
    """The ablation model (Table 2's 512²/BatchNorm cell) if it has a best.pt, else the first run with a memory."""
    candidates = [r for r in runs if r.memory() and (r.path / "best.pt").is_file()]
    preferred = [r for r in candidates if r.key("table2") == (512, True)]
    return (preferred or candidates or [None])[0]


def write_report(runs: list[RunData], out: Path, benches: list[dict] = (), introspect: RunData | None = None,
                 introspected: list[dict] | None = None, command: str = "") -> Path:
    """Writes out/report.md and the figures; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    scales = sorted({r.scale for r in runs if r.scale})
    seeds = sorted({r.config["train"]["seed"] for r in runs})
    base, speeds = baseline_runs(runs), bench_speeds(list(benches))
    figures = {
        "learning_curves.png": plot_learning_curves(runs, out / "learning_curves.png"),
        "figure4.png": plot_figure4(runs, speeds, out / "figure4.png"),
        "table2.png": plot_table2(runs, out / "table2.png"),
        "figure6.png": plot_figure6(runs, out / "figure6.png"),
        "figure7.png": plot_figure7(list(benches), out / "figure7.png"),
    }
    parts = [
        "# Reproduction report: Large Memory Layers with Product Keys (Lample et al. 2019)",
        f"{len(runs)} runs" + (f", scale {', '.join(scales)}" if scales else "")
        + f", seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
        + (f"; made by `{command}`." if command else "."),
        "Each table cell is ours, then the paper's number in parentheses; `·` is a cell not run, `-` one the "
        "paper does not report. Ours is the mean ± the standard deviation over the cell's seeds (a bare number: "
        "one seed). At a reduced scale the sizes differ from the paper's (see xlm_pkm/experiments/reproduce.py); "
        "the column labels give ours.",
        "**Directions, seed by seed.** Each direction of the paper is read as comparisons of two cells, each the "
        "claim that cell a is below cell b (a lower perplexity of the cell the paper favours; for usage, which "
        "the paper says a design raises, a is the cell it says uses less). Seeds pair the runs (same seed: same data "
        "order), so a comparison gives the per-seed differences a − b, their sign on each seed (− as claimed), "
        "their mean and its 95% interval (Student t with n − 1 degrees of freedom; "
        "xlm_pkm/experiments/paired.py). Over all the comparisons of this report, Holm's correction: the adjusted "
        f"interval is the t interval at level 1 − {ALPHA:g} / (m − min(i, s) + 1), i the rank of the comparison's "
        f"p-value, s the first rank Holm does not reject. The verdict follows from it: **{HOLDS}** when it lies "
        f"below 0, **{REVERSED}** when above 0, **{INCONCLUSIVE}** when it contains 0 (as always below two seeds).",
        "Speeds are never the runs' own: a training run's words/s measures whatever else shared the machine (two "
        "runs of the same cost differed by 2× here). Speed claims and the speed row of Table 4 come from the "
        "inference_speed benchmark (every model timed in one process, interleaved; paper-size, untrained models) "
        "given with --bench, at the paper's sizes: one timing per model, so no interval; a speed claim reads "
        "**faster** or **not faster**, and \"not measured\" without a benchmark row.",
        "## The paper's directions\n\n" + directions_md(directions(runs, speeds)),
        "## Table 1: test perplexity, with and without memory\n\n" + table1_md(runs),
        "## Table 2: memory size, with and without query BatchNorm\n\n" + table2_md(runs)
        + "\n\nWithout memory (§4.5): " + _pair(base.measure("ppl") if base else None, PAPER["baseline"]),
        "## Table 3: memory position in the 6-layer model\n\n" + table3_md(runs),
        "## Table 4: product keys vs flat keys\n\n" + table4_md(runs, speeds),
        "## Figure 6: memory heads × k\n\nThe paper gives Figure 6 only as a plot (h × k = 64: usage about 70%, "
        "perplexity about 20.5); rows are memory heads, columns the paper's k.\n\n" + figure6_md(runs),
        "## Figures\n\n" + "\n\n".join(f"![{name}]({name})" for name, path in figures.items() if path),
    ]
    if introspect is not None and introspected:
        parts.append("## What the memory stores\n\n" + introspection_md(introspect, introspected))
    parts.append("## Runs\n\n" + runs_md(runs))
    report = out / "report.md"
    write_text(report, "\n\n".join(parts) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="run directories, or directories holding them")
    parser.add_argument("--out", default="report", help="where report.md and the figures go")
    parser.add_argument("--bench", nargs="+", default=[], help="inference_speed benchmark JSON (Figure 7)")
    parser.add_argument("--introspect", help="run directory whose best.pt to introspect (default: the ablation "
                                             "model's, else the first run with a memory and a best.pt)")
    parser.add_argument("--no-introspect", action="store_true")
    parser.add_argument("--top-slots", type=int, default=8)
    parser.add_argument("--per-slot", type=int, default=3)
    parser.add_argument("--introspect-batches", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        runs = find_runs([Path(d) for d in args.dirs])
        benches = []
        for b in args.bench:
            try:
                benches.append(json.loads(Path(b).read_text()))
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{b}: not a readable benchmark JSON ({e})") from None
        target = None if args.no_introspect else (load_run(Path(args.introspect)) if args.introspect
                                                  else default_introspection_run(runs))
        found = None
        if target is not None:
            from xlm_pkm.experiments.introspect import slot_contexts

            found = slot_contexts(target.path / "best.pt", top_slots=args.top_slots, per_slot=args.per_slot,
                                  max_batches=args.introspect_batches)
    except (ValueError, FileNotFoundError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    command = "python -m xlm_pkm.experiments.report " + " ".join(argv if argv is not None else sys.argv[1:])
    path = write_report(runs, Path(args.out), benches, target, found, command)
    print(f"wrote {path} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
