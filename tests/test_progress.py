"""Progress for the person waiting: train lines from step 1 with step/total and an ETA, periodic
evaluation lines."""

import itertools

import pytest
from conftest import read_events

from xlm_pkm.utils.progress import Progress, format_duration


@pytest.mark.parametrize("seconds, text", [(7.4, "7s"), (60, "1m00s"), (125, "2m05s"), (3725, "1h02m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_progress_prints_done_total_and_eta_then_stays_silent_at_the_end(capsys, monkeypatch):
    clock = itertools.count(0.0, 10.0)
    monkeypatch.setattr("xlm_pkm.utils.progress.perf_counter", lambda: next(clock))
    progress = Progress("evaluating valid", total=4, every=5.0)  # started at t = 0
    progress.update(1)  # t = 10: 10 s per batch, 3 to go
    progress.update(4)  # t = 20: done, no line
    assert capsys.readouterr().err == "evaluating valid: 1/4 batches (25%), ETA 30s\n"
    Progress("off", total=4, enabled=False).update(1)
    assert capsys.readouterr().err == ""


def test_train_lines_start_at_step_1_with_total_and_eta(reference_run, capsys):
    run = reference_run("train.log_every=3")
    events = read_events(run.run_dir)
    steps = [e["step"] for e in events]
    assert steps[:2] == [1, 3] and steps[-1] == run.cfg.train.max_steps
    assert all(e["eta_s"] >= 0 for e in events) and events[-1]["eta_s"] == 0
    log = (run.run_dir / "train.log").read_text()
    assert f"train step 1/{run.cfg.train.max_steps} (" in log and "ETA " in log
    assert ", 1 CPU thread(s)) loss=" in log  # TINY: train.num_threads=1; several runs side by side: see it
