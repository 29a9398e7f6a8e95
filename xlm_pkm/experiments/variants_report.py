"""The memory variants' study report (results/variants): every cell of `reproduce variants`, beside the
orderings its papers publish.

    python -m xlm_pkm.experiments.variants_report dumped/variants --out results/variants \\
        --bench benchmarks/results/variants_speed_cpu.json

Per cell (one config of configs/variants/paper, mean ± sd over its seeds): test perplexity, total and
active parameters (active: the dense ones plus the value rows a token reads), training FLOPs per token
(both from the run's own config, on the meta device), training tokens/s from the variants_speed
benchmark (interleaved, median of rounds; never the runs' own logs), each memory's usage and KL on the
test split (the mean over a cell's memory layers) and the share of its Engram tables' rows read. Test perplexity
and parameters are the cell's row of `python -m xlm_pkm.runs compare` (runs/table.py's summary). The
verdicts use the rule of results/tiny: an ordering holds when each gap, in the paper's direction, exceeds
the sum of the two spreads. The allocation section places the cells that split the PKM cell's memory
budget between PKM and Engram (pkm, engram_share*, engram) at their Engram share of the memory parameters
(from their configs) and asks whether perplexity is U-shaped in it, as the Engram paper's Fig. 3.
Writes OUT/report.md, OUT/variants.png (perplexity against active parameters and against tokens/s) and
OUT/allocation.png (perplexity against the Engram share).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import torch

from xlm_pkm.config import Config, load_config_dict
from xlm_pkm.experiments.report import (
    FAILS,
    HOLDS,
    NOISE,
    CellRuns,
    Measure,
    RunData,
    _md_table,
    _pyplot,
    _save,
    find_runs,
    shows,
)
from xlm_pkm.experiments.reproduce import model_size
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.runs.run_record import RunRecord
from xlm_pkm.runs.table import summary
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
    "engram": ("Engram", "DeepSeek-AI 2026", "no PKM: hashed 2-/3-gram tables at layer 2 take its value parameters"),
    **{f"engram_share{p}": (f"PKM + Engram, {p}%", "DeepSeek-AI 2026, §3.1",
                            f"~{p}% of the PKM's value parameters moved to Engram tables at layer 2")
       for p in (25, 50, 75)},
}
# Published orderings, best (lowest perplexity) first
ORDERINGS = [
    ("Csordás et al. 2023, Table 2: at matched parameters, dense < PKM-ReLU < PKM-softmax",
     ["dense_params", "pkm_relu", "pkm"]),
    ("PEER (He 2024), Table 1 / Fig. 1: at matched FLOPs, PEER < PKM < dense", ["peer", "pkm", "dense_flops"]),
]
# The memory budget split between PKM and Engram, from all PKM to all Engram
ALLOCATION = ["pkm", "engram_share25", "engram_share50", "engram_share75", "engram"]
U_CLAIM = ("Engram paper (DeepSeek-AI 2026) §3.1 / Fig. 3: validation loss is U-shaped in the share, best with "
           "~20-25% of the sparse budget to Engram (their ρ = 75-80% to MoE experts; here PKM in the MoE's place)")


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
    """UltraMem's Table 2 path: the reference, then configs ultramem_step<k>_* in k order (k a number, then a
    letter for a step inserted after it: 1, 1b, 2), then ultramem unless it is the last step's run (the same
    config)."""
    steps = sorted((c for c in cells if c.startswith("ultramem_step")),
                   key=lambda c: (int(re.match(r"\d+", c[13:]).group()), c[13:].split("_")[0]))
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


def memory_measure(cell: CellRuns, metric: str, kind: str = "memories") -> Measure | None:
    """usage or kl averaged over the run's memories (kind "memories") or Engram layers ("engrams"), over the
    seeds; None without them."""
    values = [sum(m[metric] for m in run.test[kind]) / len(run.test[kind]) for run in cell if run.test.get(kind)]
    return Measure(tuple(values)) if len(values) == len(cell) and values else None


def memory_split(cfg: Config) -> dict[str, int]:
    """PKM value-table and Engram table parameters, PKM slots and Engram table rows of cfg's model (meta device;
    the vocabulary size does not change them)."""
    with torch.device("meta"):
        model = TransformerLM(dataclasses.replace(cfg.model, vocab_size=1000))
    tables = [e.table for _, e in model.engrams()]
    values = sum(p.numel() for p in model.memory_value_parameters() if not getattr(p, "engram_table", False))
    return {"pkm_values": values, "engram_values": sum(t.numel() for t in tables),
            "slots": sum(m.n_slots for _, m in model.memories()), "engram_rows": sum(t.shape[0] for t in tables)}


def sizes(cell: CellRuns) -> dict[str, float]:
    """model_size and memory_split of the cell's config."""
    # the run's resolved config (config.yaml), of an earlier version migrated
    cfg = load_config_dict(cell[0].config, source=str(cell[0].path / "config.yaml"))
    return {**model_size(cfg, cfg.data.bptt), **memory_split(cfg)}


