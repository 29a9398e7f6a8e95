"""A study's report, from its results folder alone: learning rates chosen on validation, learning curves
and convergence, compute, test perplexity at the chosen learning rates, paired comparisons.

Written by `python -m xlm_pkm.experiments.study report STUDY.yaml` to the study's `report` (report.md,
with learning_curves.png beside it). Test perplexity is read only from the runs at each cell's chosen
factor (the others have no test.json). A cell's row in the tables shows what is there; a comparison
needs both cells chosen and at least two seeds in common. Convergence: the last quarter's relative
improvement of valid perplexity, (p(¾T) − p(T)) / p(¾T), with p(¾T) the last evaluation at or before
three quarters of the run's T steps, mean over the cell's seeds, each read on the curve of the training its test
read (`curve_folder`: the re-train's where the run was trained again, study.retrain). Compute: total and active
parameters and training FLOPs per token of the run's config.yaml (reproduce.model_size, on the meta device), and
the median of the training tokens/s the runs logged (runs side by side share the machine: a rough
speed, not a benchmark), and with `--bench FILE` the tokens/s of a benchmark's rows named after the
cells (benchmarks/variants_speed.py: every cell timed alone, interleaved). Under the study's divergence rule
(study_plan.py) a cell's row names each diverged run, why, and its re-run one factor lower (the one compared);
a per-seed difference from a re-run carries its factor. Robustness: each claim again with a, then b, at its
cell's next lower factor (the other at its choice), wherever every seed there is tested; "not run" otherwise.
Every test read counts with the study's test_max_batches only: a report over a test read with another is refused
(study_plan.Study.stale_tests; `study run` reads it again). Each file is written whole or not at all (utils/atomic.py:
a full disk is one OutputError line, and the previous report.md and learning_curves.png stay as they were).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from xlm_pkm.config import load_config
from xlm_pkm.experiments.paired import ALPHA, HOLDS, INCONCLUSIVE, REVERSED, Paired, holm, paired
from xlm_pkm.experiments.report import Measure, _md_table, _pyplot
from xlm_pkm.experiments.reproduce import _shown
from xlm_pkm.experiments.study_plan import LR_KEYS, METRICS, Comparison, Study, StudyError, StudyRun
from xlm_pkm.model.transformer import resolve_memory_layers
from xlm_pkm.runs.run_record import read_json_lines
from xlm_pkm.runs.sizes import count_text, model_size
from xlm_pkm.utils.atomic import OutputError, atomic_file, write_error, write_text


def bench_rows(benches: list[dict]) -> dict[str, float]:
    """{cell: tokens/s} of the benchmarks' rows (benchmarks/variants_speed.py), under each name a row times."""
    return {name: row["tokens_per_s"] for bench in benches for row in bench.get("rows", [])
            for name in row.get("cells", [row["cell"]])}


def events(run: StudyRun, kind: str, folder: Path | None = None) -> list[dict]:
    """The run's metrics.jsonl events of `kind`, from its results (or `folder`, e.g. its re-train's)."""
    try:
        return [e for e in read_json_lines((folder or run.results) / "metrics.jsonl") if e.get("event") == kind]
    except (OSError, ValueError) as e:
        raise StudyError(str(e)) from None


def curve(run: StudyRun) -> list[tuple[int, float]]:
    """(training tokens, valid perplexity) at each evaluation of a trained run."""
    return [(e["step"] * run.tokens_per_step, e["ppl"]) for e in events(run, "valid")]


def curve_folder(run: StudyRun) -> Path:
    """Where the metrics of the training whose best.pt the test read are: the re-train's folder where the run was
    trained again (its first checkpoint gone, study.retrain), else the run's results."""
    return run.retrained if run.retrained.is_dir() else run.results


def last_quarter(run: StudyRun, folder: Path | None = None) -> float | None:
    """(p(¾T) − p(T)) / p(¾T) of valid perplexity p (module docstring) on the curve in `folder` (the run's results by
    default); None without an evaluation by ¾T."""
    valid = {e["step"]: e["ppl"] for e in events(run, "valid", folder)}
    early = [s for s in valid if s <= 0.75 * run.steps]
    if not early or run.steps not in valid:
        return None
    return (valid[max(early)] - valid[run.steps]) / valid[max(early)]


