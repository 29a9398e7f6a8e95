"""Issue 83: a run's names and folder are the run's own. A run name is one folder name; nothing a run writes goes
through a symbolic link planted in its folder; a second stop signal while a run stops, or its folder removed while
it trains, each end in one line; a name too long for the file system is one line naming the option
(docs/reliability.md)."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xlm_pkm.launch.cli import evaluate_main, train_main
from xlm_pkm.utils.atomic import OutputError, atomic_file, check_writable, temporary_name, write_error, write_text
from xlm_pkm.utils.lock import DirectoryLock
from xlm_pkm.utils.path_component import check_path_component, check_path_length

ROOT = Path(__file__).resolve().parent.parent
RESUME = "to resume (with the same launcher and number of processes): "
LINK = "is a symbolic link: no output is written through a link"


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ---- 3. train.exp_name and train.exp_id are one folder name each, checked with the config -------------------


@pytest.mark.parametrize("value, why", [
    ("a/b", "no / or \\"), ("a\\b", "no / or \\"), (".", "not . or .."), ("..", "not . or .."),
    ("", "it is empty"), ("a\0b", "a NUL character"), ("a\udcffb", "not valid UTF-8"),  # undecodable argv bytes
    ("é" * 128, "256 bytes in UTF-8, more than the 255"),
])
def test_a_path_component_is_one_folder_name(value, why):
    problem = check_path_component(value, "train.exp_id")
    assert problem.startswith("train.exp_id: must be one file or folder name (") and why in problem, problem
    assert "\n" not in problem and len(problem) < 300


@pytest.mark.parametrize("value", ["run-1", "a" * 255, "é" * 127, "ünïcode name", "..x", ".hidden"])
def test_a_folder_name_of_up_to_255_bytes_is_one(value):
    assert check_path_component(value, "train.exp_id") is None


@pytest.mark.parametrize("key, value, why", [
    ("exp_id", "a" * 300, "300 bytes in UTF-8"),  # it raised OSError (File name too long) from the error handler
    ("exp_name", "é" * 200, "400 bytes in UTF-8"),
    ("exp_name", "a\udcffb", "not valid UTF-8"),  # it made a folder of undecodable bytes
    ("exp_id", "a\0b", "a NUL character"),
    ("exp_name", "", "it is empty"),
    ("exp_id", "..", "not . or .."),
])
def test_a_run_name_that_is_not_one_folder_name_is_refused_with_the_config(key, value, why, tiny_overrides, tmp_path,
                                                                            capsys):
    assert train_main(tiny_overrides(tmp_path, f"train.{key}={value}")) == 2
    line = one_line(capsys)
    assert line.startswith(f"train.py: error: train.{key}: must be one file or folder name (") and why in line, line
    assert not any(tmp_path.iterdir())  # refused before anything was created


# ---- 4. nothing a run writes goes through a symbolic link planted in its folder -----------------------------


def plant(link: Path, target_text: str = "not the run's\n") -> Path:
    """A symbolic link at `link` to a file outside the run directory; returns that file."""
    link.parent.mkdir(parents=True, exist_ok=True)
    target = link.parents[2] / f"target-of-{link.name}"
    target.write_text(target_text)
    link.symlink_to(target)
    return target


@pytest.mark.parametrize("name", [".lock", "train.log", "metrics.jsonl", "config.yaml", "checkpoint.dcp"])
def test_a_link_planted_in_the_run_directory_is_refused_and_its_target_untouched(name, tiny_overrides, tmp_path,
                                                                                capsys):
    """.lock: its target was truncated and overwritten with the lock holder's line; train.log and metrics.jsonl:
    appended to; checkpoint.dcp (a link to a folder): the checkpoint's tensors written there."""
    link = tmp_path / "dump" / "tiny" / "planted" / name
    target = plant(link)
    assert train_main(["--no-test", *tiny_overrides(tmp_path / "dump", "train.exp_id=planted",
                                                     "train.max_steps=2")]) == 2
    assert one_line(capsys) == f"train.py: error: {link} {LINK} (it may point anywhere, its target is left " \
                               f"untouched); remove it"
    assert target.read_text() == "not the run's\n" and link.is_symlink()


