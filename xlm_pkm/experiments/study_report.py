"""A study's report, from its results folder alone: learning rates chosen on validation, learning curves
and convergence, compute, test perplexity at the chosen learning rates, paired comparisons.

Written by `python -m xlm_pkm.experiments.study report STUDY.yaml` to the study's `report` (report.md,
with learning_curves.png beside it). Test perplexity is read only from the runs at each cell's chosen
factor (the others have no test.json). A cell's row in the tables shows what is there; a comparison
needs both cells chosen and at least two seeds in common. Convergence: the last quarter's relative
improvement of valid perplexity, (p(¾T) − p(T)) / p(¾T), with p(¾T) the last evaluation at or before
three quarters of the run's T steps, mean over the cell's seeds. Compute: total and active parameters
and training FLOPs per token of the run's config.yaml (reproduce.model_size, on the meta device), and
the median of the training tokens/s the runs logged (runs side by side share the machine: a rough
speed, not a benchmark), and with `--bench FILE` the tokens/s of a benchmark's rows named after the
cells (benchmarks/variants_speed.py: every cell timed alone, interleaved).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from xlm_pkm.config import load_config
from xlm_pkm.experiments.paired import ALPHA, HOLDS, INCONCLUSIVE, REVERSED, holm, paired
from xlm_pkm.experiments.report import Measure, _md_table, _pyplot, _save
from xlm_pkm.experiments.reproduce import _shown
from xlm_pkm.experiments.study_plan import LR_KEYS, Study, StudyError, StudyRun
from xlm_pkm.model.transformer import resolve_memory_layers
from xlm_pkm.runs.run_record import read_json_lines
from xlm_pkm.runs.sizes import count_text, model_size
from xlm_pkm.utils.atomic import write_text


def bench_rows(benches: list[dict]) -> dict[str, float]:
    """{cell: tokens/s} of the benchmarks' rows (benchmarks/variants_speed.py), under each name a row times."""
    return {name: row["tokens_per_s"] for bench in benches for row in bench.get("rows", [])
            for name in row.get("cells", [row["cell"]])}


def events(run: StudyRun, kind: str) -> list[dict]:
    try:
        return [e for e in read_json_lines(run.results / "metrics.jsonl") if e.get("event") == kind]
    except (OSError, ValueError) as e:
        raise StudyError(str(e)) from None


def curve(run: StudyRun) -> list[tuple[int, float]]:
    """(training tokens, valid perplexity) at each evaluation of a trained run."""
    return [(e["step"] * run.tokens_per_step, e["ppl"]) for e in events(run, "valid")]


def last_quarter(run: StudyRun) -> float | None:
    """(p(¾T) − p(T)) / p(¾T) of valid perplexity p (module docstring); None without an evaluation by ¾T."""
    valid = {e["step"]: e["ppl"] for e in events(run, "valid")}
    early = [s for s in valid if s <= 0.75 * run.steps]
    if not early or run.steps not in valid:
        return None
    return (valid[max(early)] - valid[run.steps]) / valid[max(early)]


def tested_ppl(study: Study, cell: str) -> dict[int, float]:
    """{seed: test perplexity} of the cell's runs at its chosen factor that are evaluated (and only those)."""
    return {r.seed: json.loads((r.results / "test.json").read_text())["ppl"]
            for r in study.chosen_runs(cell) if r.tested}


def memory_use(study: Study, cell: str) -> str:
    """Each memory layer's test usage % and KL (weighted), means over the tested seeds: "L5 98.6/1.24"."""
    layers: dict[int, list[tuple[float, float]]] = {}
    for r in study.chosen_runs(cell):
        if r.tested:
            for m in json.loads((r.results / "test.json").read_text()).get("memories", []):
                layers.setdefault(m["layer"], []).append((m["usage"], m["kl"]))
    return "; ".join(f"L{layer} {statistics.mean(u for u, _ in v):.1f}/{statistics.mean(k for _, k in v):.2f}"
                     for layer, v in sorted(layers.items())) or "·"