def seed_values(study: Study, cell: str, factor: float | None = None, metric: str = "ppl") -> dict[int, float]:
    """{seed: test perplexity} (metric "usage": the first memory layer's test usage %) of the cell's runs that are
    evaluated: at its chosen factor (a diverged seed's re-run in its place, study_plan.Study.chosen_runs), or, with
    `factor`, at that factor."""
    runs = study.chosen_runs(cell) if factor is None else [study.run(cell, factor, s) for s in study.seeds]
    values = {r.seed: metric_value(json.loads((r.results / "test.json").read_text()), metric) for r in runs if r.tested}
    return {seed: value for seed, value in values.items() if value is not None}


def metric_value(test: dict, metric: str) -> float | None:
    """A test.json's perplexity, or (metric "usage") its first memory layer's usage % (None: no memory)."""
    if metric == "ppl":
        return test["ppl"]
    return min(test["memories"], key=lambda m: m["layer"])["usage"] if test.get("memories") else None


def diverged_text(study: Study, cell: str) -> str:
    """Each run the divergence rule replaced: "seed 1 ×8 (test 74.8; best valid 73.4 > 1.2 × seed 0's 58.9) ->
    ×5.66 (not trained)"; "·" for none."""
    parts = []
    for seed, chain in study.seed_runs(cell).items():
        for run, later in zip(chain, chain[1:]):
            test = f"test {seed_values(study, cell, run.factor)[seed]:.1f}; " if run.tested else ""
            state = f"test {seed_values(study, cell, later.factor)[seed]:.1f}" if later.tested else \
                "trained, not tested" if later.trained else "not trained"
            parts.append(f"seed {seed} ×{run.factor:.3g} ({test}{study.diverged(run)}) -> ×{later.factor:.3g} "
                         f"({state})")
    return "; ".join(parts) or "·"


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
        f"`{run.cell}`), validated every {study.eval_every_tokens:,} tokens; seeds {', '.join(map(str, study.seeds))}. "
        f"Every test perplexity is read on " + (f"the first {study.test_max_batches:,} batches of the test split "
                                                f"(`test_max_batches`)." if study.test_max_batches else
                                                "the whole test split."),
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
           if study.lr_refine else "")
        + " The test split is read only once every cell's settings are final."
        + (f" **Divergence rule** (declared: ratio {study.diverge_ratio:g}): a run diverged when a valid perplexity "
           f"is not finite, its last valid perplexity is above {study.diverge_ratio:g}× its lowest, or (a seed "
           f"other than {study.seeds[0]}) its lowest is above {study.diverge_ratio:g}× seed {study.seeds[0]}'s at "
           f"the same factor; such a seed is run again at the next lower factor of its cell's grid, which is "
           f"tested and compared, and the cells' table names both." if study.diverge_ratio else ""),
        f"**Comparisons.** Each claim says that cell a has a lower test perplexity than cell b (or, marked usage %, "
        f"a lower test usage of its first memory layer). Seeds pair the runs "
        f"(same seed: same data order), so the numbers are the per-seed differences a − b: their mean, its 95% "
        f"interval (Student t with n − 1 degrees of freedom) and the sign on every seed (− where a is lower, as "
        f"claimed). Over the {m} comparison(s) of this report, Holm's correction: the adjusted p-value of the i-th "
        f"smallest p is max over j ≤ i of min(1, (m − j + 1) p_(j)); the adjusted interval is the t interval at "
        f"level 1 − {ALPHA:g} / (m − min(i, s) + 1), s the first rank Holm does not reject, so that it excludes 0 "
        f"exactly when Holm rejects. The verdict follows from the adjusted interval: **{HOLDS}** when it lies below "
        f"0 (as claimed), **{REVERSED}** when above 0, **{INCONCLUSIVE}** when it contains 0. Seeds needed: the "
        f"number of seeds n at which the 95% interval, and the interval at Holm's strictest level 1 − {ALPHA:g}/{m} "
        f"(where Holm rejects whatever the other comparisons), would exclude 0 if the mean and sd of the "
        f"differences stayed as observed: t_{{(1+c)/2, n−1}} · sd / √n < |mean|. The mean and sd come from these "
        f"few seeds: a rough figure, not a probability of deciding. Robustness: the claim again with a, then b, at "
        f"its cell's next lower factor (the other at its choice), judged at the claim's Holm level, where every "
        f"seed there is tested" + (" (the study runs them)" if study.robustness else " (runs the study did not ask "
                                   "for: mostly not run)") + ".",
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
            rows.append([f"`{cell}`", f"`{config}`", *["·"] * (12 if study.diverge_ratio else 11)])
            continue
        cfg = load_config(runs[0].results / "config.yaml")
        size = model_size(cfg, cfg.data.bptt)
        test = seed_values(study, cell)
        quarter = [q for q in (last_quarter(r, curve_folder(r)) for r in runs) if q is not None]
        diverged = [diverged_text(study, cell)] if study.diverge_ratio else []
        speed = [e["tokens_per_sec"] for r in runs for e in events(r, "train") if e["step"] > 1]
        rows.append([f"`{cell}`", f"`{config}`", Measure(tuple(test.values())).text() if test else "·",
                     f"{len(test)}/{len(study.seeds)}", memory_use(study, cell), count_text(size["total"]),
                     count_text(size["active"]),
                     f"{size['flops'] / 1e6:.2f}M", f"{statistics.median(speed):,.0f}" if speed else "·",
                     f"{speeds[cell]:,.0f}" if cell in speeds else "·",
                     f"{runs[0].steps * runs[0].tokens_per_step:,}",
                     f"{100 * statistics.mean(quarter):.1f}" if quarter else "·", str(len(runs)), *diverged])
    return _md_table(["cell", "config", "test ppl (mean ± sd)", "seeds tested", "memory usage %/KL (test)", "params",
                      "active params",
                      "train FLOPs/token", "logged train tokens/s", "benchmark tokens/s", "tokens",
                      "last-quarter improvement %",
                      "runs", *(["diverged (the rule) -> re-run"] if study.diverge_ratio else [])], rows)


