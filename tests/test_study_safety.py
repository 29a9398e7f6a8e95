"""The study harness's accidents (issue 83): a cell name that is a path, a cell named twice in the study file, a
test read under other settings than the study's now, a report written on a full disk."""

import json
import re
from contextlib import contextmanager

import pytest

from tests.test_study import fake_dump, fake_trained, write_study
from xlm_pkm.experiments import study as study_cli
from xlm_pkm.experiments.study import TEST, run_study
from xlm_pkm.experiments.study_plan import StudyError, load_study
from xlm_pkm.experiments.study_report import seed_values, write_report
from xlm_pkm.utils.atomic import OutputError


def one_line_error(capsys, path) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"study: error: {path}: ") and err.count("\n") == 1, err
    return err


# 3. a cell name is one folder name: a path would train into, and write its small files, outside dump and results

@pytest.mark.parametrize("name, why", [
    ("a/../../x", "no / or \\: a name, not a path"), ("..", "not . or .."), (".", "not . or .."),
    ("", "it is empty"), ("a\\b", "no / or \\"), ("a\0b", "NUL"), ("\ud800", "not valid UTF-8"),
    ("x" * 256, "256 bytes in UTF-8"), ("é" * 128, "256 bytes in UTF-8"),
], ids=["climbs-out", "dotdot", "dot", "empty", "backslash", "nul", "surrogate", "256-ascii", "256-bytes-of-e-acute"])
def test_a_cell_name_that_is_not_one_folder_name_is_refused_before_anything_is_written(tmp_path, capsys, name, why):
    path = write_study(tmp_path, cells={name: {"config": "configs/default.yaml"}}, comparisons=[])
    with pytest.raises(StudyError) as refused:
        load_study(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: cells: cell name: must be one file or folder name") and why in message
    assert repr(name)[:20] in message and "\n" not in message
    for command in ("plan", "run", "report"):
        assert study_cli.main([command, str(path)]) == 2
        one_line_error(capsys, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]  # no dump, results or report folder
    assert not (tmp_path.parent / "x").exists()


def test_a_cell_name_of_one_folder_loads_and_the_study_name_is_checked_where_it_names_the_dump(tmp_path):
    cells = {"pkm-2 (é)": {"config": "configs/default.yaml"}, "y" * 255: {"config": "configs/default.yaml"}}
    study = load_study(write_study(tmp_path, cells=cells, comparisons=[]))
    assert study.run("pkm-2 (é)", 1, 0).results == tmp_path / "results" / "pkm-2 (é)" / "lr1-seed0"
    with pytest.raises(StudyError, match=r": name: one folder name .* not '\.\./x'"):
        load_study(write_study(tmp_path, name="../x", dump=None))  # the default dump: dumped/study/<name>
    assert load_study(write_study(tmp_path, name="../x")).name == "../x"  # a dump given: the name is a title only


# 6. a key given twice: PyYAML keeps the last one without a word

STUDY = """\
name: tiny
tokens: 512
eval_every_tokens: 128
seeds: [0, 1]
lr_grid: [1]
dump: {dump}
results: {results}
cells:
  pkm: {{config: configs/default.yaml}}
  dense: {{config: configs/default.yaml, set: [model.n_memories=0, "model.mem_layers=[]"]}}
"""


@pytest.mark.parametrize("extra, message", [
    ("  pkm: {config: configs/default.yaml, set: [model.dim=48]}\n",
     "cell 'pkm' is given twice (lines 9 and 11)"),
    ("tokens: 1024\n", "key tokens is given twice (lines 2 and 11)"),
    ("  big:\n    config: configs/default.yaml\n    config: configs/tiny.yaml\n",
     "key cells.big.config is given twice (lines 12 and 13)"),
], ids=["a-cell", "a-top-level-key", "a-key-of-a-cell"])
def test_a_key_given_twice_in_the_study_file_is_one_line_naming_it_and_its_lines(tmp_path, capsys, extra, message):
    path = tmp_path / "study.yaml"
    path.write_text(STUDY.format(dump=tmp_path / "dump", results=tmp_path / "results") + extra)
    with pytest.raises(StudyError, match="^" + re.escape(f"{path}: {message}; YAML would keep the last one only")):
        load_study(path)
    assert study_cli.main(["run", str(path)]) == 2
    assert message in one_line_error(capsys, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]
    path.write_text(STUDY.format(dump=tmp_path / "dump", results=tmp_path / "results"))
    assert list(load_study(path).cells) == ["pkm", "dense"]  # each once: as before


# 5. a test read with another test_max_batches than the study's now

def test_a_test_read_with_another_test_max_batches_is_read_again_by_run_and_refused_by_report(tmp_path, capsys):
    """Issue 83: after `test_max_batches: 4 -> 0` the tests read before stayed, a new seed was tested on the whole
    split, and the report averaged the two. A test counts only with the study's setting now: `plan` shows the
    others stale, `report` refuses them in one line, `run` reads them again."""
    path = write_study(tmp_path, lr_grid=[1], seeds=[0, 1], test_max_batches=4)
    study = load_study(path)
    for cell in study.cells:
        for seed in study.seeds:
            fake_trained(study.run(cell, 1, seed), [30.0, 20.0])
            fake_dump(study.run(cell, 1, seed))
    launched = []

    def launch(job):  # the test of a model reads 100 on 4 batches, 120 on the whole split
        assert job.kind == TEST
        whole = "--max-batches" not in job.run.evaluate_command()
        launched.append((job.run.cell, job.run.seed, whole))
        (job.run.run.run_dir / "test.json").write_text(json.dumps({"ppl": 120.0 if whole else 100.0}))
        return 0

    assert run_study(study, 1, launch) == 0 and len(launched) == 4
    pkm = study.run("pkm", 1, 0)
    assert json.loads((pkm.results / "test.json").read_text()) == {"ppl": 100.0, "max_batches": 4}
    assert pkm.tested and not study.stale_tests()

    # the setting changes and a seed joins: the 4 tests read on 4 batches are stale, the new seed is not tested
    path = write_study(tmp_path, lr_grid=[1], seeds=[0, 1, 2], test_max_batches=0)
    study = load_study(path)
    for cell in study.cells:
        fake_trained(study.run(cell, 1, 2), [30.0, 20.0])
        fake_dump(study.run(cell, 1, 2))
    pkm = study.run("pkm", 1, 0)
    assert [(r.cell, r.seed, read) for r, read in study.stale_tests()] == [
        ("pkm", 0, 4), ("pkm", 1, 4), ("dense", 0, 4), ("dense", 1, 4)]
    assert not pkm.tested and seed_values(study, "pkm") == {}  # nothing counts a stale test
    assert study_cli.main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  lr1-seed0 [trained, test stale] " in out
    assert "its test was read with test_max_batches 4, the study's is 0 now: `run` reads it again" in out
    assert study_cli.main(["report", str(path)]) == 2
    err = one_line_error(capsys, path)
    assert "4 test result(s) were read with another test_max_batches than the study's 0 now: " in err
    assert "`study run` reads them again with the study's setting (or restore test_max_batches: 4)" in err
    assert not (tmp_path / "out").exists()  # no report

    launched.clear()
    assert run_study(study, 1, launch) == 0
    assert sorted(launched) == sorted((c, s, True) for c in study.cells for s in study.seeds)  # all on the whole split
    assert "pkm/lr1-seed0 test: its test.json was read with test_max_batches 4, the study's is 0 now: reading it " \
           "again" in capsys.readouterr().out
    assert not study.stale_tests() and seed_values(study, "pkm") == {0: 120.0, 1: 120.0, 2: 120.0}
    report = write_report(study).read_text()
    assert "| 120.0 ± 0.0 | 3/3 |" in report and "read on the whole test split" in report


def test_a_test_json_from_before_the_record_is_judged_by_its_run_json_test_command(tmp_path):
    """The committed studies' test.json files have no max_batches: their run.json's test command says it."""
    study = load_study(write_study(tmp_path, lr_grid=[1], seeds=[0], test_max_batches=4))
    run = study.run("pkm", 1, 0)
    fake_trained(run, [30.0], test=100.0)
    info = json.loads((run.results / "run.json").read_text())
    for command, read in (("python evaluate.py --checkpoint x/best.pt --split test --max-batches 4", 4),
                          ("python evaluate.py --checkpoint x/best.pt --split test", 0)):
        (run.results / "run.json").write_text(json.dumps({**info, "commands": {"test": command}}))
        assert run.test_read_with() == read and run.tested == (read == 4) and run.test_stale == (read != 4)


# 7. a report on a full disk

@contextmanager
def disk_full_past(size: int):
    """Every write past `size` bytes of a file fails (EFBIG) while in the block, as on a full disk (RLIMIT_FSIZE:
    whatever opens the file; Python ignores the SIGXFSZ that comes with it)."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_report_on_a_full_disk_is_one_line_and_keeps_the_previous_files(tmp_path, capsys):
    """Issue 83: a traceback, and a 0-byte learning_curves.png in place of the previous plot. Each file is written
    to a temporary name and renamed (utils/atomic.py); a failed write is one OutputError line, the previous kept."""
    path = write_study(tmp_path, lr_grid=[1], seeds=[0])
    study = load_study(path)
    for cell in study.cells:
        fake_trained(study.run(cell, 1, 0), [30.0, 20.0], test=100.0)
    out = tmp_path / "out"
    write_report(study)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"report.md", "learning_curves.png"} and min(map(len, before.values())) > 64
    (study.run("pkm", 1, 0).results / "test.json").write_text(json.dumps({"ppl": 90.0}))  # a new report differs

    with disk_full_past(64):
        with pytest.raises(OutputError) as failed:
            write_report(study)
        assert study_cli.main(["report", str(path)]) == 2
    message = str(failed.value)
    assert message.startswith(f"cannot write {out / 'learning_curves.png'}: ") and "\n" not in message
    assert message.endswith("; the previous learning_curves.png is kept")
    err = capsys.readouterr().err
    assert err == f"study: error: {message}\n"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # both files as they were, no temporary left
    assert write_report(study).read_bytes() != before["report.md"]  # room again: the new report


def test_a_report_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file where the report's folder would be\n")
    path = write_study(tmp_path, lr_grid=[1], seeds=[0], report=str(tmp_path / "taken" / "sub" / "report.md"))
    study = load_study(path)
    for cell in study.cells:
        fake_trained(study.run(cell, 1, 0), [30.0, 20.0], test=100.0)
    assert study_cli.main(["report", str(path)]) == 2
    folder = tmp_path / "taken" / "sub"
    assert capsys.readouterr().err == f"study: error: cannot create {folder} for the report: Not a directory\n"
