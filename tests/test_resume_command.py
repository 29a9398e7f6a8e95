"""Finding a run again and resuming it as a newcomer would: Ctrl-C stops with a checkpoint and prints the
command that resumes it, as launched and from where it was launched; train.exp_id=last finds the run."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import logged_losses

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.launch.cli import train_main
from xlm_pkm.launch.resume import launcher, resume_command, stop_status
from xlm_pkm.runtime.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
RESUME = "to resume (with the same launcher and number of processes): "


def test_the_resume_command_is_the_launch_command(monkeypatch):
    venv_bin = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", venv_bin)  # this interpreter is `python` on PATH: an activated venv
    assert launcher("train.py", {}) == ["python", "train.py"]
    assert launcher("../code/train.py", {}) == ["python", "../code/train.py"]  # as typed: works from here
    assert launcher("/opt/venv/bin/xlm-pkm-train", {}) == ["xlm-pkm-train"]
    assert launcher("/usr/bin/pytest", {}) == ["python", "train.py"]  # inside another program
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}
    assert launcher("train.py", torchrun) == ["torchrun", "--nnodes=2", "--nproc_per_node=4", "train.py"]
    assert launcher("train.py", {**torchrun, "WORLD_SIZE": "4"}) == ["torchrun", "--nproc_per_node=4", "train.py"]
    assert resume_command(["--no-test", "train.exp_id=a", "optim.lr=1e-3"], "b", "train.py", {}) == \
        "python train.py --no-test optim.lr=1e-3 train.exp_id=b"
    monkeypatch.setenv("PATH", "/nonexistent")  # not on PATH (venv not activated): the interpreter's own path
    assert launcher("train.py", {}) == [sys.executable, "train.py"]
    launched = {**torchrun, "XLM_PKM_LAUNCHER": "scripts/train_torchrun.sh 4"}  # a launcher script names itself
    assert resume_command(["a=1"], "b", "train.py", launched) == "scripts/train_torchrun.sh 4 a=1 train.exp_id=b"


def test_a_stop_reported_to_a_launcher_exits_0_with_the_line_written_by_rank_0(tmp_path):
    report = tmp_path / "report"
    assert stop_status("stopped", True, {}) == 75  # no launcher script: the usual status
    assert stop_status("stopped at step 3", False, {"XLM_PKM_STOP_REPORT": str(report)}) == 0
    assert not report.exists()  # rank 1 writes nothing
    assert stop_status("stopped at step 3", True, {"XLM_PKM_STOP_REPORT": str(report)}) == 0
    assert report.read_text() == "stopped at step 3\n"


@pytest.mark.slow
def test_ctrl_c_under_the_torchrun_script_checkpoints_and_exits_75_with_the_resume_line_last(tiny_overrides,
                                                                                           tmp_path):
    """Issue 63: torchrun used to print a SignalException traceback and exit 1. The terminal's Ctrl-C goes to the
    script's process group (here: killpg of the script, started in its own session); torchrun runs in another."""
    args = ["--no-test", *tiny_overrides(tmp_path, "train.exp_id=tr", "train.max_steps=100000",
                                         "train.num_threads=1")]
    script = subprocess.Popen(["bash", str(ROOT / "scripts" / "train_torchrun.sh"), "2", *args], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                                   "MASTER_PORT": str(free_port()), "PYTHON": sys.executable})
    metrics = tmp_path / "tiny" / "tr" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and '"step": 2,' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(script.pid, signal.SIGINT)
    out, err = script.communicate(timeout=120)
    assert script.returncode == 75, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("train.py: stopped at step ") and "checkpoint saved" in last, err
    kept = [a for a in args if not a.startswith("train.exp_id=")]
    assert last.endswith(shlex.join([str(ROOT / "scripts" / "train_torchrun.sh"), "2", *kept, "train.exp_id=tr"]))
    assert "Traceback" not in out + err and "SignalException" not in out + err
    assert checkpoint.load(tmp_path / "tiny" / "tr" / "checkpoint.pt")["step"] >= 2


