"""A reproduction report from run directories: the paper's tables beside ours, figures, what the memory stores.

    python -m xlm_pkm.report dumped/reproduce/*/tiny --out results/tiny \\
        [--bench benchmarks/results/inference_speed_cpu.json] [--introspect RUN_DIR]

Reads, per run directory: config.yaml, metrics.jsonl (train/valid/test events), the test result
(test.json from evaluate.py --json, else the last "test" event) and reproduce.json (the table cells
the run fills, written by xlm_pkm.reproduce). Writes OUT/report.md and OUT/*.png:
learning_curves.png (valid perplexity vs step and vs wall time), figure4.png (perplexity vs
inference speed, with and without memories), table2.png (usage, KL and perplexity vs memory size,
with and without BatchNorm), figure6.png (heads × k grids of perplexity and usage), figure7.png
(inference speed vs memory size, product vs flat keys, from inference_speed benchmark JSON, else
from the runs' test speed). Each figure is written only when some run (or benchmark) feeds it.
Tables list ours then the paper's number in parentheses; "·" is a cell not run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from xlm_pkm.atomic import write_text

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
# The paper's grids: n_keys of Tables 2 and 4, memory heads and k of Figure 6 (xlm_pkm.reproduce runs these cells).
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
    scale: str | None = None  # the reproduction scale it ran at (reproduce.json), None: not from xlm_pkm.reproduce

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


def by_cell(runs: list[RunData], table: str) -> dict[tuple, RunData]:
    """{cell key: run} for the runs that fill a cell of `table` and have a test result."""
    return {run.key(table): run for run in runs if run.key(table) is not None and run.test}


def baseline_run(runs: list[RunData]) -> RunData | None:
    """The first run without memory (§4.5's baseline) that has a test result."""
    return next((r for r in runs if r.key("baseline") is not None and r.test), None)


# ---- formatting ------------------------------------------------------------------------------

def _num(value, digits: int = 1) -> str:
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


def _stats(run: RunData | None) -> tuple:
    """(ppl, usage %, KL, words/s) of a run's test result; Nones when absent."""
    if run is None:
        return None, None, None, None
    mem = run.memory() or {}
    return run.test["ppl"], mem.get("usage"), mem.get("kl"), run.test.get("words_per_sec")


def table1_md(runs: list[RunData]) -> str:
    cells = by_cell(runs, "table1")
    ours = {}  # paper's (layers) and (dim) -> ours, where a run says
    for (layers, dim, _), run in cells.items():
        ours[("layers", layers)], ours[("dim", dim)] = run.config["model"]["n_layers"], run.config["model"]["dim"]

    def label(kind: str, value: int) -> str:
        theirs = ours.get((kind, value))
        return f"{value}" + (f" (ours {theirs})" if theirs is not None and theirs != value else "")

    header = ["", *(f"dim {label('dim', d)}, N={n}" for d, ns in ((1024, range(4)), (1600, range(2))) for n in ns)]
    rows = []
    for layers in (12, 16, 24):
        row = [f"{label('layers', layers)} layers"]
        for dim, ns in ((1024, range(4)), (1600, range(2))):
            for n in ns:
                paper = PAPER["table1"].get((layers, dim, n))
                run = cells.get((layers, dim, n))
                row.append(_pair(run.test["ppl"] if run else None, paper) if paper or run else "-")
        rows.append(row)
    return _md_table(header, rows)


def _sizes_md(runs: list[RunData], table: str, variants: dict, metrics: tuple[tuple[str, int], ...]) -> str:
    """Tables 2 and 4: a column per paper size (ours, where a run says) and variant {key: label}, a row
    per (metric, digits) of _stats; ours (paper's)."""
    cells = by_cell(runs, table)
    sizes = []
    for n in KEYS:
        ours = next((run.slots() for k, run in cells.items() if k[0] == n and run.slots()), None)
        sizes.append(_slots_label(n * n) + (f" (ours {_slots_label(ours)})" if ours else ""))
    header = ["", *(f"{s} {label}" for s in sizes for label in variants.values())]
    rows = [[metric, *(_pair(_stats(cells.get((n, v)))[i], PAPER[table][n, v][i], digits)
                       for n in KEYS for v in variants)]
            for i, (metric, digits) in enumerate(metrics)]
    return _md_table(header, rows)


def table2_md(runs: list[RunData]) -> str:
    return _sizes_md(runs, "table2", {False: "no BN", True: "BN"},
                     (("Perplexity", 1), ("Usage (%)", 1), ("KL", 2)))


def table3_md(runs: list[RunData]) -> str:
    cells = by_cell(runs, "table3")
    rows = [[metric, *(_pair(_stats(cells.get((p,)))[i], PAPER["table3"][p][i], 2 if i == 2 else 1)
                       for p in range(1, 7))]
            for i, metric in enumerate(("Perplexity", "Usage (%)", "KL"))]
    return _md_table(["Position", *map(str, range(1, 7))], rows)


def table4_md(runs: list[RunData]) -> str:
    return _sizes_md(runs, "table4", {"flat": "flat", "product": "product"},
                     (("Perplexity", 1), ("Usage (%)", 1), ("KL", 2), ("Speed (words/s)", 0)))


def figure6_md(runs: list[RunData]) -> str:
    cells = by_cell(runs, "figure6")
    ours = {k: r.config["model"]["memory"]["knn"] for (_, k), r in cells.items()}
    header = ["", *(f"k={k}" + (f" (ours {ours[k]})" if ours.get(k, k) != k else "") for k in KNNS)]
    out = []
    for i, metric in ((0, "Perplexity"), (1, "Usage (%)")):
        rows = [[f"{h} heads", *(_num(_stats(cells.get((h, k)))[i]) for k in KNNS)] for h in HEADS]
        out.append(f"{metric}:\n\n" + _md_table(header, rows))
    return "\n\n".join(out)


def runs_md(runs: list[RunData]) -> str:
    rows = []
    for run in runs:
        m, valid = run.config["model"], run.valid()
        mem = run.memory()
        wall = run.events[-1]["time"] - run.events[0]["time"] if len(run.events) > 1 else None
        rows.append([run.name, ", ".join(c["cell"] for c in run.cells) or "-",
                     f"{m['n_layers']}×{m['dim']}", str(m["mem_layers"] or "-") if mem or not m["mem_layers"] else "?",
                     _slots_label(run.slots()) if mem else "-", str(valid[-1]["step"] if valid else 0),
                     _num(valid[-1]["ppl"] if valid else None), _num(run.test["ppl"] if run.test else None),
                     _num(mem["usage"] if mem else None), _num(mem["kl"] if mem else None, 2),
                     _num(run.test.get("words_per_sec") if run.test else None, 0),
                     _num(wall / 60 if wall else None)])
    return _md_table(["run", "cells", "layers×dim", "memory layers", "slots", "steps", "valid ppl", "test ppl",
                      "usage %", "KL", "test words/s", "wall min"], rows)


def _hk(run: RunData) -> str:
    mem = run.config["model"]["memory"]
    return f"(h={mem['heads']}, k={mem['knn']})"


# ---- the paper's directions, checked on whatever was run ---------------------------------------

def _verdict(holds: bool) -> str:
    return "holds" if holds else "does not hold"


def _verdicts(parts: dict[str, bool]) -> str:
    """'holds' when every part does, 'does not hold' when none does, else which part does."""
    if all(parts.values()) or not any(parts.values()):
        return _verdict(all(parts.values()))
    return "partly: " + ", ".join(f"{name} {'holds' if ok else 'does not'}" for name, ok in parts.items())


def directions(runs: list[RunData]) -> list[tuple[str, str, str]]:
    """[(direction, 'holds' | 'does not hold' | 'not run', the numbers)] for the issue's six directions."""
    t1, t2, t3, t4, f6 = (by_cell(runs, t) for t in ("table1", "table2", "table3", "table4", "figure6"))
    base = baseline_run(runs)
    out = []

    with_memory = t2.get((512, True)) or t3.get((5,))
    name = "A memory beats the same model without it at equal steps (§4.5: 23.0 -> 19.8)"
    if base and with_memory:
        a, b = with_memory.test["ppl"], base.test["ppl"]
        out.append((name, _verdict(a < b), f"test ppl {a:.1f} with memory vs {b:.1f} without"))
    else:
        out.append((name, "not run", ""))

    name = "A shallower model with a memory beats a deeper one without, and is faster (Table 1: 12 layers + 1 memory vs 24 layers)"
    pairs = [(dim, t1[12, dim, 1], t1[24, dim, 0]) for dim in (1024, 1600) if (12, dim, 1) in t1 and (24, dim, 0) in t1]
    if pairs:
        better = faster = True
        text = []
        for dim, shallow, deep in pairs:
            (ps, _, _, ss), (pd, _, _, sd) = _stats(shallow), _stats(deep)
            better, faster = better and ps < pd, faster and (ss or 0) > (sd or 0)
            text.append(f"dim {dim}: ppl {ps:.1f} vs {pd:.1f}, {ss:,.0f} vs {sd:,.0f} words/s")
        out.append((name, _verdicts({"perplexity": better, "speed": faster}), "; ".join(text)))
    else:
        out.append((name, "not run", ""))

    name = "BatchNorm raises usage, the more so as the memory grows (Table 2)"
    sizes = [n for n in KEYS if (n, True) in t2 and (n, False) in t2]
    if sizes:
        gaps = [(n, t2[n, True].memory()["usage"] - t2[n, False].memory()["usage"]) for n in sizes]
        held = all(g > 0 for _, g in gaps[-1:]) and (len(gaps) < 2 or gaps[-1][1] > gaps[0][1])
        out.append((name, _verdict(held), "; ".join(
            f"{_slots_label(t2[n, True].slots())} slots: usage {t2[n, True].memory()['usage']:.1f}% with BN vs "
            f"{t2[n, False].memory()['usage']:.1f}% without (gap {g:+.1f})" for n, g in gaps)))
    else:
        out.append((name, "not run", ""))

    name = "Product keys use more of the memory than flat keys, and run faster (Table 4)"
    sizes = [n for n in KEYS if (n, "flat") in t4 and (n, "product") in t4]
    if sizes:
        more = faster = True
        text = []
        for n in sizes:
            (pp, up, kp, sp), (pf, uf, kf, sf) = _stats(t4[n, "product"]), _stats(t4[n, "flat"])
            more, faster = more and up > uf, faster and (sp or 0) > (sf or 0)
            text.append(f"{_slots_label(t4[n, 'product'].slots())} slots: usage {up:.1f}% vs {uf:.1f}% (KL {kp:.2f} "
                        f"vs {kf:.2f}), ppl {pp:.1f} vs {pf:.1f}, {sp:,.0f} vs {sf:,.0f} words/s")
        out.append((name, _verdicts({"usage": more, "speed": faster}), "; ".join(text)))
    else:
        out.append((name, "not run", ""))

    name = "A memory in an upper-middle layer (4 or 5 of 6) beats one at layer 1 (Table 3)"
    upper = [t3[(p,)] for p in (4, 5) if (p,) in t3]
    if upper and (1,) in t3:
        best = min(r.test["ppl"] for r in upper)
        out.append((name, _verdict(best < t3[(1,)].test["ppl"]),
                    f"test ppl {best:.1f} (layer 4/5) vs {t3[(1,)].test['ppl']:.1f} (layer 1)"))
    else:
        out.append((name, "not run", ""))

    name = "More memory heads and a larger k raise usage (Figure 6)"
    steps = [(a, b) for a in f6 for b in f6 if a != b and a[0] <= b[0] and a[1] <= b[1]
             and (a[0] < b[0]) + (a[1] < b[1]) == 1]  # one coordinate grows
    if steps:
        rises = [f6[b].memory()["usage"] > f6[a].memory()["usage"] for a, b in steps]
        out.append((name, _verdict(all(rises)), "; ".join(
            f"{_hk(f6[a])} {f6[a].memory()['usage']:.1f}% -> {_hk(f6[b])} {f6[b].memory()['usage']:.1f}%"
            for a, b in sorted(steps))))
    else:
        out.append((name, "not run", ""))
    return out


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
    for run, valid in curves:
        start = run.events[0]["time"]
        steps, times, ppl = ([e["step"] for e in valid], [(e["time"] - start) / 60 for e in valid],
                             [e["ppl"] for e in valid])
        line, = by_step.plot(steps, ppl, marker=".", label=run.path.parent.name)
        by_time.plot(times, ppl, marker=".", color=line.get_color())
    by_step.set(xlabel="step", ylabel="valid perplexity", yscale="log", title="valid perplexity vs step")
    by_time.set(xlabel="wall time (min, from the run's first event)", title="valid perplexity vs wall time")
    by_step.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_figure4(runs: list[RunData], path: Path) -> Path | None:
    points = [r for r in by_cell(runs, "table1").values() if r.test.get("words_per_sec")]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for with_memory, marker in ((False, "o"), (True, "s")):
        group = [r for r in points if bool(r.test.get("memories")) == with_memory]
        if group:
            ax.scatter([r.test["words_per_sec"] for r in group], [r.test["ppl"] for r in group], marker=marker,
                       label="with memory" if with_memory else "without memory")
        for r in group:
            ax.annotate(f"{r.config['model']['n_layers']}L d{r.config['model']['dim']}",
                        (r.test["words_per_sec"], r.test["ppl"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="inference speed (words/s, test evaluation)", ylabel="test perplexity",
           title="Figure 4: perplexity vs inference speed")
    ax.legend()
    return _save(fig, path)


def plot_table2(runs: list[RunData], path: Path) -> Path | None:
    cells = by_cell(runs, "table2")
    if not any(r.memory() for r in cells.values()):
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for bn, marker in ((False, "o"), (True, "s")):
        group = sorted((r.slots(), r) for (n, b), r in cells.items() if b == bn and r.memory())
        if not group:
            continue
        slots = [s for s, _ in group]
        for ax, values in zip(axes, ([r.memory()["usage"] for _, r in group], [r.memory()["kl"] for _, r in group],
                                     [r.test["ppl"] for _, r in group])):
            ax.plot(slots, values, marker=marker, label="BatchNorm" if bn else "no BatchNorm")
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
        grid = np.array([[_stats(cells.get((h, k)))[i] or np.nan for k in KNNS] for h in HEADS], dtype=float)
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


def plot_figure7(runs: list[RunData], benches: list[dict], path: Path) -> Path | None:
    """Speed vs memory size per key type: benchmark rows (solid) and the runs' test speed (dashed)."""
    series = {}
    for bench in benches:
        for row in bench.get("table4", {}).get("rows", []):
            speed = row.get("words_per_s") or row.get("tokens_per_s")
            series.setdefault((f"benchmark, {bench['settings'].get('dtype', '')}", row["key_type"]), []).append(
                (row["slots"], speed))
    for (n, kind), run in by_cell(runs, "table4").items():
        if run.test.get("words_per_sec") and run.slots():
            series.setdefault(("runs' test evaluation", kind), []).append((run.slots(), run.test["words_per_sec"]))
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (source, kind), points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if kind == "product" else "x",
                linestyle="-" if source.startswith("benchmark") else "--", label=f"{kind} keys ({source})")
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
    base = baseline_run(runs)
    figures = {
        "learning_curves.png": plot_learning_curves(runs, out / "learning_curves.png"),
        "figure4.png": plot_figure4(runs, out / "figure4.png"),
        "table2.png": plot_table2(runs, out / "table2.png"),
        "figure6.png": plot_figure6(runs, out / "figure6.png"),
        "figure7.png": plot_figure7(runs, list(benches), out / "figure7.png"),
    }
    parts = [
        "# Reproduction report: Large Memory Layers with Product Keys (Lample et al. 2019)",
        f"{len(runs)} runs" + (f", scale {', '.join(scales)}" if scales else "") + (f"; made by `{command}`." if command else "."),
        "Each table cell is ours, then the paper's number in parentheses; `·` is a cell not run, `-` one the "
        "paper does not report. At a reduced scale the sizes differ from the paper's (see xlm_pkm/reproduce.py); "
        "the column labels give ours. Speeds are the words/s of the test evaluation of each run on the machine "
        "it ran on.",
        "## The paper's directions\n\n" + _md_table(["direction", "here", "numbers"],
                                                     [list(d) for d in directions(runs)]),
        "## Table 1: test perplexity, with and without memory\n\n" + table1_md(runs),
        "## Table 2: memory size, with and without query BatchNorm\n\n" + table2_md(runs)
        + "\n\nWithout memory (§4.5): " + _pair(base.test["ppl"] if base else None, PAPER["baseline"]),
        "## Table 3: memory position in the 6-layer model\n\n" + table3_md(runs),
        "## Table 4: product keys vs flat keys\n\n" + table4_md(runs),
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
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.report", description=__doc__.split("\n")[0])
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
            from xlm_pkm.introspect import slot_contexts

            found = slot_contexts(target.path / "best.pt", top_slots=args.top_slots, per_slot=args.per_slot,
                                  max_batches=args.introspect_batches)
    except (ValueError, FileNotFoundError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    command = "python -m xlm_pkm.report " + " ".join(argv if argv is not None else sys.argv[1:])
    path = write_report(runs, Path(args.out), benches, target, found, command)
    print(f"wrote {path} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