def header(study: Study, m: int) -> str:
    grid = ", ".join(f"×{f:g}" for f in study.lr_grid)
    run = study.run(next(iter(study.cells)), study.lr_grid[0], study.seeds[0])
    return "\n\n".join([
        f"# Study `{study.name}`",
        f"Made by `python -m xlm_pkm.experiments.study report {_shown(study.path)}` from the small files of "
        f"`{_shown(study.results)}` (the runs of `python -m xlm_pkm.experiments.study run {_shown(study.path)}`). "
        f"Every run trains on {study.tokens:,} tokens (e.g. {run.steps:,} steps of {run.tokens_per_step:,} tokens for "
        f"`{run.cell}`), validated every {study.eval_every_tokens:,} tokens; seeds {', '.join(map(str, study.seeds))}.",
        f"**Learning rates, chosen on validation only.** Each cell's learning rates (`{'`, `'.join(LR_KEYS)}` of "
        f"`optim`, together, so their ratios stay) are multiplied by each factor of the grid ({grid}) for seed "
        f"{study.seeds[0]}; the factor whose run has the lowest valid perplexity (of best.pt, the checkpoint the "
        f"test evaluates) is chosen, then every other seed runs at it. Only runs at the chosen factor are "
        f"evaluated on the test split. "
        + (f"While the best factor is at an end of a cell's grid, its grid grows one step past that end, up to "
           f"{study.lr_extend} time(s); a choice still at an end is flagged: the best may lie beyond it."
           if study.lr_extend else "A choice at an end of the grid is flagged: the best may lie beyond it.")
        + (f" Then, {study.lr_refine} time(s), the grid is refined around the best factor: the geometric midpoints "
           f"between it and its trained neighbours are trained too, and the best over all is chosen."
           if study.lr_refine else ""),
        f"**Comparisons.** Each claim says that cell a has a lower test perplexity than cell b. Seeds pair the runs "
        f"(same seed: same data order), so the numbers are the per-seed differences a − b: their mean, its 95% "
        f"interval (Student t with n − 1 degrees of freedom) and the sign on every seed (− where a is lower, as "
        f"claimed). Over the {m} comparison(s) of this report, Holm's correction: the adjusted p-value of the i-th "
        f"smallest p is max over j ≤ i of min(1, (m − j + 1) p_(j)); the adjusted interval is the t interval at "
        f"level 1 − {ALPHA:g} / (m − min(i, s) + 1), s the first rank Holm does not reject, so that it excludes 0 "
        f"exactly when Holm rejects. The verdict follows from the adjusted interval: **{HOLDS}** when it lies below "
        f"0 (as claimed), **{REVERSED}** when above 0, **{INCONCLUSIVE}** when it contains 0.",
    ])


def choice_table(study: Study) -> str:
    factors = sorted({f for cell in study.cells for f in study.grid(cell)})  # every cell's grid, grown or not
    rows = []
    for cell in study.cells:
        done = {r.factor: r.valid_ppl() for r in study.grid_runs(cell) if r.trained}
        valid = [f"{done[f]:.1f}" if f in done else "·" for f in factors]
        choice = study.choice(cell)
        if choice is None:
            rows.append([f"`{cell}`", *valid, "·", "·", ""])
            continue
        lrs = json.loads((study.run(cell, choice.factor, study.seeds[0]).results / "run.json").read_text())["lr"]
        own = LR_KEYS[:2] if resolve_memory_layers(study.base_config(cell).model) else LR_KEYS[:1]  # values_lr: memory
        chosen = ", ".join(f"{k} {lrs[k]:.3g}" for k in own)
        flag = f"**at the {choice.edge} end of the grid**" if choice.edge else ""
        rows.append([f"`{cell}`", *valid, f"×{choice.factor:.3g}", chosen, flag])
    return _md_table(["cell", *(f"valid ppl ×{f:.3g}" for f in factors), "chosen", "learning rates", "flag"], rows)