def engram_share(size: dict[str, float]) -> float:
    """% of the memory parameters (PKM values and Engram tables) in Engram tables."""
    return 100 * size["engram_values"] / (size["engram_values"] + size["pkm_values"])


def bench_rows(benches: list[dict]) -> dict[str, float]:
    return {row["cell"]: row["tokens_per_s"] for bench in benches for row in bench.get("rows", [])}


def _count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def cell_table(cells: dict[str, CellRuns], size: dict[str, dict], speeds: dict[str, float]) -> str:
    """A row per cell: its design, the test ppl and sizes of its row in `runs compare` (runs.table.summary), the
    study's own columns (FLOPs, the benchmark's tokens/s, usage and KL averaged over the memory layers)."""
    rows = []
    for name, cell in cells.items():
        label, paper, change = design(name)
        usage, kl = memory_measure(cell, "usage"), memory_measure(cell, "kl")
        engram = memory_measure(cell, "usage", "engrams")
        row = summary([RunRecord(run.path) for run in cell])
        rows.append([label, f"`{name}`", paper, change, row["test ppl"].text(), _count(row["params"]),
                     _count(row["active params"]), f"{size[name]['flops'] / 1e6:.2f}M",
                     f"{speeds[name]:,.0f}" if name in speeds else "·", usage.text() if usage else "-",
                     kl.text(2) if kl else "-", engram.text() if engram else "-", str(len(cell))])
    return _md_table(["design", "cell", "paper", "what it changes", "test ppl", "params", "active params",
                      "train FLOPs/token", "train tokens/s", "usage %", "KL", "Engram rows read %", "seeds"], rows)


def u_shape(cells: dict[str, CellRuns], share: dict[str, float]) -> tuple[str, str]:
    """(verdict and the best share, sentence) of 'an interior share beats both ends (all PKM, all Engram)':
    the best interior cell against each end by `shows`; and which share is best."""
    ends, inner = (ALLOCATION[0], ALLOCATION[-1]), [c for c in ALLOCATION[1:-1] if c in cells]
    missing = [c for c in ends if c not in cells]
    if missing or not inner:
        return "not run", "missing: " + ", ".join(missing or ["every interior share"])
    ppl = {c: cells[c].measure("ppl") for c in ALLOCATION if c in cells}

    def at(c: str) -> str:
        return f"{c} ({share[c]:.0f}% to Engram, ppl {ppl[c].text()})"

    mid = min(inner, key=lambda c: ppl[c].mean)
    parts = [shows(ppl[mid], ppl[end], higher_is_better=False) for end in ends]
    verdict = HOLDS if parts == [HOLDS, HOLDS] else FAILS if FAILS in parts else NOISE
    shape = {HOLDS: "A U shape appears", FAILS: "No U shape", NOISE: "No U shape beyond the spreads"}[verdict]
    best = min(ppl, key=lambda c: ppl[c].mean)
    ties = [c for c in ppl if c != best and shows(ppl[best], ppl[c], higher_is_better=False) != HOLDS]
    sentence = (f"{shape}: the best interior point, {at(mid)}, against {at(ends[0])}: {parts[0]}; against "
                f"{at(ends[1])}: {parts[1]}. The lowest mean perplexity is at {share[best]:.0f}% to Engram "
                f"(`{best}`), " + (f"within noise of {', '.join(f'`{c}`' for c in ties)}." if ties
                                   else "below every other share beyond the spreads."))
    return f"{verdict}; lowest at {share[best]:.0f}%", sentence