@pytest.mark.slow
def test_ctrl_c_in_another_directory_saves_prints_the_resume_command_and_it_resumes(tiny_overrides, reference_run,
                                                                                    tmp_path):
    """A real SIGINT to a real `python ../train.py` launched outside the checkout; the printed command, run from
    the same directory, finishes the run with the losses of an uninterrupted one."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    script = os.path.relpath(ROOT / "train.py", cwd)
    args = ["--no-test", *tiny_overrides(tmp_path, "train.max_steps=100", "train.exp_id=ctrlc")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1"}
    run = subprocess.Popen(["python", script, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "tiny" / "ctrlc" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and '"step": 2,' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.01)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 75, err
    stop = checkpoint.load(tmp_path / "tiny" / "ctrlc" / "checkpoint.pt")["step"]
    assert 2 <= stop < 100 and f"stopping at step {stop} (SIGINT)" in out
    [command] = [line.split(RESUME, 1)[1] for line in out.splitlines() if RESUME in line]
    assert command == shlex.join(["python", script, *args])  # its exp_id already last
    resumed = subprocess.run(shlex.split(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {stop}" in resumed.stdout and RESUME not in resumed.stdout
    full = reference_run("train.max_steps=100")
    assert logged_losses(tmp_path / "tiny" / "ctrlc") == logged_losses(full.run_dir)


def test_a_second_ctrl_c_stops_at_once_in_one_line(tiny_overrides, tmp_path, capsys, monkeypatch):
    from xlm_pkm.train.trainer import Trainer

    step_once = Trainer.train_step

    def step_then_two_ctrl_c(self, batches):
        out = step_once(self, batches)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_two_ctrl_c)
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=twice")]) == 130
    captured = capsys.readouterr()
    assert captured.err == ("train.py: error: interrupted (Ctrl-C) at step 3, not saved. "
                            "No checkpoint was written by this run\n")
    assert RESUME not in captured.out and not (tmp_path / "tiny" / "twice" / "checkpoint.pt").exists()


def test_a_second_ctrl_c_during_a_checkpoint_write_waits_for_the_file_to_be_whole(tiny_overrides, tmp_path, capsys,
                                                                                 monkeypatch, signal_at_step):
    from xlm_pkm.checkpoint import files

    save_atomic = files.save_atomic

    def ctrl_c_while_writing(record, path):
        os.kill(os.getpid(), signal.SIGINT)  # arrives inside the write
        save_atomic(record, path)

    signal_at_step(3, signal.SIGINT)  # the first Ctrl-C: stop at the end of step 3, with a checkpoint
    monkeypatch.setattr(files, "save_atomic", ctrl_c_while_writing)
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=during")]) == 130
    captured = capsys.readouterr()
    path = tmp_path / "tiny" / "during" / "checkpoint.pt"
    assert captured.err == (f"train.py: error: interrupted (Ctrl-C) at step 3, after its checkpoint was written "
                            f"whole: {path}\n")
    assert checkpoint.load(path)["step"] == 3 and RESUME in captured.out
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_exp_id_last_resumes_the_latest_unfinished_run_and_refuses_otherwise(tiny_overrides, tmp_path, capsys,
                                                                             signal_at_step):
    last = ["--no-test", *tiny_overrides(tmp_path, "train.exp_id=last")]
    assert train_main(last) == 2
    assert capsys.readouterr().err == (f"train.py: error: train.exp_id=last: no run of tiny under {tmp_path} has a "
                                       f"checkpoint.pt to resume (start one without train.exp_id, or with a new one)\n")
    signal_at_step(3, signal.SIGTERM)
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=older")]) == 75
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=newer")]) == 75
    capsys.readouterr()
    signal_at_step(10**6)  # no more signals
    assert train_main(last) == 0  # resumes `newer`, the run that saved last
    out = capsys.readouterr().out
    assert f"run directory {tmp_path / 'tiny' / 'newer'} (resumed at step 3)" in out
    assert train_main(last) == 2  # `newer` is the latest, and it is finished
    assert capsys.readouterr().err == (
        f"train.py: error: train.exp_id=last: the latest run of tiny, {tmp_path / 'tiny' / 'newer'}, is finished "
        f"(step 8 of train.max_steps=8); to train it further give train.exp_id=newer and a larger train.max_steps\n")
    assert checkpoint.load(tmp_path / "tiny" / "older" / "checkpoint.pt")["step"] == 3  # untouched


@pytest.mark.slow
def test_a_run_resumes_from_its_own_config_with_none_of_its_overrides_retyped(tiny_overrides, reference_run, tmp_path,
                                                                              capsys, signal_at_step, monkeypatch):
    """Started with the tiny overrides and stopped at step 4, the run resumes from `train.exp_id=last` with only
    where to find it: its config.yaml is the base, and it continues as the uninterrupted run, bit for bit."""
    signal_at_step(4)
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=mine")]) == 75
    monkeypatch.undo()
    assert train_main(["--no-test", f"train.dump_path={tmp_path}", "train.exp_name=tiny", "train.exp_id=last"]) == 0
    assert f"run directory {tmp_path / 'tiny' / 'mine'} (resumed at step 4)" in capsys.readouterr().out
    run_dir = tmp_path / "tiny" / "mine"
    assert logged_losses(run_dir) == logged_losses(reference_run().run_dir)
    assert not list(run_dir.glob("config.until-step*.yaml"))  # nothing changed: the same config


@pytest.mark.slow
def test_an_override_on_resume_applies_on_top_of_the_runs_own_config(tiny_overrides, tmp_path, capsys):
    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=more", "train.max_steps=2")]) == 0
    assert train_main(["--no-test", f"train.dump_path={tmp_path}", "train.exp_name=tiny", "train.exp_id=more",
                       "train.max_steps=3", "optim.lr=1e-3"]) == 0
    assert "resumed at step 2" in capsys.readouterr().out
    run_dir = tmp_path / "tiny" / "more"
    saved = (run_dir / "config.yaml").read_text()
    assert "max_steps: 3" in saved and "lr: 0.001" in saved and "dim: 32" in saved
    assert (run_dir / "config.until-step2.yaml").is_file()


@pytest.mark.slow
def test_the_package_works_from_any_directory_with_the_venvs_python(tmp_path):
    """make installs the checkout into its venv (editable): a user's own script outside the checkout imports
    it, and the console commands run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = tmp_path / "mine.py"
    script.write_text("import xlm_pkm\nfrom xlm_pkm.model.memory import ProductKeyMemory\nprint(xlm_pkm.__file__)\n")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and Path(out.stdout.strip()) == ROOT / "xlm_pkm" / "__init__.py", out.stderr
    keys = subprocess.run([str(Path(sys.executable).parent / "xlm-pkm-train"), "--keys", "train"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert keys.returncode == 0 and re.search(r"^train\.save_every_minutes = 15\.0 +# ", keys.stdout, re.M), keys.stderr