def seeds_needed(pair: Paired, m: int) -> str:
    """"n95 / nHolm": the seeds at which the 95% interval, and the interval at Holm's strictest level
    1 − α/m, would exclude 0 at the observed mean and sd (paired.Paired.seeds_needed; "·": no estimate)."""
    return " / ".join("·" if n is None else str(n) for n in (pair.seeds_needed(), pair.seeds_needed(1 - ALPHA / m)))


def robustness(study: Study, c: Comparison, tests: dict[str, dict[int, float]], level: float) -> str:
    """The claim a < b again with a, then b, at its cell's next lower factor (the other at its choice): the mean
    and the verdict of the interval at `level` (the claim's Holm level), over the seeds tested there."""
    parts, a, b = [], c.a, c.b
    for cell in (a, b):
        factor = study.neighbour(cell)
        if factor is None:
            parts.append(f"`{cell}` lower: none in its grid")
            continue
        there = seed_values(study, cell, factor, c.metric)
        if len(there) < len(study.seeds):
            parts.append(f"`{cell}` ×{factor:.3g}: not run ({len(there)} of {len(study.seeds)} seeds tested)")
            continue
        pair = paired(there, tests[b]) if cell == a else paired(tests[a], there)
        if pair.n < 2:
            parts.append(f"`{cell}` ×{factor:.3g}: fewer than 2 paired seeds")
            continue
        lo, hi = pair.interval(level)
        verdict = HOLDS if hi < 0 else REVERSED if lo > 0 else INCONCLUSIVE
        parts.append(f"`{cell}` ×{factor:.3g}: {pair.mean:+.2f}, **{verdict}**")
    return "; ".join(parts)


