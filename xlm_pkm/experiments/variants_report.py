"""The memory variants' study report (results/variants): every cell of `reproduce variants`, beside the
orderings its papers publish.

    python -m xlm_pkm.experiments.variants_report dumped/variants --out results/variants \\
        --bench benchmarks/results/variants_speed_cpu.json

Per cell (one config of configs/variants/paper, mean ± sd over its seeds): test perplexity, total and
active parameters (active: the dense ones plus the value rows a token reads), training FLOPs per token
(both from the run's own config, on the meta device), training tokens/s from the variants_speed
benchmark (interleaved, median of rounds; never the runs' own logs), and each memory's usage and KL on
the test split (the mean over a cell's memory layers). The verdicts use the rule of results/tiny: an
ordering holds when each gap, in the paper's direction, exceeds the sum of the two spreads.
Writes OUT/report.md and OUT/variants.png (perplexity against active parameters and against tokens/s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from xlm_pkm.config import load_config
from xlm_pkm.experiments.report import (FAILS, HOLDS, NOISE, CellRuns, Measure, RunData, _md_table, _pyplot, _save,
                                        find_runs, shows)
from xlm_pkm.experiments.reproduce import model_size
from xlm_pkm.utils.atomic import write_text

# cell -> (design, paper, what it changes from the reference cell `pkm`); a cell not listed shows its name
DESIGNS = {
    "dense_params": ("dense, matched parameters", "-", "no memory; every FFN widened to the PKM cell's parameters"),
    "dense_flops": ("dense, matched FLOPs", "-", "no memory; every FFN widened to the PKM cell's FLOPs per token"),
    "pkm": ("PKM (softmax)", "Lample et al. 2019", "the reference: product keys, softmax, one value table"),
    "pkm_relu": ("PKM ReLU", "Csordás et al. 2023", "ReLU of the selected scores instead of their softmax"),
    "memory_plus": ("Memory+", "Berges et al. 2024", "gated output; two memory layers share one value table"),
    "peer": ("PEER", "He 2024", "slots are single-neuron experts σ(u·x) v"),
    "ultramem": ("UltraMem", "Huang et al. 2025", "every UltraMem component (see its ablation steps)"),
}
# Published orderings, best (lowest perplexity) first
ORDERINGS = [
    ("Csordás et al. 2023, Table 2: at matched parameters, dense < PKM-ReLU < PKM-softmax",
     ["dense_params", "pkm_relu", "pkm"]),
    ("PEER (He 2024), Table 1 / Fig. 1: at matched FLOPs, PEER < PKM < dense", ["peer", "pkm", "dense_flops"]),
]


def variant_cells(runs: list[RunData]) -> dict[str, CellRuns]:
    """{cell: its runs with a test result}, in cell order; a run fills every variants cell it serves (the
    last UltraMem step and `ultramem` are one config, so one run)."""
    cells: dict[str, CellRuns] = {}
    for run in runs:
        for cell in run.cells:
            if cell["table"] == "variants" and run.test:
                cells.setdefault(cell["key"]["variant"], CellRuns()).append(run)
    return dict(sorted(cells.items()))


def design(name: str) -> tuple[str, str, str]:
    """(design, paper, what it changes) of a cell; UltraMem's steps from their names."""
    if name.startswith("ultramem_step"):
        k, what = name[13:].split("_", 1)
        return f"UltraMem step {k}", "Huang et al. 2025, Table 2", f"the step before, + {what.replace('_', ' ')}"
    return DESIGNS.get(name, (name, "", ""))


def ultramem_steps(cells: dict[str, CellRuns]) -> list[str]:
    """UltraMem's Table 2 path: the reference, then configs ultramem_step<k>_* in k order, then ultramem
    unless it is the last step's run (the same config)."""
    steps = sorted((c for c in cells if c.startswith("ultramem_step")), key=lambda c: int(c[13:].split("_")[0]))
    same = steps and "ultramem" in cells and [r.path for r in cells["ultramem"]] == [r.path for r in cells[steps[-1]]]
    return ["pkm", *steps, *(["ultramem"] if "ultramem" in cells and not same else [])]


def ordering_verdict(cells: dict[str, CellRuns], order: list[str]) -> tuple[str, str]:
    """(verdict, numbers) of 'perplexity rises along `order`': each consecutive pair by `shows`."""
    missing = [c for c in order if c not in cells]
    if missing:
        return "not run", f"missing: {', '.join(missing)}"
    ppl = [cells[c].measure("ppl") for c in order]
    parts = [shows(a, b, higher_is_better=False) for a, b in zip(ppl, ppl[1:])]
    verdict = parts[0] if len(set(parts)) == 1 else "partly: " + ", ".join(
        f"{a} < {b} {v}" for a, b, v in zip(order, order[1:], parts))
    return verdict, " vs ".join(f"{c} {m.text()}" for c, m in zip(order, ppl))


