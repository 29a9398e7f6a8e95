"""The study's 12 declared claims (study.yaml) judged on the old 400-step runs (runs/, lr 1e-3) and on the study's
runs (study_runs/, each cell at its lr chosen on validation), the same way: per-seed test differences a − b, Holm
over the 12 (as study/report.md judges them). Writes side_by_side.md beside it: the old verdicts in full, then
old and new side by side (the new "·" where fewer than 2 seeds are tested).

    .venv/bin/python results/tiny/side_by_side.py
"""

import json
from pathlib import Path

from xlm_pkm.experiments.paired import Holm, Paired, holm, paired
from xlm_pkm.experiments.report import _md_table
from xlm_pkm.experiments.study_plan import load_study
from xlm_pkm.experiments.study_report import metric_value, seed_values

HERE = Path(__file__).resolve().parent


def old_values(cell: str, metric: str) -> dict[int, float]:
    """{seed: test perplexity, or the first memory layer's test usage %} of runs/<cell>/tiny-seed<S>/test.json."""
    values = {}
    for path in sorted((HERE / "runs" / cell).glob("tiny-seed*/test.json")):
        values[int(path.parent.name.removeprefix("tiny-seed"))] = metric_value(json.loads(path.read_text()), metric)
    return values


def judged(pair: Paired, adj: Holm) -> list[str]:
    """mean, Holm-adjusted interval and its level, verdict ("·" below 2 paired seeds)."""
    if pair.n < 2:
        return ["·", "·", "·"]
    (lo, hi), level = adj.interval, adj.level
    return [f"{pair.mean:+.2f}", f"[{lo:+.2f}, {hi:+.2f}] at {100 * level:.2f}%", f"**{adj.verdict}**"]


def main() -> None:
    study = load_study(HERE / "study.yaml")
    old = [paired(old_values(c.a, c.metric), old_values(c.b, c.metric)) for c in study.comparisons]
    new = [paired(seed_values(study, c.a, metric=c.metric), seed_values(study, c.b, metric=c.metric))
           for c in study.comparisons]
    rows, both = [], []
    for c, pair, adj, new_pair, new_adj in zip(study.comparisons, old, holm(old), new, holm(new)):
        what = f"`{c.a}` − `{c.b}`" + ("" if c.metric == "ppl" else " (usage %)")
        mean, interval, verdict = judged(pair, adj)
        rows.append([c.claim, what, ", ".join(f"{d:+.2f}" for d in pair.diffs), mean, interval, f"{adj.p:.3g}",
                     verdict])
        both.append([c.claim, what, mean, interval, verdict, *judged(new_pair, new_adj)])
    tested = sum(r.tested for cell in study.cells for r in study.chosen_runs(cell))
    chosen = sum(len(study.chosen_runs(cell)) for cell in study.cells)
    (HERE / "side_by_side.md").write_text(
        "# The study's 12 claims, old runs and new\n\n"
        "Made by `.venv/bin/python results/tiny/side_by_side.py`: the claims of `study.yaml`, judged as "
        "`study/report.md` judges them (per-seed differences of test perplexity, or of the first memory layer's "
        "test usage %, Holm over these 12), on the old runs (`runs/*/tiny-seed*/test.json`: 400 steps, lr 1e-3 "
        "untuned) and on the study's (`study_runs/`: 1,600 steps, each cell at its lr chosen on validation; "
        f"{tested} of its {chosen} chosen runs tested when this was made).\n\n"
        "## The old runs\n\n"
        + _md_table(["claim", "difference", "per seed (0, 1, 2)", "mean", "Holm-adjusted interval", "Holm p",
                     "verdict"], rows)
        + "\n\n## Old and new side by side\n\n"
        + _md_table(["claim", "difference", "old mean", "old Holm-adjusted interval", "old verdict", "new mean",
                     "new Holm-adjusted interval", "new verdict"], both) + "\n")


if __name__ == "__main__":
    main()
