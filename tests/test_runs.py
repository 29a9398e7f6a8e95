"""python -m xlm_pkm.runs: `list` and `compare` on a folder of tiny runs (two designs, two seeds each, and a run
stopped before its end), checked against the runs' own metrics.jsonl and test results."""

import csv
import io
import json
import re
import shutil
import statistics

import pytest

from xlm_pkm.launch.cli import evaluate_main, train_main
from xlm_pkm.runs.__main__ import main as runs_main

DESIGNS = {"pkm": [], "dense": ["model.mem_layers=[]", "model.n_memories=0"]}


@pytest.fixture(scope="module")
def dump(tiny_overrides, tmp_path_factory):
    """dump/two/{pkm,dense}-seed{0,1}: trained to the end with their test result (pkm's also as test.json, from
    evaluate.py); dump/other/cut: stopped at step 4 (of 8)."""
    import contextlib
    import signal

    from xlm_pkm.train.trainer import Trainer

    root = tmp_path_factory.mktemp("runs")
    with contextlib.redirect_stdout(io.StringIO()):
        for design, extra in DESIGNS.items():
            for seed in (0, 1):
                run = f"{design}-seed{seed}"
                assert train_main(tiny_overrides(root, "train.exp_name=two", f"train.exp_id={run}",
                                                 f"train.seed={seed}", *extra)) == 0
                if design == "pkm":
                    assert evaluate_main(["--checkpoint", str(root / "two" / run / "best.pt"), "--split", "test",
                                          "--json", str(root / "two" / run / "test.json")]) == 0
        step = Trainer.train_step

        def stop_at_4(self, batches):
            out = step(self, batches)
            if self.step == 4:
                signal.raise_signal(signal.SIGUSR2)
            return out

        Trainer.train_step = stop_at_4
        try:
            assert train_main(["--no-test", *tiny_overrides(root, "train.exp_name=other", "train.exp_id=cut")]) == 75
        finally:
            Trainer.train_step = step
    return root


def events(run_dir, name):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == name]


def result_of(run_dir) -> dict:
    path = run_dir / "test.json"
    return json.loads(path.read_text()) if path.is_file() else events(run_dir, "test")[-1]


def table(capsys, *argv) -> list[dict]:
    assert runs_main([*argv, "--format", "csv"]) == 0
    return list(csv.DictReader(io.StringIO(capsys.readouterr().out)))


def test_list_gives_each_runs_status_step_perplexities_and_launch_keys(dump, capsys):
    rows = {row["id"]: row for row in table(capsys, "list", str(dump))}
    assert sorted(rows) == ["other/cut", "two/dense-seed0", "two/dense-seed1", "two/pkm-seed0", "two/pkm-seed1"]
    cut = rows["other/cut"]
    assert (cut["status"], cut["step"], cut["test ppl"]) == ("stopped", "4", "")
    for name in ("dense-seed0", "pkm-seed1"):
        row, run_dir = rows[f"two/{name}"], dump / "two" / name
        assert (row["status"], row["step"]) == ("finished", "8")
        assert float(row["best valid ppl"]) == min(e["ppl"] for e in events(run_dir, "valid"))
        assert float(row["test ppl"]) == result_of(run_dir)["ppl"]
        launched = row["launched with (keys that differ from default)"].split()
        assert "model.dim=32" in launched and ("model.n_memories=0" in launched) == name.startswith("dense")
        assert ("train.seed=1" in launched) == name.endswith("1")  # seed 0 is the default's
    assert runs_main(["list", str(dump / "two" / "pkm-seed0")]) == 0  # markdown: one run
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| id | status | step | best valid ppl | test ppl |") and len(out) == 3
    assert out[2].startswith("| two/pkm-seed0 | finished | 8 | ")


def test_a_run_held_by_a_live_process_is_running_and_one_without_a_checkpoint_failed(dump, tmp_path, capsys):
    from xlm_pkm.train.run_dir import lock_run_directory

    dead = tmp_path / "other" / "dead"  # died before its first checkpoint: its config and log only
    dead.mkdir(parents=True)
    for name in ("config.yaml", "train.log"):
        (dead / name).write_text((dump / "other" / "cut" / name).read_text())
    held = lock_run_directory(dump / "other" / "cut")
    try:
        rows = {row["id"]: row for row in table(capsys, "list", str(dump / "other"), str(dead))}
    finally:
        held.release()
    assert (rows["other/cut"]["status"], rows["other/dead"]["status"], rows["other/dead"]["step"]) == (
        "running", "failed", "0")