def cell_table(study: Study, speeds: dict[str, float]) -> str:
    rows = []
    for cell, (config, _) in study.cells.items():
        runs = [r for r in study.chosen_runs(cell) if r.trained]
        if not runs:
            rows.append([f"`{cell}`", f"`{config}`", *["·"] * 11])
            continue
        cfg = load_config(runs[0].results / "config.yaml")
        size = model_size(cfg, cfg.data.bptt)
        test = tested_ppl(study, cell)
        quarter = [q for q in map(last_quarter, runs) if q is not None]
        speed = [e["tokens_per_sec"] for r in runs for e in events(r, "train") if e["step"] > 1]
        rows.append([f"`{cell}`", f"`{config}`", Measure(tuple(test.values())).text() if test else "·",
                     f"{len(test)}/{len(study.seeds)}", memory_use(study, cell), count_text(size["total"]),
                     count_text(size["active"]),
                     f"{size['flops'] / 1e6:.2f}M", f"{statistics.median(speed):,.0f}" if speed else "·",
                     f"{speeds[cell]:,.0f}" if cell in speeds else "·",
                     f"{runs[0].steps * runs[0].tokens_per_step:,}",
                     f"{100 * statistics.mean(quarter):.1f}" if quarter else "·", str(len(runs))])
    return _md_table(["cell", "config", "test ppl (mean ± sd)", "seeds tested", "memory usage %/KL (test)", "params",
                      "active params",
                      "train FLOPs/token", "logged train tokens/s", "benchmark tokens/s", "tokens",
                      "last-quarter improvement %",
                      "runs"], rows)


def comparison_table(study: Study) -> str:
    tests = {cell: tested_ppl(study, cell) for cell in study.cells}
    pairs = [paired(tests[c.a], tests[c.b]) for c in study.comparisons]
    adjusted = holm(pairs)
    rows = []
    for c, pair, adj in zip(study.comparisons, pairs, adjusted):
        seeds = ", ".join(f"{s}: {d:+.2f}" for s, d in zip(pair.seeds, pair.diffs))
        if pair.n < 2:
            rows.append([c.claim, f"`{c.a}` − `{c.b}`", seeds or "·", pair.signs() or "·", "·", "·", "·", "·",
                         f"{INCONCLUSIVE} (fewer than 2 paired seeds)"])
            continue
        lo, hi = pair.interval()
        (alo, ahi), level = adj.interval, adj.level
        rows.append([c.claim, f"`{c.a}` − `{c.b}`", seeds, pair.signs(), f"{pair.mean:+.2f}",
                     f"[{lo:+.2f}, {hi:+.2f}]", f"[{alo:+.2f}, {ahi:+.2f}] at {100 * level:.2f}%", f"{adj.p:.3g}",
                     f"**{adj.verdict}**"])
    return _md_table(["claim", "difference", "per seed", "signs", "mean", "95% interval", "Holm-adjusted interval",
                      "Holm p", "verdict"], rows)


def plot_curves(study: Study, path: Path) -> Path | None:
    """Valid perplexity against training tokens: each seed of each cell at its chosen factor."""
    chosen = {cell: [r for r in study.chosen_runs(cell) if r.trained] for cell in study.cells}
    if not any(chosen.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab10" if len(chosen) <= 10 else "tab20")
    for i, (cell, runs) in enumerate((c, r) for c, r in chosen.items() if r):
        for j, run in enumerate(runs):
            tokens, ppl = zip(*curve(run))
            ax.plot(tokens, ppl, color=colours(i), linewidth=1, alpha=0.8,
                    label=f"{cell} (×{run.factor:.3g})" if j == 0 else None)
    ax.set(xlabel="training tokens", ylabel="valid perplexity (each seed at the chosen lr)", yscale="log")
    ax.legend(fontsize=7, loc="upper right")
    return _save(fig, path)


def write_report(study: Study, benches: list[dict] = ()) -> Path:
    """report.md and learning_curves.png at study.report; `benches`: benchmark JSON with rows {cell, tokens_per_s}."""
    if not any(r.trained for cell in study.cells for r in study.grid_runs(cell)):
        raise StudyError(f"{study.path}: no run of the study is trained yet in {study.results}: nothing to report")
    out = study.report
    out.parent.mkdir(parents=True, exist_ok=True)
    figure = plot_curves(study, out.parent / "learning_curves.png")
    missing = [cell for cell in study.cells if len(tested_ppl(study, cell)) < len(study.seeds)]
    parts = [
        header(study, len(study.comparisons)),
        "## Learning rates chosen on validation\n\n"
        f"Valid perplexity of seed {study.seeds[0]} at each factor of the grid (· not trained yet).\n\n"
        + choice_table(study),
        "## Cells at their chosen learning rates\n\n" + cell_table(study, bench_rows(benches)),
        *([f"![learning curves]({figure.name})"] if figure else []),
        *(["## Comparisons\n\n" + comparison_table(study)] if study.comparisons else []),
        *([f"Not finished yet: {', '.join(f'`{c}`' for c in missing)}."] if missing else []),
    ]
    write_text(out, "\n\n".join(parts) + "\n")
    return out