def comparison_table(study: Study) -> str:
    tests = {(cell, metric): seed_values(study, cell, metric=metric) for cell in study.cells for metric in METRICS}
    pairs = [paired(tests[c.a, c.metric], tests[c.b, c.metric]) for c in study.comparisons]
    adjusted = holm(pairs)
    factors = {cell: ({r.seed: r.factor for r in study.chosen_runs(cell)}, study.choice(cell)) for cell in study.cells}

    def rerun(cell: str, seed: int) -> str:  # the factor of a seed's divergence re-run, "" at the choice
        by_seed, choice = factors[cell]
        return "" if by_seed[seed] == choice.factor else f" (`{cell}` ×{by_seed[seed]:.3g})"

    rows = []
    for c, pair, adj in zip(study.comparisons, pairs, adjusted):
        seeds = ", ".join(f"{s}: {d:+.2f}{rerun(c.a, s)}{rerun(c.b, s)}" for s, d in zip(pair.seeds, pair.diffs))
        what = f"`{c.a}` − `{c.b}`" + ("" if c.metric == "ppl" else f" ({c.metric} %)")
        if pair.n < 2:
            rows.append([c.claim, what, seeds or "·", pair.signs() or "·", "·", "·", "·", "·",
                         f"{INCONCLUSIVE} (fewer than 2 paired seeds)", "·", "·"])
            continue
        lo, hi = pair.interval()
        (alo, ahi), level = adj.interval, adj.level
        rows.append([c.claim, what, seeds, pair.signs(), f"{pair.mean:+.2f}",
                     f"[{lo:+.2f}, {hi:+.2f}]", f"[{alo:+.2f}, {ahi:+.2f}] at {100 * level:.2f}%", f"{adj.p:.3g}",
                     f"**{adj.verdict}**", seeds_needed(pair, len(pairs)),
                     robustness(study, c, {cell: tests[cell, c.metric] for cell in study.cells}, level)])
    return _md_table(["claim", "difference", "per seed", "signs", "mean", "95% interval", "Holm-adjusted interval",
                      "Holm p", "verdict", "seeds needed (95% / Holm's strictest)",
                      "at the next lower lr (a, then b, moved; at the Holm level)"], rows)


def change_text(first: float, second: float) -> str:
    """second's relative change from first, in % with its sign (+0.00% for none)."""
    return f"{round(100 * (second / first - 1), 2) + 0.0:+.2f}%"


def retrained_table(study: Study) -> str:
    """The runs trained again because their checkpoint was gone (study.retrain): the first run's best valid
    perplexity (which the lr choice read), the second's (whose checkpoint the test read), their change."""
    rows = []
    for cell in study.cells:
        for r in study.known_runs(cell):
            if r.retrained.is_dir():
                first, second = r.valid_ppl(), r.valid_ppl(r.retrained)
                rows.append([f"`{cell}`", r.id, f"{first:.2f}", f"{second:.2f}", change_text(first, second)])
    return _md_table(["cell", "run", "best valid ppl, first run", "trained again", "change"], rows) if rows else ""


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
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """The figure as a PNG at `path`, written whole or not at all (a failed write: one OutputError line, the previous
    file kept)."""
    plt = _pyplot()
    try:
        fig.tight_layout()
        with atomic_file(path) as f:
            fig.savefig(f, format="png", dpi=110)
    except OSError as e:  # a write that went around the file object (atomic_file turns the others into OutputError)
        raise write_error(path, e) from None
    finally:
        plt.close(fig)
    return path


def write_report(study: Study, benches: list[dict] = ()) -> Path:
    """report.md and learning_curves.png at study.report; `benches`: benchmark JSON with rows {cell, tokens_per_s}."""
    if not any(r.trained for cell in study.cells for r in study.grid_runs(cell)):
        raise StudyError(f"{study.path}: no run of the study is trained yet in {study.results}: nothing to report")
    study.refuse_stale_tests()
    out = study.report
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {out.parent} for the report: {e.strerror or e}") from None
    figure = plot_curves(study, out.parent / "learning_curves.png")
    missing = [cell for cell in study.cells if len(seed_values(study, cell)) < len(study.seeds)]
    still = study.open_cells()
    parts = [
        header(study, len(study.comparisons)),
        "## Learning rates chosen on validation\n\n"
        f"Valid perplexity of seed {study.seeds[0]} at each factor of the grid (· not trained yet).\n\n"
        + choice_table(study),
        "## Cells at their chosen learning rates\n\n" + cell_table(study, bench_rows(benches)),
        *([f"![learning curves]({figure.name})"] if figure else []),
        *(["## Comparisons\n\n" + comparison_table(study)] if study.comparisons else []),
        *(["## Runs trained again\n\nTheir checkpoint was gone from the dump, so the study trained them again by "
           "the same command (same seed) before reading their test split. The lr choice read the first run; the "
           "test, the second.\n\n" + again] if (again := retrained_table(study)) else []),
        *([f"Not finished yet: {', '.join(f'`{c}`' for c in missing)}."] if missing else []),
        *(["Settings not final, so no new test read yet: "
           + "; ".join(f"`{c}` ({why})" for c, why in still.items()) + "."] if still else []),
    ]
    write_text(out, "\n\n".join(parts) + "\n")
    return out
