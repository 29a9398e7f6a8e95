"""The study's 12 declared claims (study.yaml) judged on the old 400-step runs (runs/, lr 1e-3), as the study report
judges them on its own runs: per-seed test differences a − b, Holm over the 12. Writes old_verdicts.md beside it.

    .venv/bin/python results/tiny/old_verdicts.py
"""

import json
from pathlib import Path

from xlm_pkm.experiments.paired import holm, paired
from xlm_pkm.experiments.report import _md_table
from xlm_pkm.experiments.study_plan import load_study
from xlm_pkm.experiments.study_report import metric_value

HERE = Path(__file__).resolve().parent


def old_values(cell: str, metric: str) -> dict[int, float]:
    """{seed: test perplexity, or the first memory layer's test usage %} of runs/<cell>/tiny-seed<S>/test.json."""
    values = {}
    for path in sorted((HERE / "runs" / cell).glob("tiny-seed*/test.json")):
        values[int(path.parent.name.removeprefix("tiny-seed"))] = metric_value(json.loads(path.read_text()), metric)
    return values


def main() -> None:
    study = load_study(HERE / "study.yaml")
    pairs = [paired(old_values(c.a, c.metric), old_values(c.b, c.metric)) for c in study.comparisons]
    rows = []
    for c, pair, adj in zip(study.comparisons, pairs, holm(pairs)):
        (lo, hi), level = adj.interval, adj.level
        rows.append([c.claim, f"`{c.a}` − `{c.b}`" + ("" if c.metric == "ppl" else " (usage %)"),
                     ", ".join(f"{d:+.2f}" for d in pair.diffs), f"{pair.mean:+.2f}",
                     f"[{lo:+.2f}, {hi:+.2f}] at {100 * level:.2f}%", f"{adj.p:.3g}", f"**{adj.verdict}**"])
    table = _md_table(["claim", "difference", "per seed (0, 1, 2)", "mean", "Holm-adjusted interval", "Holm p",
                       "verdict"], rows)
    (HERE / "old_verdicts.md").write_text(
        "# The study's 12 claims on the old runs (400 steps, lr 1e-3 untuned)\n\n"
        "Made by `.venv/bin/python results/tiny/old_verdicts.py` from `runs/*/tiny-seed*/test.json`: the claims of "
        "`study.yaml`, judged as `study_report.md` judges them (per-seed differences of test perplexity, or of the "
        "first memory layer's test usage %, Holm over these 12).\n\n" + table + "\n")


if __name__ == "__main__":
    main()