def memory_measure(cell: CellRuns, metric: str) -> Measure | None:
    """usage or kl averaged over the run's memories, over the seeds; None without memory."""
    values = [sum(m[metric] for m in run.test["memories"]) / len(run.test["memories"])
              for run in cell if run.test.get("memories")]
    return Measure(tuple(values)) if len(values) == len(cell) and values else None


def sizes(cell: CellRuns) -> dict[str, float]:
    cfg = load_config(cell[0].path / "config.yaml")
    return model_size(cfg, cfg.data.bptt)


def bench_rows(benches: list[dict]) -> dict[str, float]:
    return {row["cell"]: row["tokens_per_s"] for bench in benches for row in bench.get("rows", [])}


def _count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def cell_table(cells: dict[str, CellRuns], size: dict[str, dict], speeds: dict[str, float]) -> str:
    rows = []
    for name, cell in cells.items():
        label, paper, change = design(name)
        usage, kl = memory_measure(cell, "usage"), memory_measure(cell, "kl")
        rows.append([label, f"`{name}`", paper, change, cell.measure("ppl").text(), _count(size[name]["total"]),
                     _count(size[name]["active"]), f"{size[name]['flops'] / 1e6:.2f}M",
                     f"{speeds[name]:,.0f}" if name in speeds else "·", usage.text() if usage else "-",
                     kl.text(2) if kl else "-", str(len(cell))])
    return _md_table(["design", "cell", "paper", "what it changes", "test ppl", "params", "active params",
                      "train FLOPs/token", "train tokens/s", "usage %", "KL", "seeds"], rows)


def plot(cells: dict[str, CellRuns], size: dict[str, dict], speeds: dict[str, float], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    markers = "osD^v<>phX*P"
    for i, (name, cell) in enumerate(cells.items()):
        ppl, label = cell.measure("ppl"), design(name)[0]
        style = dict(marker=markers[i % len(markers)], capsize=3, linestyle="none", label=label)
        axes[0].errorbar(size[name]["active"], ppl.mean, yerr=ppl.sd, **style)
        if name in speeds:
            axes[1].errorbar(speeds[name], ppl.mean, yerr=ppl.sd, **style)
    axes[0].set(xlabel="active parameters per token", ylabel="test perplexity (mean ± sd over seeds)")
    axes[1].set(xlabel="CPU training tokens/s (benchmark, median of rounds)")
    axes[1].legend(fontsize=7, loc="best")
    return _save(fig, path)


def write_report(cells: dict[str, CellRuns], out: Path, benches: list[dict], command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    speeds = bench_rows(benches)
    orderings = [(claim, *ordering_verdict(cells, order)) for claim, order in ORDERINGS]
    path = ultramem_steps(cells)
    if len(path) > 2:
        orderings.append(("UltraMem (Huang et al. 2025), Table 2: each added component lowers the loss ("
                          + " → ".join(path) + ")", *ordering_verdict(cells, path[::-1])))
    size = {name: sizes(cell) for name, cell in cells.items()}  # each model built once, on the meta device
    figure = plot(cells, size, speeds, out / "variants.png")
    parts = [
        "# The memory variants at one scale: PKM, PKM-ReLU, Memory+, PEER, UltraMem and dense baselines",
        f"{sum(map(len, cells.values()))} runs in {len(cells)} cells; made by `{command}`.",
        f"A published ordering **{HOLDS}** when each gap between consecutive cells, in the paper's direction, "
        f"exceeds the sum of the two cells' standard deviations over seeds, **{FAILS}** when an opposite gap "
        f"does, and is **{NOISE}** otherwise.",
        "## Published orderings\n\n" + _md_table(["claim", "here", "test perplexity"],
                                                 [list(o) for o in orderings]),
        "## Cells\n\n" + cell_table(cells, size, speeds),
        f"![{figure.name}]({figure.name})",
    ]
    report = out / "report.md"
    write_text(report, "\n\n".join(parts) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.variants_report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="run directories, or directories holding them")
    parser.add_argument("--out", default="results/variants")
    parser.add_argument("--bench", nargs="*", default=[], help="variants_speed benchmark JSON")
    args = parser.parse_args(argv)
    try:
        cells = variant_cells(find_runs([Path(d) for d in args.dirs]))
        benches = [json.loads(Path(b).read_text()) for b in args.bench]
    except (ValueError, OSError, json.JSONDecodeError) as e:
        print(f"variants_report: error: {e}", file=sys.stderr)
        return 2
    if not cells:
        print("variants_report: error: no run of the variants study with a test result there", file=sys.stderr)
        return 2
    command = "python -m xlm_pkm.experiments.variants_report " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"wrote {write_report(cells, Path(args.out), benches, command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
