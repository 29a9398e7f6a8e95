"""Issue 84: the study report's last-quarter improvement is read on the curve of the training the test read, the
re-train's where a run was trained again (its first checkpoint gone), on the committed results/tiny study."""
from pathlib import Path

import pytest

from xlm_pkm.experiments.study_plan import load_study
from xlm_pkm.experiments.study_report import curve_folder, last_quarter

ROOT = Path(__file__).resolve().parents[1]


def test_a_retrained_runs_last_quarter_is_its_retrains():
    study = load_study(ROOT / "results" / "tiny" / "study.yaml")
    run = study.run("l12_d1024_m1", 8.0, 0)  # trained again before its test (results/tiny/study/report.md)
    assert curve_folder(run) == run.retrained and run.retrained.is_dir()
    first, second = last_quarter(run), last_quarter(run, curve_folder(run))
    assert second != pytest.approx(first)  # two trainings, two curves: the report gives the tested one's
    untouched = study.run("figure6_heads1_knn32", 8.0, 0)  # never trained again
    assert curve_folder(untouched) == untouched.results