def test_the_files_a_run_appends_to_are_opened_without_following_a_link(tmp_path):
    """Planted after the start-up's look (refuse_links): the logger, the lock and the metrics' rewrite on resume
    open the file itself, never the link's target."""
    from xlm_pkm.train.run_log import RunLogger, drop_events_after

    for name in ("train.log", "metrics.jsonl"):
        run_dir = tmp_path / name / "a" / "run"
        target = plant(run_dir / name)
        with pytest.raises(OutputError, match=f"^{run_dir / name} {LINK}"):
            RunLogger(run_dir, True)
        assert target.read_text() == "not the run's\n"
    target = plant(tmp_path / "lock" / "a" / "run" / ".lock")
    with pytest.raises(OutputError, match=LINK):
        DirectoryLock(tmp_path / "lock" / "a" / "run", ".lock", "")
    assert target.read_text() == "not the run's\n"
    target = plant(tmp_path / "drop" / "a" / "run" / "metrics.jsonl", '{"step": 9}\n')
    with pytest.raises(OutputError, match=LINK):
        drop_events_after(tmp_path / "drop" / "a" / "run" / "metrics.jsonl", 1)
    assert target.read_text() == '{"step": 9}\n'


def test_a_temporary_file_is_created_never_opened_where_a_link_is(tmp_path, monkeypatch):
    """atomic_file and check_writable create their temporary file (O_CREAT | O_EXCL | O_NOFOLLOW): one planted at
    that name (a link to another file) was truncated, written, then renamed over the output."""
    from xlm_pkm.utils import atomic

    out = tmp_path / "a" / "b" / "out.json"
    planted = out.with_name("out.json.1.planted.tmp")
    target = plant(planted)
    monkeypatch.setattr(atomic, "temporary_name", lambda path: planted)
    with pytest.raises(OutputError, match=f"^cannot write {out}: File exists"):
        write_text(out, "result\n")
    with pytest.raises(OutputError, match=f"^cannot write {out}: File exists"):
        check_writable(out)
    assert target.read_text() == "not the run's\n" and planted.is_symlink() and not out.exists()