def allocation_section(cells: dict[str, CellRuns], size: dict[str, dict], share: dict[str, float], sentence: str,
                       out: Path) -> str:
    """The table and figure of the cells of ALLOCATION that were run ({cell: Engram share %}), and the sentence
    of u_shape."""
    rows = [[f"`{c}`", f"{share[c]:.1f}", f"{size[c]['slots']:,}", f"{size[c]['engram_rows']:,}",
             _count(size[c]["total"]), cells[c].measure("ppl").text(), str(len(cells[c]))] for c in share]
    figure = plot_allocation(cells, share, out / "allocation.png")
    return "\n\n".join([
        "## Allocation: a fixed memory budget split between PKM and Engram",
        "The PKM cell's memory parameters split between its value table and Engram tables (at layer 2); the "
        "Engram share is computed from each cell's config: Engram table parameters / (Engram table + PKM "
        "value-table parameters). " + U_CLAIM + ".",
        _md_table(["cell", "Engram share %", "PKM slots", "Engram table rows", "params", "test ppl", "seeds"], rows),
        sentence,
        f"![{figure.name}]({figure.name})",
    ])


def plot_allocation(cells: dict[str, CellRuns], share: dict[str, float], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ppl = [cells[c].measure("ppl") for c in share]
    ax.axvspan(20, 25, color="0.9", label="the Engram paper's best share (Fig. 3)")
    ax.errorbar(list(share.values()), [m.mean for m in ppl], yerr=[m.sd for m in ppl], marker="o", capsize=3)
    for (name, x), m in zip(share.items(), ppl):
        ax.annotate(name, (x, m.mean), textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.set(xlabel="Engram share of the memory parameters (%)", ylabel="test perplexity (mean ± sd over seeds)",
           xlim=(-5, 115))  # room for the last point's name
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


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
    axes[1 if speeds else 0].legend(fontsize=7, loc="best")  # the panel with every cell when none is timed
    return _save(fig, path)


def write_report(cells: dict[str, CellRuns], out: Path, benches: list[dict], command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    speeds = bench_rows(benches)
    orderings = [(claim, *ordering_verdict(cells, order)) for claim, order in ORDERINGS]
    path = ultramem_steps(cells)
    if len(path) > 2:
        orderings.append(("UltraMem (Huang et al. 2025), Table 2: each added component lowers the loss ("
                          + " → ".join(path) + ")", *ordering_verdict(cells, path[::-1])))
    size = {name: sizes(cell) for name, cell in cells.items()}  # built on the meta device
    share = {c: engram_share(size[c]) for c in ALLOCATION if c in cells}
    u = u_shape(cells, share) if share.keys() - {ALLOCATION[0]} else None  # some cell with Engram
    if u:
        orderings.append((U_CLAIM, u[0], u[1] if u[0] == "not run" else " vs ".join(
            f"{c} ({share[c]:.0f}%) {cells[c].measure('ppl').text()}" for c in share)))
    figure = plot(cells, size, speeds, out / "variants.png")
    parts = [
        "# The memory variants at one scale: PKM, PKM-ReLU, Memory+, PEER, UltraMem, Engram and dense baselines",
        f"{sum(map(len, cells.values()))} runs in {len(cells)} cells; made by `{command}`.",
        f"A published ordering **{HOLDS}** when each gap between consecutive cells, in the paper's direction, "
        f"exceeds the sum of the two cells' standard deviations over seeds, **{FAILS}** when an opposite gap "
        f"does, and is **{NOISE}** otherwise.",
        "## Published orderings\n\n" + _md_table(["claim", "here", "test perplexity"],
                                                 [list(o) for o in orderings]),
        "## Cells\n\n" + cell_table(cells, size, speeds),
        f"![{figure.name}]({figure.name})",
        *([allocation_section(cells, size, share, u[1], out)] if u else []),
    ]
    report = out / "report.md"
    write_text(report, "\n\n".join(parts) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlm_pkm.experiments.variants_report",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
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
        print("variants_report: error: no run of the variants study with a test result there (a table of any "
              "runs: python -m xlm_pkm.runs compare DIR)", file=sys.stderr)
        return 2
    command = "python -m xlm_pkm.experiments.variants_report " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"wrote {write_report(cells, Path(args.out), benches, command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