def test_compare_gives_a_row_per_design_with_mean_and_sd_over_its_seeds(dump, capsys):
    rows = table(capsys, "compare", str(dump / "two"))
    assert [row["runs"] for row in rows] == ["two/dense-seed0 two/dense-seed1", "two/pkm-seed0 two/pkm-seed1"]
    assert [(row["model.n_memories"], row["model.mem_layers"]) for row in rows] == [("0", "[]"), ("1", "[2]")]
    assert [row["seeds"] for row in rows] == ["0 1"] * 2
    dense, pkm = rows
    assert int(pkm["params"]) > int(pkm["active params"]) and dense["params"] == dense["active params"]
    for row in rows:
        dirs = [dump / name for name in row["runs"].split()]
        valid = [min(e["ppl"] for e in events(d, "valid")) for d in dirs]
        test = [result_of(d)["ppl"] for d in dirs]
        speed = [statistics.median(e["tokens_per_sec"] for e in events(d, "train") if e["step"] > 1) for d in dirs]
        assert float(row["valid ppl"]) == pytest.approx(statistics.mean(valid))
        assert float(row["valid ppl sd"]) == pytest.approx(statistics.stdev(valid))
        assert float(row["test ppl"]) == pytest.approx(statistics.mean(test))
        assert float(row["test ppl sd"]) == pytest.approx(statistics.stdev(test))
        assert float(row["tokens/s"]) == pytest.approx(statistics.mean(speed))
    usage = [result_of(dump / name)["memories"][0]["usage"] for name in pkm["runs"].split()]
    assert float(pkm["usage % L2"]) == pytest.approx(statistics.mean(usage)) and dense["usage % L2"] == ""
    by_seed = table(capsys, "compare", str(dump / "two"), "--by", "train.seed")
    assert [(row["train.seed"], row["runs"]) for row in by_seed] == [
        ("0", "two/dense-seed0 two/pkm-seed0"), ("1", "two/dense-seed1 two/pkm-seed1")]


def test_a_path_that_is_not_a_run_or_a_key_that_is_not_a_key_is_one_line(dump, tmp_path, capsys):
    assert runs_main(["compare", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.endswith("not a run directory (no config.yaml and metrics.jsonl) nor a folder "
                                            "holding runs\n")
    assert runs_main(["compare", str(dump / "two"), "--by", "model.dimm"]) == 2
    assert "--by model.dimm: not a config key of these runs" in capsys.readouterr().err


def test_compare_counts_the_model_as_trained(dump, capsys):
    """Issue 62/63: the parameters were counted with a 1,000-word vocabulary (53.0k shown for a model of 281,248);
    the run's resolved config has its data's vocabulary size: the count is the one train.log printed."""
    rows = table(capsys, "compare", str(dump / "two"))
    for row in rows:
        log = (dump / row["runs"].split()[0] / "train.log").read_text()
        total = int(re.search(r"parameters: total ([\d,]+)", log).group(1).replace(",", ""))
        assert int(row["params"]) == total


def test_a_valid_result_written_as_test_json_is_not_shown_as_test_perplexity(dump, tmp_path, capsys):
    """`evaluate.py --split valid --json RUN/test.json` put a valid-split figure in the test ppl column."""
    run = tmp_path / "copy" / "dense-seed0"
    shutil.copytree(dump / "two" / "dense-seed0", run)
    assert evaluate_main(["--checkpoint", str(run / "best.pt"), "--split", "valid", "--json", str(run / "test.json"),
                          "--max-batches", "1"]) == 0
    capsys.readouterr()
    (row,) = table(capsys, "list", str(run))
    valid = json.loads((run / "test.json").read_text())["ppl"]
    assert float(row["test ppl"]) == events(run, "test")[-1]["ppl"] != valid


def test_an_unreadable_run_is_listed_as_such_and_the_others_go_on(dump, tmp_path, capsys):
    """One bad run aborted the listing: a truncated metrics.jsonl gave 'Expecting value: line 1 column 505' with no
    file name, a config.yaml that is not YAML a traceback. The listing shows that run as unreadable, naming the file;
    compare leaves it out, saying so."""
    for name in ("pkm-seed0", "pkm-seed1", "dense-seed0"):
        shutil.copytree(dump / "two" / name, tmp_path / "two" / name)
    metrics = tmp_path / "two" / "pkm-seed0" / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-30])
    config = tmp_path / "two" / "pkm-seed1" / "config.yaml"
    config.write_text("model: [dim: 3\n")
    rows = {row["id"]: row for row in table(capsys, "list", str(tmp_path))}
    assert [rows[f"two/{n}"]["status"] for n in ("pkm-seed0", "pkm-seed1", "dense-seed0")] == [
        "unreadable", "unreadable", "finished"]
    why = "launched with (keys that differ from default)"
    assert rows["two/pkm-seed0"][why].startswith(f"{metrics}:") and "not a JSON line" in rows["two/pkm-seed0"][why]
    assert rows["two/pkm-seed1"][why].startswith(f"{config}: not valid YAML")
    assert runs_main(["compare", str(tmp_path), "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert [row["runs"] for row in csv.DictReader(io.StringIO(out))] == ["two/dense-seed0"]
    assert err.splitlines()[0].startswith(f"python -m xlm_pkm.runs: two/pkm-seed0 left out: {metrics}:")
    assert len(err.splitlines()) == 2


def test_runs_below_a_folder_are_named_by_their_path_below_it(dump, tmp_path, capsys):
    """`runs list dumped` showed a study's runs (dumped/study/<study>/<cell>/<run>) as <cell>/<run>."""
    shutil.copytree(dump / "two" / "pkm-seed0", tmp_path / "study" / "mine" / "pkm" / "lr1-seed0")
    shutil.copytree(dump / "two" / "dense-seed0", tmp_path / "two" / "dense-seed0")
    assert [row["id"] for row in table(capsys, "list", str(tmp_path))] == ["study/mine/pkm/lr1-seed0",
                                                                           "two/dense-seed0"]
    assert [row["id"] for row in table(capsys, "list", str(tmp_path / "study" / "mine"))] == ["pkm/lr1-seed0"]