def test_the_tensorboard_events_of_a_run_read_back(tmp_path):
    """The run's own event file (EventFile, in place of TensorBoard's writer, which reopens the file by name at every
    write from its own thread): scalars, histograms, and a resume's purge of the events after its step."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from xlm_pkm.train.run_log import RunLogger

    log = RunLogger(tmp_path, True)
    for step in (1, 2, 3):
        log.event("train", step, loss=float(step))
    log.histogram("memory/weights", torch.arange(10.0), 1)
    log.close()
    resumed = RunLogger(tmp_path, True, resume_step=1)  # steps 2 and 3 dropped, as after a crash at step 3
    resumed.event("train", 2, loss=20.0)
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 20.0)]
    assert events.Histograms("memory/weights")[0].histogram_value.num == 10


# ---- 8. a second SIGTERM while a run stops ---------------------------------------------------------------------


@pytest.mark.slow
def test_more_sigterms_while_a_run_stops_change_nothing(tiny_overrides, tmp_path):
    """One process: after the first SIGTERM (checkpoint, stop), SIGTERMs every 20 ms until the process is gone.
    It ended with status 143 (one landing after train_main, while the process exited), or with `stopped by SIGTERM
    after training, during the test evaluation` under --no-test (one landing while the run closed)."""
    import torch

    args = ["--no-test", *tiny_overrides(tmp_path, "train.max_steps=300", "train.exp_id=twice")]
    out_path = tmp_path / "stdout"
    with open(out_path, "w") as out:
        run = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=out,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics = tmp_path / "tiny" / "twice" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and '"step": 3,' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.01)
    run.send_signal(signal.SIGTERM)
    while "stopping at step" not in out_path.read_text() and run.poll() is None and time.time() < deadline:
        time.sleep(0.001)
    while run.poll() is None and time.time() < deadline:  # through the save, the close and the process's exit
        run.send_signal(signal.SIGTERM)
        time.sleep(0.02)
    err = run.communicate(timeout=120)[1]
    assert run.returncode == 75 and err == "", err
    stdout = out_path.read_text()
    step = torch.load(tmp_path / "tiny" / "twice" / "checkpoint.pt", weights_only=False)["step"]
    assert f"stopping at step {step} (SIGTERM)" in stdout and RESUME in stdout, stdout[-2000:]


def test_a_signal_outside_the_test_evaluation_is_not_said_to_be_during_it():
    from xlm_pkm.launch.cli import _stopped_outside_training

    class Closing:
        saved_step = 4

    assert "during the test evaluation" not in str(_stopped_outside_training(Closing(), "SIGTERM", testing=False))
    assert "during the test evaluation" in str(_stopped_outside_training(Closing(), "SIGTERM", testing=True))


# ---- 9. the run directory removed while the run trains ----------------------------------------------------------


def test_a_run_directory_removed_while_training_is_one_line_and_no_resume(tiny_overrides, tmp_path, capsys,
                                                                         monkeypatch):
    """It was a traceback of TensorBoard's writer thread (the events file, reopened by name, gone), then `[Errno 2]
    No such file or directory: ...tfevents...`, and with a checkpoint saved before, a resume command for a run
    that no longer exists."""
    from xlm_pkm.train.trainer import Trainer

    step_once = Trainer.train_step

    def step_then_remove(self, batches):
        out = step_once(self, batches)
        if self.step == 3:
            shutil.rmtree(self.run_dir)
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_remove)
    run_dir = tmp_path / "tiny" / "gone"
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=gone", "train.max_steps=20",
                                                     "train.save_every_steps=2")]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"train.py: error: {run_dir} was removed (or moved away) while the run trained: "
                            f"stopped at step 3; its checkpoints and logs went with it\n")
    assert RESUME not in captured.out and not run_dir.exists()


def test_a_run_directory_removed_during_a_save_is_the_same_line(tiny_overrides, tmp_path, capsys, monkeypatch):
    """Removed after the step's look, before its evaluation writes best.pt: the failed write says the same."""
    from xlm_pkm.train.trainer import Trainer

    validate = Trainer.validate

    def remove_then_validate(self):
        shutil.rmtree(self.run_dir)
        return validate(self)

    monkeypatch.setattr(Trainer, "validate", remove_then_validate)
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=gone", "train.max_steps=20",
                                                     "train.eval_every=2")]) == 2
    assert one_line(capsys).endswith("was removed (or moved away) while the run trained: stopped at step 2; its "
                                     "checkpoints and logs went with it")


# ---- 13. a name longer than the file system allows ---------------------------------------------------------------


def test_evaluate_json_with_a_name_too_long_is_one_line_naming_the_option(tmp_path, capsys):
    """It was an OSError traceback (File name too long) from the check of the --json file itself."""
    name = "r" * 300 + ".json"
    assert evaluate_main(["--checkpoint", str(tmp_path / "missing.pt"), "--json", str(tmp_path / name)]) == 2
    line = one_line(capsys)
    assert line.startswith("evaluate.py: error: --json: the name 'rrrr") and "305 bytes, more than the 255" in line
    assert check_path_length(str(tmp_path / "x" / ("r" * 255)), "--json") is None
    assert "4097 bytes" in check_path_length("/" + "d/" * 2048, "--json")


def test_the_error_of_a_name_too_long_never_raises_itself(tmp_path):
    """write_error looked the name up again (Path.exists), which raised OSError: File name too long."""
    long = tmp_path / ("n" * 300)
    error = write_error(long, OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG)))
    assert str(error) == f"cannot write {long}: File name too long"
    with pytest.raises(OutputError, match="File name too long$"):
        write_text(long, "x")
    with pytest.raises(OutputError, match="File name too long$"):
        DirectoryLock(tmp_path / ("d" * 300), ".lock", "")  # a dump_path or run name past what a system allows


def test_a_name_that_fits_gets_a_temporary_name_that_fits(tmp_path):
    """A 250-byte output name: its temporary file's (NAME.PID.TOKEN.tmp) went past 255 bytes, and the write failed."""
    for name in ("n" * 250, "é" * 125):
        tmp = temporary_name(tmp_path / name)
        assert len(os.fsencode(tmp.name)) <= 255 and tmp.name.endswith(".tmp") and tmp.parent == tmp_path
        write_text(tmp_path / name, "whole\n")
        assert (tmp_path / name).read_text() == "whole\n"
    with atomic_file(tmp_path / "short.json", "w", encoding="utf-8") as f:  # the text modes still work
        f.write("{}\n")
    assert (tmp_path / "short.json").read_text() == "{}\n"


def test_a_run_log_closed_twice_closes_once(tmp_path):
    """A trainer closed by its run and again by its caller (tests/test_retrofit.py does) closed its events file a
    second time: 'flush of closed file' (TensorBoard's writer, which it replaces, allowed it)."""
    from xlm_pkm.train.run_log import RunLogger

    log = RunLogger(tmp_path, True)
    log.event("train", 1, loss=1.0)
    log.close()
    log.close()
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
